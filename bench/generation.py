"""Decode overhead: time per generated token of each sampler vs the raw KV-cached forward it runs on.

    python bench/generation.py                       # tiny Qwen2 (issue setting): 32 rows, 64 new tokens
    python bench/generation.py --model /path/to/hf_model --prompts 2 --new-tokens 128
    python bench/generation.py --model "$(python -m grpo_dist.tools.smollm2)" --only lean hf --reps 2   # real model

Decode time per token = (T(new_tokens) - T(1)) / (new_tokens - 1), so the prefill (and tokenisation, text
decoding) cancels out. Raw forwards, fed fixed tokens with no sampling (the floor a sampler on them pays):
grpo_dist.decoder.LeanDecoder's step, and the model's own transformers forward with its cache. Samplers: lean =
grpo_dist's sampling loop on LeanDecoder (what the trainer uses); lean+multinomial = the same drawing with
torch.multinomial instead of the inverse CDF; loop on hf forward = the same loop on the transformers forward
(lean_decoder=false); hf = transformers' generate. Each is reported against the raw forward it runs on. Every
sampler emits exactly new_tokens (min length = max length). Medians over --reps alternating runs, in CPU seconds of
this process (one thread: close to wall time on an idle machine) and in wall seconds. Last line: JSON.

    python bench/generation.py --long-tail                      # decode compaction on vs off, tiny model
    python bench/generation.py --long-tail --model "$(python -m grpo_dist.tools.smollm2)" --rows 32 --scale 0.125

--long-tail: rows of long-tailed lengths (lognormal, median 200 x scale, p95 900 x scale, cap 1024 x scale, drawn
reproducibly from --seed; each row's length forced by EOS placement, grpo_dist.compaction.ForcedLengths), sampled
with per-row noise on the lean (and hf: --engines) decoder, decode_compaction_threshold off and at each
--thresholds value. Per setting: decode wall time (prefill included), rows computed vs tokens generated, padding
fraction = 1 - generated / computed, and whether tokens and log-probs equal those without compaction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF causal LM directory (default: the tiny Qwen2 of the issue)")
    ap.add_argument("--tiny-hidden", type=int, default=128)
    ap.add_argument("--tiny-layers", type=int, default=4)
    ap.add_argument("--tiny-vocab", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="run only these samplers/forwards (e.g. --only lean hf: the rollout "
                    "comparison on a real model without the four other runs)")
    ap.add_argument("--long-tail", action="store_true", help="decode compaction on vs off on long-tailed lengths")
    ap.add_argument("--rows", type=int, default=64, help="--long-tail: decode rows (prompts x G)")
    ap.add_argument("--scale", type=float, default=0.125, help="--long-tail: lengths x this (1: median 200, cap 1024)")
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.25], help="--long-tail: compaction thresholds")
    ap.add_argument("--engines", nargs="*", default=["lean"], help="--long-tail: lean, hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="--long-tail: cpu or cuda")
    ap.add_argument("--cuda-graphs", action="store_true", help="--long-tail on cuda: lean also with CUDA graphs "
                    "(lean_cuda_graphs), as engine 'lean+graphs'")
    args = ap.parse_args()
    if args.cuda_graphs and args.device == "cpu":
        ap.error("--cuda-graphs needs --device cuda")
    if args.long_tail:
        return long_tail(args)

    import torch

    import grpo_dist.rollout as ro
    from bench_common import tiny_override
    from grpo_dist.config import load_config
    from grpo_dist.data import load_examples, render_prompt
    from grpo_dist.decoder import LeanDecoder, prepare_replica
    from grpo_dist.models import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.name_or_path={args.model}" if args.model else
                             tiny_override(args.tiny_hidden, args.tiny_layers, args.tiny_vocab)])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok).eval().requires_grad_(False)
    prompts = [render_prompt(e, cfg.data, tok) for e in load_examples(cfg.data, "train")[:args.prompts]]
    refs = ["0"] * len(prompts)
    G, N = args.num_generations, args.new_tokens
    multinomial = lambda scores: torch.multinomial(scores.softmax(-1), 1).squeeze(1)  # noqa: E731
    lean_draw = ro.sample_from_scores

    def sampler(kind, n):
        ro.sample_from_scores = multinomial if kind == "lean+multinomial" else lean_draw
        return ro.generate_rollouts(model, tok, prompts, refs, num_generations=G, max_completion_length=n,
                                    min_completion_length=n,
                                    use_hf_generate=kind == "hf", lean_decoder=kind != "loop on hf forward")

    ids, mask = ro.tokenize_prompts(tok, prompts, 512, "cpu")
    repeats = torch.full((len(ids),), G)

    @torch.inference_mode()
    def raw(decoder, n):
        """Prefill, then n - 1 steps of the cached batch fed fixed tokens: the forward alone, no sampling."""
        decoder.prefill(ids, mask, repeats, n)
        nxt = ids[:, -1].repeat_interleave(G)
        for _ in range(n - 1):
            decoder.step(nxt)

    prepare_replica(model)  # as the trainer prepares its generation replica
    runs = {"raw lean decoder": lambda n: raw(LeanDecoder(model), n),
            "raw hf forward": lambda n: raw(ro.HFDecoder(model), n),
            "lean": lambda n: sampler("lean", n),
            "lean+multinomial": lambda n: sampler("lean+multinomial", n),
            "loop on hf forward": lambda n: sampler("loop on hf forward", n),
            "hf": lambda n: sampler("hf", n)}
    # each sampler against the forward it runs on
    baseline = {"raw lean decoder": "raw lean decoder", "raw hf forward": "raw hf forward",
                "lean": "raw lean decoder", "lean+multinomial": "raw lean decoder",
                "loop on hf forward": "raw hf forward", "hf": "raw hf forward"}
    kinds = list(runs)
    if args.only:
        unknown = set(args.only) - set(runs)
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}; choose from {list(runs)}")
        kinds = [k for k in kinds if k in args.only]
    per_tok = {k: {"cpu": [], "wall": []} for k in kinds}
    for rep in range(args.reps + 1):
        for kind in (kinds if rep % 2 else kinds[::-1]):
            t = {}
            for n in (1, N):
                w0, c0 = time.perf_counter(), time.process_time()
                runs[kind](n)
                t[n] = (time.perf_counter() - w0, time.process_time() - c0)
            if rep == 0:
                continue  # warm-up
            per_tok[kind]["wall"].append((t[N][0] - t[1][0]) / (N - 1))
            per_tok[kind]["cpu"].append((t[N][1] - t[1][1]) / (N - 1))
    ro.sample_from_scores = lean_draw
    med = {k: {m: statistics.median(v[m]) for m in ("cpu", "wall")} for k, v in per_tok.items()}
    print(f"{len(ids) * G} rows x {N} new tokens, prompt width {ids.shape[1]}, {args.threads} thread(s), load "
          f"average {os.getloadavg()[0]:.2f}")
    print(f"{'sampler':20} {'cpu ms/token':>13} {'vs its raw':>10} {'wall ms/token':>14} {'vs its raw':>10}")
    rows = len(ids) * G
    # each against its raw forward (None when --only left that forward out)
    vs_raw = {k: {m: med[k][m] / med[baseline[k]][m] if baseline[k] in med else None for m in ("cpu", "wall")}
              for k in kinds}
    show = lambda x: f"{x:10.2f}" if x is not None else f"{'-':>10}"  # noqa: E731
    for k in kinds:
        print(f"{k:20} {med[k]['cpu'] * 1e3:13.2f} {show(vs_raw[k]['cpu'])} "
              f"{med[k]['wall'] * 1e3:14.2f} {show(vs_raw[k]['wall'])}")
    print("decode tokens/s (rows / time per token): " + ", ".join(
        f"{k} {rows / med[k]['wall']:.0f} wall, {rows / med[k]['cpu']:.0f} cpu" for k in kinds))
    print(json.dumps(dict(rows=len(ids) * G, new_tokens=N, threads=args.threads,
                          load_average=round(os.getloadavg()[0], 2),
                          ms_per_token_cpu={k: round(v["cpu"] * 1e3, 3) for k, v in med.items()},
                          ms_per_token_wall={k: round(v["wall"] * 1e3, 3) for k, v in med.items()},
                          tokens_per_s_wall={k: round(rows / v["wall"], 1) for k, v in med.items()},
                          tokens_per_s_cpu={k: round(rows / v["cpu"], 1) for k, v in med.items()},
                          overhead_vs_raw_cpu={k: v["cpu"] and round(v["cpu"], 3) for k, v in vs_raw.items()},
                          overhead_vs_raw_wall={k: v["wall"] and round(v["wall"], 3) for k, v in vs_raw.items()})))


def long_tail_lengths(rows: int, scale: float, seed: int) -> list[int]:
    """Lognormal lengths with median 200 x scale and p95 900 x scale (sigma = ln(900 / 200) / 1.645), capped at
    1024 x scale, at least 1."""
    import numpy as np
    sigma = np.log(900 / 200) / 1.6448536
    z = np.random.default_rng(seed).standard_normal(rows)
    cap = max(1, round(1024 * scale))
    return [int(min(cap, max(1, round(200 * scale * np.exp(sigma * x))))) for x in z]


def long_tail(args) -> None:
    import torch

    from bench_common import tiny_override
    from grpo_dist.compaction import ForcedLengths
    from grpo_dist.config import load_config
    from grpo_dist.decoder import LeanDecoder, prepare_replica
    from grpo_dist.models import load_model, load_tokenizer
    from grpo_dist.rollout import HFDecoder, _sample_loop
    from grpo_dist.sampling_noise import row_noise, row_seeds

    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.name_or_path={args.model}" if args.model else
                             tiny_override(args.tiny_hidden, args.tiny_layers, args.tiny_vocab)])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok).eval().requires_grad_(False).to(args.device)
    prepare_replica(model)
    engines = list(args.engines) + (["lean+graphs"] if args.cuda_graphs else [])
    G = args.num_generations
    prompts = max(1, args.rows // G)
    rows = prompts * G
    lengths = torch.tensor(long_tail_lengths(rows, args.scale, args.seed))
    cap = int(lengths.max())
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, min(len(tok), 1000), (prompts, 24), generator=g).to(args.device)
    mask = torch.ones_like(ids)
    repeats = torch.full((prompts,), G, device=args.device)
    noise = row_noise(row_seeds(args.seed, 0, range(prompts), G), cap, args.device)
    eos = tok.eos_token_id

    def run(engine, threshold):
        decoder = HFDecoder(model) if engine == "hf" else LeanDecoder(model, cuda_graphs=engine == "lean+graphs")
        steps: list = []
        stats: dict = {}
        t0 = time.perf_counter()
        tokens = _sample_loop(ForcedLengths(decoder, lengths, eos), ids, mask, repeats, max_new_tokens=cap,
                              temperature=1.0, top_p=1.0, top_k=0, min_new_tokens=0, do_sample=True,
                              eos_ids=torch.tensor([eos], device=args.device), pad=tok.pad_token_id,
                              logprobs_out=steps, noise=noise, compaction_threshold=threshold, stats=stats)
        if args.device != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        lp = torch.stack(steps, 1)
        kept = [(tokens[i, :n].cpu(), lp[i, :n].cpu()) for i, n in enumerate(lengths.tolist())]
        return wall, stats["decode_row_steps"], kept

    settings = [(e, t) for e in engines for t in [None] + list(args.thresholds)]
    times: dict = {s: [] for s in settings}
    computed, outputs = {}, {}
    for rep in range(args.reps):
        for s in (settings if rep % 2 == 0 else settings[::-1]):
            wall, row_steps, kept = run(*s)
            times[s].append(wall)
            computed[s], outputs[s] = row_steps, kept
    useful = int(lengths.sum())
    print(f"{rows} rows ({prompts} prompts x {G}), lengths median {int(lengths.median())} max {cap} (scale "
          f"{args.scale}), {useful} tokens generated, {args.threads} thread(s), load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'engine':6} {'threshold':>9} {'decode s':>9} {'rows computed':>14} {'padding':>8} {'identical':>9}")
    result: dict = {"rows": rows, "tokens_generated": useful, "max_length": cap, "scale": args.scale,
                    "threads": args.threads, "load_average": round(os.getloadavg()[0], 2), "settings": []}
    for e, t in settings:  # identical: to the same engine without compaction (lean+graphs: to eager lean)
        ref = outputs[("lean" if e == "lean+graphs" and "lean" in engines else e, None)]
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(outputs[(e, t)], ref))
        sec, pad = statistics.median(times[(e, t)]), 1 - useful / computed[(e, t)]
        print(f"{e:6} {str(t):>9} {sec:9.2f} {computed[(e, t)]:14d} {pad:8.1%} {str(same):>9}")
        result["settings"].append({"engine": e, "threshold": t, "decode_s": round(sec, 3),
                                   "rows_computed": computed[(e, t)], "padding_fraction": round(pad, 4),
                                   "identical": same})
    for e in engines:
        off = statistics.median(times[(e, None)])
        for t in args.thresholds:
            result[f"{e}_time_ratio_{t}"] = round(statistics.median(times[(e, t)]) / off, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
