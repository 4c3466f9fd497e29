"""Profile of the packed log-prob and training passes (issue 37): attention calls per layer, host syncs per
micro-batch, peak memory, seconds per pass, on a random Qwen2 of a given shape (CPU or CUDA).

    python bench/pass_profile.py --layers 2 --hidden 64 --vocab 151936           # the issue's CPU bar
    python bench/pass_profile.py --layers 2 --hidden 64 --vocab 151936 --before /path/to/old/checkout

Work: 64 rows (8 prompts x 8 completions, share_prompts on, padding_free), prompts of 40-100 tokens, completion
lengths from long_cot.py's long-tailed distribution (lognormal median 200, p95 900, cap 1024), packed into
micro-batches of at most --budget tokens (8192) by micro_batches.plan_token_budget. The log-prob pass is the no-grad
pass over every micro-batch; the training micro-batch is the largest micro-batch's forward, grpo_loss and backward.

- attention_calls_per_layer: aten::scaled_dot_product_attention calls in one forward of the largest micro-batch,
  over the layers (the packed forward's calls, as torch.profiler counts them).
- host_syncs_per_micro_batch: in one training micro-batch (forward, loss, backward; the layout already built, as
  the trainer builds it once per step), the operators that wait for the device on a GPU: aten::_local_scalar_dense
  (item, float, bool, int of a tensor), aten::nonzero (boolean indexing, nonzero), plus Tensor.tolist calls.
- peak_mib: the rise of peak memory over the memory before the pass (CPU: VmHWM after resetting it, through
  /proc/self/clear_refs, each measurement in a fresh process; CUDA: max_memory_allocated).
- seconds per pass: the median of --repeats.

--before DIR runs the same measurements on another checkout of grpo_dist (e.g. the merge base, as a git worktree)
and adds its figures as before_* with the ratios. The last output line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cap", type=int, default=1024, help="longest completion")
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--before", help="another grpo_dist checkout to measure the same way")
    ap.add_argument("--root", help="measure this grpo_dist checkout instead of the one holding this script (its "
                                   "figures alone; run two at once to pair them)")
    ap.add_argument("--phase", choices=["counts", "logprob", "train"], help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _model(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    heads = max(1, args.hidden // 16)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(args.device).train()


def _batch(args):
    """The rows: prompt g of 40-100 tokens for rows 8g..8g+7, completions of long-tailed lengths, right-padded."""
    import torch
    from long_cot import lengths

    from grpo_dist.rollout import RolloutBatch
    g = torch.Generator().manual_seed(0)
    comp = lengths(args.rows, 200 * args.cap / 1024, 900 * args.cap / 1024, args.cap, seed=0)
    G, P, C = 8, 100, max(comp)
    pi, pm = torch.zeros(args.rows, P, dtype=torch.long), torch.zeros(args.rows, P, dtype=torch.long)
    ci, cm = torch.zeros(args.rows, C, dtype=torch.long), torch.zeros(args.rows, C, dtype=torch.long)
    for k in range(0, args.rows, G):
        p = int(torch.randint(40, P + 1, (1,), generator=g))
        prompt = torch.randint(10, args.vocab, (p,), generator=g)
        for i in range(k, min(k + G, args.rows)):
            pi[i, P - p:], pm[i, P - p:] = prompt, 1
            ci[i, :comp[i]], cm[i, :comp[i]] = torch.randint(10, args.vocab, (comp[i],), generator=g), 1
    return RolloutBatch(pi, pm, ci, cm, G)


def _micro(batch, args) -> list[list[int]]:
    from grpo_dist import micro_batches as mbatch
    from grpo_dist.prompt_sharing import prompt_groups
    rows = list(range(len(batch)))
    groups = prompt_groups(batch.prompt_ids, batch.prompt_mask, rows)
    return mbatch.plan_token_budget(mbatch.row_lengths(batch, rows), args.budget, 10 ** 6, True, 1, groups)


class _Pass:
    """One micro-batch's pass through whichever API this checkout has: completion_log_probs with a layout built
    beforehand (the new code), or completion_forward + selective_log_probs, packing inside (the code before)."""

    def __init__(self, model, mb):
        from grpo_dist import packing
        self.model, self.mb, self.p = model, mb, packing
        self.new = hasattr(packing, "completion_log_probs")
        self.packed = packing.pack_rows(mb, True) if self.new else None
        self.tokens = float(mb.completion_mask.sum())  # the loss's normaliser, taken before any pass

    def __call__(self, entropy=None):
        if self.new:
            return self.p.completion_log_probs(self.model, self.mb, self.packed, None, 1.0, None, entropy)
        from grpo_dist.logprobs import selective_log_probs
        logits, labels, to_rows = self.p.completion_forward(self.model, self.mb, True, None, True)
        ent = None
        import torch
        if entropy:
            ent = torch.empty(labels.shape, device=logits.device)
        logp = selective_log_probs(logits, labels, None, 1.0, overwrite_logits=torch.is_grad_enabled(),
                                   entropy_out=ent)
        return to_rows(logp), (to_rows(ent) if ent is not None else None)


def _train(step: _Pass):
    import torch

    from grpo_dist.losses import LossSpec, grpo_loss
    mb = step.mb
    logp, ent = step("metric")
    adv = torch.linspace(-1, 1, len(mb), device=logp.device)
    terms = grpo_loss(logp, logp.detach(), adv, mb.completion_mask, normaliser=step.tokens,
                      spec=LossSpec(), entropy=None)
    terms.loss.backward()
    return terms, ent


def _largest(batch, micro):
    return max(micro, key=lambda idx: int(batch.prompt_mask[idx].sum() + batch.completion_mask[idx].sum()))


def phase_counts(args) -> dict:
    """Attention calls per layer and host syncs per training micro-batch, and seconds per pass."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    model, batch = _model(args), _batch(args).to(args.device)
    micro = _micro(batch, args)
    mbs = [batch.rows(idx) for idx in micro]
    big = _Pass(model, batch.rows(_largest(batch, micro)))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        big()
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    tolist = [0]
    real_tolist = torch.Tensor.tolist

    def counting(self, *a, **k):
        tolist[0] += 1
        return real_tolist(self, *a, **k)
    torch.Tensor.tolist = counting
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _train(big)
    finally:
        torch.Tensor.tolist = real_tolist
    syncs = sum(e.count for e in prof.key_averages() if e.key in ("aten::_local_scalar_dense", "aten::nonzero"))
    model.zero_grad(set_to_none=True)
    passes = [_Pass(model, mb) for mb in mbs]  # layouts built once, as the trainer does per step
    logprob_s, train_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        with torch.no_grad():
            for p in passes:
                p()
        _sync(args)
        logprob_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for p in passes:
            _train(p)
        _sync(args)
        train_s.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return {"attention_calls_per_layer": calls / args.layers, "host_syncs_per_micro_batch": syncs + tolist[0],
            "micro_batches": len(micro), "tokens_largest_micro_batch": int(big.mb.prompt_mask.sum()
                                                                            + big.mb.completion_mask.sum()),
            "logprob_pass_s": statistics.median(logprob_s), "train_pass_s": statistics.median(train_s)}


def _sync(args):
    import torch
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def phase_memory(args, train: bool) -> dict:
    """Peak memory rise of the log-prob pass (every micro-batch, no grad) or of the largest training micro-batch."""
    import torch

    from bench_common import status_mib
    model, batch = _model(args), _batch(args).to(args.device)
    micro = _micro(batch, args)
    passes = [_Pass(model, batch.rows(idx)) for idx in ([_largest(batch, micro)] if train else micro)]
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM back to VmRSS
            f.write("5")
        base = status_mib("VmRSS")
    if train:
        _train(passes[0])
    else:
        with torch.no_grad():
            for p in passes:
                p()
    if cuda:
        torch.cuda.synchronize()
        return {"peak_mib": (torch.cuda.max_memory_allocated() - base) / 2 ** 20}
    return {"peak_mib": status_mib("VmHWM") - base}


def run_phases(args, root: Path) -> dict:
    """Every phase in a fresh process of `root`'s grpo_dist (memory peaks do not mix)."""
    out = {}
    for phase in ("counts", "logprob", "train"):
        cmd = [sys.executable, str(HERE / "pass_profile.py"), "--phase", phase, "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--rows", str(args.rows),
               "--cap", str(args.cap), "--budget", str(args.budget), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--device", args.device]
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{HERE}"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"pass_profile: phase {phase} on {root} failed:\n{res.stderr[-3000:]}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        if phase == "counts":
            out.update(got)
        else:
            out[f"peak_mib_{'train_micro_batch' if phase == 'train' else 'logprob_pass'}"] = got["peak_mib"]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.phase:
        got = phase_counts(args) if args.phase == "counts" else phase_memory(args, args.phase == "train")
        print(json.dumps(got))
        return
    out = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "rows": args.rows,
           "budget": args.budget, "device": args.device,
           **run_phases(args, Path(args.root).resolve() if args.root else HERE.parent)}
    if args.before:
        before = run_phases(args, Path(args.before).resolve())
        out.update({f"before_{k}": v for k, v in before.items()})
        for k in ("peak_mib_train_micro_batch", "peak_mib_logprob_pass", "logprob_pass_s", "train_pass_s"):
            out[f"ratio_{k}"] = out[k] / before[k] if before[k] else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
