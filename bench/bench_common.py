"""Shared bits of the benchmarks: the tiny reference model, a cheap reward, prompts, memory readings."""

from __future__ import annotations

import os
import resource
import statistics

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
