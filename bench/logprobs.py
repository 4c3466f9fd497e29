"""Per-token log-probs at a real vocabulary (151,936, Qwen2): time and peak memory, ours vs naive fp32 log_softmax.

    python bench/logprobs.py                      # rows = 16 completions x 64 tokens, fp32 logits
    python bench/logprobs.py --rows 2048 --dtype bfloat16

Each variant runs in a fresh subprocess; its peak is the rise of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) above the RSS with the inputs already built, so it counts exactly the memory the log-prob
computation adds; the highest of --reps calls after one unmeasured warm-up call (the first call in a process also
pays one-time initialisation, 85-110 MiB of the chunked variants here, which a training step does not).
Two passes are measured, as the trainer runs them:
  score   no-grad forward (reference / old log-probs)
  train   forward + backward (the policy update); the gradient w.r.t. the logits is part of the cost
Variants:
  naive          log_softmax(logits.float()).gather(label)                     (what most trainers do)
  chunked        grpo_dist selective_log_probs, gradient in a new tensor
  chunked+overwrite  the same, gradient written into the logits' storage (what the trainer uses)
Values and gradients are checked against naive (atol 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
        f.write("5")


def inputs(rows, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    grad_out = torch.randn(rows, generator=g)
    return logits, labels, grad_out


def run_variant(variant, mode, rows, vocab, dtype, chunk_size, reps):
    """In this (fresh) process: returns peak MiB above the inputs, median seconds, values and grad for checking."""
    from grpo_dist.logprobs import selective_log_probs
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    logits0, labels, grad_out = inputs(rows, vocab, dtype)
    times, peak = [], 0.0
    result = None
    for r in range(-1, reps):  # r = -1: warm-up, not measured (first-call initialisation is not per-step memory)
        logits = logits0.clone().requires_grad_(mode == "train")
        base = rss_kib("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(mode == "train"):
            if variant == "naive":
                lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
            else:
                lp = selective_log_probs(logits, labels, chunk_size, overwrite_logits=variant == "chunked+overwrite")
            if mode == "train":
                (lp * grad_out).sum().backward()
        dt = time.perf_counter() - t0
        if r >= 0:
            peak = max(peak, (rss_kib("VmHWM") - base) / 1024)
            times.append(dt)
        if r == 0:
            result = (lp.detach().clone(), logits.grad.float().clone() if mode == "train" else None)
        del logits, lp
    return peak, statistics.median(times), result


def child(args):
    peak, t, (lp, grad) = run_variant(args.variant, args.mode, args.rows, args.vocab, getattr(torch, args.dtype),
                                      args.chunk_size, args.reps)
    torch.save({"peak_mib": peak, "time_s": t, "lp": lp, "grad": grad}, args.out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024, help="completion tokens in the micro-batch (B x C)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk-size", type=int, default=1024, help="logprob_chunk_size (rows; capped at 4M logits)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant"), ap.add_argument("--mode"), ap.add_argument("--out")  # child process
    args = ap.parse_args()
    if args.variant:
        return child(args)
    import tempfile
    env = dict(os.environ, BENCH_THREADS=str(args.threads), PYTHONPATH=os.path.dirname(HERE))
    logits_mib = args.rows * args.vocab * torch.empty((), dtype=getattr(torch, args.dtype)).element_size() / 2**20
    print(f"rows={args.rows} vocab={args.vocab} dtype={args.dtype}: the logits themselves are {logits_mib:.0f} MiB; "
          f"threads={args.threads}, load average {os.getloadavg()[0]:.2f}")
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("score", "train"):
            ref = None
            for variant in ("naive", "chunked", "chunked+overwrite"):
                if mode == "score" and variant == "chunked+overwrite":
                    continue  # no backward, same as chunked
                out = os.path.join(tmp, f"{mode}_{variant}.pt")
                subprocess.run([sys.executable, __file__, "--variant", variant, "--mode", mode, "--out", out,
                                "--rows", str(args.rows), "--vocab", str(args.vocab), "--dtype", args.dtype,
                                "--chunk-size", str(args.chunk_size), "--reps", str(args.reps)],
                               check=True, env=env)
                r = torch.load(out)
                if ref is None:
                    ref = r
                lp_diff = float((r["lp"] - ref["lp"]).abs().max())
                g_diff = float((r["grad"] - ref["grad"]).abs().max()) if r["grad"] is not None else 0.0
                ratio = r["peak_mib"] / max(ref["peak_mib"], 1e-9)
                rows.append((mode, variant, r["peak_mib"], ratio, r["time_s"], lp_diff, g_diff))
                summary[f"{mode}_{variant}"] = dict(peak_mib=round(r["peak_mib"], 1), peak_vs_naive=round(ratio, 4),
                                                    time_s=round(r["time_s"], 4), max_abs_diff_logp=lp_diff,
                                                    max_abs_diff_grad=g_diff)
    print(f"{'pass':6} {'variant':18} {'peak MiB':>9} {'vs naive':>9} {'time s':>8} {'|dlogp|':>9} {'|dgrad|':>9}")
    for mode, variant, peak, ratio, t, d1, d2 in rows:
        print(f"{mode:6} {variant:18} {peak:9.1f} {ratio:9.3f} {t:8.3f} {d1:9.1e} {d2:9.1e}")
    ok = all(v["max_abs_diff_logp"] <= 1e-5 and v["max_abs_diff_grad"] <= 1e-5 for v in summary.values())
    summary.update(rows=args.rows, vocab=args.vocab, dtype=args.dtype, values_match_atol_1e_5=ok)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
