"""Long chains of thought (issue 29): one GRPO step on a long-tailed completion-length distribution, with the levers
on and off, at 2 ranks (torchrun, gloo, one thread per rank).

    python bench/long_cot.py --model DIR      # DIR: SmolLM2-135M-Instruct's HF directory; the tiny model too
    python bench/long_cot.py --quick          # the tiny model only, short lengths (a smoke run)
    python bench/long_cot.py --model DIR --no-tiny --prompts 8 --length-cap 256   # a reduced real-model run

Lengths: lognormal (median 200, p95 900, capped at 1024; --quick: 20 / 90 / 128), one per row of the step's
16 prompts x G = 8, drawn from a fixed seed; each row gets exactly its length: the decoder is wrapped so that EOS is
banned before the row's last step and forced at it (rows are followed through a decoder that compacts its batch,
as long as it keeps the order of the rows left). Everything else is the trainer's own step: the rollout engine
(lean), a cheap reward, the reference, old (num_iterations=2) and training passes.

Configurations ("levers"): off = today's path (padded rows, micro_batch_size 16, decode as it is); on = every lever
(padding_free, max_tokens_per_micro_batch, and decode_compaction_threshold where the config has that key); with
--all-configs (default for the tiny model) also each lever alone. Each configuration runs in its own torchrun job
(peak RSS is a per-process figure).

Per configuration and phase it prints time, tokens computed vs needed (tokens/processed_* and tokens/useful_*; the
decode's from the trainer's tokens/*_decode metrics where it logs them, else counted from the lengths: a decoder
that keeps every row computes rows x longest), and peak RSS per rank. The last line is one JSON object: for the
real model (the tiny one under --quick) time_ratio (rollout + log-probs + update, every lever on over every lever
off), padding_fraction per pass with the levers on ((computed - needed) / computed), peak_rss_ratio (the larger
rank's peak RSS, on over off), and every configuration's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import peak_rss_mib, tiny_override  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PASSES = ("decode", "reference", "old", "train")


def lengths(n: int, median: float, p95: float, cap: int, seed: int = 0) -> list[int]:
    """n completion lengths from a lognormal with this median and 95th percentile, in [1, cap] (reproducible)."""
    import numpy as np
    sigma = math.log(p95 / median) / 1.6448536269514722  # the standard normal's 95th percentile
    z = np.random.default_rng(seed).standard_normal(n)
    return [int(min(cap, max(1, round(median * math.exp(sigma * x))))) for x in z]


class ForcedLengths:
    """A decoder wrapper (prefill/step/compact as grpo_dist.rollout's decoders) that makes row r end with EOS at
    exactly its target length: EOS banned before the row's last step, forced at it. Unlike
    grpo_dist.compaction.ForcedLengths it follows the rows across the chunks of a rollout (generation_batch_size)."""

    def __init__(self, decoder, targets: list[int], eos: list[int]):
        self.decoder, self.targets, self.eos = decoder, targets, eos
        self.cursor = 0  # the first row of the current chunk
        self.compactions, self.compaction_s = 0, 0.0  # the cost of compaction itself (KV cache copies)

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def prefill(self, ids, mask, repeats, max_new_tokens):
        import torch
        logits = self.decoder.prefill(ids, mask, repeats, max_new_tokens)
        n, dev = logits.shape[0], logits.device
        self.row_targets = torch.tensor(self.targets[self.cursor:self.cursor + n], device=dev)
        self.cursor += n
        self.t = 0
        eos = torch.as_tensor(self.eos, device=dev)
        self.banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev).index_fill_(0, eos, True)
        self.first_eos = torch.zeros_like(self.banned).index_fill_(0, eos[:1], True)
        return self._force(logits)

    def step(self, tokens):
        self.t += 1
        return self._force(self.decoder.step(tokens))

    def compact(self, keep):
        """The decoder drops rows (grpo_dist.compaction: the unfinished ones plus finished fillers up to a bucket
        size): keep the targets of the rows it keeps, in its order. Timed: the copy is the cost of compaction
        (on a CPU the copy is synchronous; on a GPU the time would need a synchronize)."""
        t0 = time.perf_counter()
        self.decoder.compact(keep)
        self.compaction_s += time.perf_counter() - t0
        self.compactions += 1
        self.row_targets = self.row_targets[keep]

    def _force(self, logits):
        """EOS banned; in the rows whose last step this is, the first EOS id the only token left. On the device,
        with no host sync and no copy of the logits beyond the one torch.where writes (the former boolean indexing
        synced twice per step and inflated the decode time this bench reports)."""
        import torch
        if logits.shape[0] != self.row_targets.shape[0]:
            raise RuntimeError(f"decoder batch of {logits.shape[0]} rows, {self.row_targets.shape[0]} rows tracked")
        end = (self.row_targets - 1 == self.t)[:, None]
        forced = torch.where(self.first_eos, 0.0, float("-inf")).to(logits.dtype)
        return torch.where(end, forced, logits.masked_fill(self.banned, float("-inf")))


def _configs(has_compaction: bool, budget: int, threshold: str | None = None) -> dict[str, list[str]]:
    """Each configuration's overrides: off (today's path), each lever alone, on (every lever). threshold: the
    decode_compaction_threshold of the configurations with compaction (None: the key's default)."""
    no_compaction = ["decode_compaction_threshold=null"] if has_compaction else []  # null: compact never
    padded, packed = ["padding_free=false", "micro_batch_size=16"], ["padding_free=true", "micro_batch_size=16"]
    budgeted = ["micro_batch_size=64", f"max_tokens_per_micro_batch={budget}"]
    compaction = [f"decode_compaction_threshold={threshold}"] if has_compaction and threshold is not None else []
    out = {"off": padded + no_compaction, "padding_free": packed + no_compaction,
           "token_budget": ["padding_free=false"] + budgeted + no_compaction}
    if has_compaction:
        out["decode_compaction"] = padded + compaction
    out["on"] = ["padding_free=true"] + budgeted + compaction
    return out


# ------------------------------------------------------------------------------------------ one torchrun job
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from grpo_dist import distributed as gdist
    from grpo_dist import rollout_engines
    from grpo_dist.config import load_config
    from grpo_dist.trainer import GRPOTrainer

    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    rows_per_rank = args.prompts_per_rank * args.num_generations
    targets_all = lengths(rows_per_rank * world, args.median, args.p95, args.cap)
    targets = targets_all[rank * rows_per_rank:(rank + 1) * rows_per_rank]
    out_dir = tempfile.mkdtemp(prefix="bench_long_cot_")
    overrides = [
        f"num_generations={args.num_generations}", f"prompts_per_rank={args.prompts_per_rank}",
        f"max_completion_length={args.cap}", f"data.max_prompt_length={args.max_prompt_length}", "beta=0.04",
        "num_iterations=2", "max_steps=1", "reward_workers=0", "report_to=[]", "progress_bar=false",
        "save_final=false", "save_steps=0", f"output_dir={out_dir}", "learning_rate=1e-6",
        "distributed.num_threads=1", "rewards=[{function: 'bench_common:digit_reward', weight: 1.0}]",
        "rollout_engine=lean", "temperature=1.0"]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    else:
        overrides += [tiny_override(128, 4, 1024).replace("}", f", max_position_embeddings: "
                                                               f"{args.max_prompt_length + args.cap}}}")]
    cfg = load_config(None, overrides + json.loads(args.config))
    ctx = gdist.init_distributed(cfg.distributed.timeout_s, 1)
    trainer = GRPOTrainer(cfg, ctx)
    eos = list(trainer.sampling_spec().eos_ids)
    make = rollout_engines.make_decoder
    wrappers: list[ForcedLengths] = []

    def forced(*a, **k):
        wrappers.append(ForcedLengths(make(*a, **k), targets, eos))
        return wrappers[-1]
    rollout_engines.make_decoder = forced
    gdist.barrier()
    m = trainer.train_step()
    mine = {"peak_rss_mib": round(peak_rss_mib(), 1), "compactions": sum(w.compactions for w in wrappers),
            "compaction_s": round(sum(w.compaction_s for w in wrappers), 4)}
    decode = {"processed": float(m["tokens/processed_decode"]), "useful": float(m["tokens/useful_decode"]),
              "source": "metrics"} if "tokens/processed_decode" in m else None
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    if decode is None:  # every row kept until the rank's longest ends (today's decoder)
        lens = [targets_all[r * rows_per_rank:(r + 1) * rows_per_rank] for r in range(world)]
        decode = {"processed": float(sum(len(x) * max(x) for x in lens)), "useful": float(sum(targets_all)),
                  "source": "counted (rows x longest per rank)"}
    if ctx.is_main:
        expected_mean = sum(targets_all) / len(targets_all)
        if abs(m["completion_length_mean"] - expected_mean) > 1e-6:
            raise RuntimeError(f"completion lengths {m['completion_length_mean']} != forced {expected_mean}")
        # useful: the real tokens less the prompt copies share_prompts did not need (processed - useful = padding)
        tokens = {"decode": decode, **{p: {"processed": float(m[f"tokens/processed_{p}"]),
                                           "useful": float(m[f"tokens/useful_{p}"]) -
                                           float(m.get(f"tokens/shared_{p}", 0.0))} for p in PASSES[1:]}}
        print(json.dumps({
            "time_s": {"rollout": round(m["time_rollout_s"], 3), "logprobs": round(m.get("time_logprobs_s", 0.0), 3),
                       "update": round(m["time_update_s"], 3), "reward": round(m["time_reward_s"], 3)},
            "tokens": tokens, "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
            "compactions_per_rank": [r["compactions"] for r in per_rank],
            "compaction_s_per_rank": [r["compaction_s"] for r in per_rank],
            "completion_length_mean": m["completion_length_mean"], "completion_length_max": m["completion_length_max"],
        }), flush=True)
    # FSDP modules released while the process group lives, then out without the interpreter's teardown (a C++
    # thread meeting a finalizing interpreter aborted ranks: "terminate called without an active exception")
    del trainer
    import gc
    gc.collect()
    gdist.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------------- driver
def run_config(args, model: str | None, name: str, overrides: list[str], scale: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", "localhost:0", str(Path(__file__).resolve()), "--worker",
           "--config", json.dumps(overrides), "--prompts-per-rank", str(args.prompts // args.ranks),
           "--num-generations", "8", "--median", str(scale["median"]), "--p95", str(scale["p95"]),
           "--cap", str(scale["cap"]), "--max-prompt-length", str(args.max_prompt_length)]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{name}: torchrun exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    t = res["time_s"]
    res["step_s"] = round(t["rollout"] + t["logprobs"] + t["update"], 3)
    for pas in res["tokens"].values():
        pas["padding_fraction"] = round(1 - pas["useful"] / pas["processed"], 4) if pas["processed"] else 0.0
    tok = " ".join(f"{k} {v['processed']:.0f}/{v['useful']:.0f}" for k, v in res["tokens"].items())
    print(f"{model or 'tiny'} {name}: rollout {t['rollout']:.1f} s, log-probs {t['logprobs']:.1f} s, update "
          f"{t['update']:.1f} s (sum {res['step_s']:.1f}); tokens computed/needed {tok}; peak RSS per rank "
          f"{res['peak_rss_mib_per_rank']} MiB; compactions per rank {res['compactions_per_rank']} taking "
          f"{res['compaction_s_per_rank']} s", flush=True)
    return res


def summary(runs: dict) -> dict:
    if "on" not in runs or "off" not in runs:  # --only: no ratio without both halves
        return {}
    on, off = runs["on"], runs["off"]
    return {"time_ratio": round(on["step_s"] / off["step_s"], 4),
            "padding_fraction": {k: on["tokens"][k]["padding_fraction"] for k in PASSES},
            "peak_rss_ratio": round(max(on["peak_rss_mib_per_rank"]) / max(off["peak_rss_mib_per_rank"]), 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="SmolLM2-135M-Instruct's HF directory (the real-model runs)")
    ap.add_argument("--quick", action="store_true", help="the tiny model only, lengths median 20 / p95 90 / cap 128")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-prompt-length", type=int, default=128)
    ap.add_argument("--budget", type=int, default=0, help="max_tokens_per_micro_batch of the 'on' configurations "
                    "(0: 2048, --quick 1024; at 4096 and 8192 a rank of the full-size SmolLM2 step reached "
                    "12 GB and 2 ranks ran a 24 GB machine out of memory; at 2048 9.9 GB)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step, all ranks (G = 8 rows each)")
    ap.add_argument("--length-cap", dest="scale_cap", type=int, default=0, help="a reduced run: cap the lengths "
                    "at N, median and p95 scaled by N / 1024 (0: 1024, --quick 128)")
    ap.add_argument("--no-tiny", action="store_true", help="with --model: skip the tiny model's runs")
    ap.add_argument("--threshold", help="decode_compaction_threshold of the configurations with compaction "
                    "(default: the key's default)")
    ap.add_argument("--all-configs", action=argparse.BooleanOptionalAction, default=None,
                    help="each lever alone too (default: for the tiny model, not for the real one)")
    ap.add_argument("--only", help="comma-separated configurations to run (e.g. 'on': the full-size memory check "
                    "of one step alone); the ratios need both 'on' and 'off'")
    # worker arguments (one torchrun job)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-per-rank", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--num-generations", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--median", type=float, default=200, help=argparse.SUPPRESS)
    ap.add_argument("--p95", type=float, default=900, help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=int, default=1024, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.quick and not args.model:
        ap.error("--model DIR (SmolLM2-135M-Instruct) or --quick")
    from grpo_dist.config import GRPOConfig
    has_compaction = "decode_compaction_threshold" in GRPOConfig.__dataclass_fields__
    scale = dict(median=20, p95=90, cap=128) if args.quick else dict(median=200, p95=900, cap=1024)
    if args.scale_cap:
        scale = dict(median=200 * args.scale_cap / 1024, p95=900 * args.scale_cap / 1024, cap=args.scale_cap)
    budget = args.budget or (1024 if args.quick else 2048)
    # the distribution's own figures, before any run
    ls = lengths(args.prompts * 8, scale["median"], scale["p95"], scale["cap"])
    print(f"lengths: {len(ls)} rows, median {sorted(ls)[len(ls) // 2]}, p95 {sorted(ls)[int(0.95 * len(ls))]}, "
          f"max {max(ls)}, mean {sum(ls) / len(ls):.1f}; decode lever: "
          f"{'decode_compaction_threshold' if has_compaction else 'none in this config (skipped)'}", flush=True)
    results: dict = {}
    models = [None] if args.quick else [args.model] if args.no_tiny else [None, args.model]
    for model in models:
        configs = _configs(has_compaction, budget, args.threshold)
        every = args.all_configs if args.all_configs is not None else model is None
        if not every:
            configs = {k: configs[k] for k in ("off", "on")}
        if args.only:
            wanted = args.only.split(",")
            if unknown := sorted(set(wanted) - set(_configs(has_compaction, budget, args.threshold))):
                ap.error(f"--only: no configuration named {', '.join(unknown)}")
            configs = {k: v for k, v in _configs(has_compaction, budget, args.threshold).items() if k in wanted}
        runs = {name: run_config(args, model, name, o, scale) for name, o in configs.items()}
        results["real" if model else "tiny"] = {"summary": summary(runs), "runs": runs}
    main_runs = results["tiny" if args.quick else "real"]
    print(json.dumps({**main_runs["summary"], "model": "tiny" if args.quick else args.model, "ranks": args.ranks,
                      "lengths": scale, "prompts": args.prompts, "budget": budget,
                      "threshold": args.threshold, "load_average": round(os.getloadavg()[0], 2),
                      "results": results}), flush=True)


if __name__ == "__main__":
    main()
