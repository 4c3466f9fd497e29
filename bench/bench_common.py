"""Shared bits of the benchmarks: the tiny reference model, a cheap reward, prompts, memory readings."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys

# The reference setting: tiny Qwen2, hidden 128, 4 layers, byte-level BPE vocab 1024.
TINY = ("{architecture: qwen2, hidden_size: %d, num_hidden_layers: %d, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: %d, tokenizer: bpe, vocab_size: %d}")


def tiny_override(hidden=128, layers=4, vocab=1024) -> str:
    return "model.tiny=" + TINY % (hidden, layers, 2 * hidden, vocab)


def digit_reward(completion: str, reference: str) -> float:
    """Fraction of digits in the completion: cheap, deterministic and non-constant, so groups have non-zero
    advantages and the whole update runs (a random model never earns math_reward)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def digit_reward_trl(completions, **kwargs) -> list[float]:
    """The same reward in TRL's calling convention."""
    return [digit_reward(c if isinstance(c, str) else c[-1]["content"], "") for c in completions]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MiB (VmRSS: now; VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------- the torchrun workers of the memory benches
RESULT = "RESULT "  # the worker's line that carries every rank's figures


def print_rank_results(out: dict, ctx) -> None:
    """Collective: every rank's `out`, printed by rank 0 as one RESULT line (a JSON list in rank order)."""
    import torch.distributed as dist
    res: list = [out]
    if ctx.world_size > 1:
        res = [None] * ctx.world_size
        dist.all_gather_object(res, out)
    if ctx.is_main:
        print(RESULT + json.dumps(res), flush=True)


def run_worker(script: str, world: int, args: list[str], port: int, env: dict | None = None) -> list[dict]:
    """`script --worker ARGS` on `world` ranks under torchrun; the per-rank figures of its RESULT line. A failed
    worker's output tail goes to stderr and the bench stops."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(port), script, "--worker"] + args
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-5000:])
        raise SystemExit("worker failed")
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)][-1][len(RESULT):])
