"""GPU memory per rank that each shipped GPU config needs: an estimate from arithmetic, checked against the one peak
measured on a GPU (the long-completion step of bench/gpu_check.sh on one H200, 2026-12-04: 23.7 GiB).

    python bench/gpu_memory_estimate.py          # a table, then one JSON line

Per rank, in GiB (2^30 bytes); P parameters, S ranks sharing the FSDP shards (FULL_SHARD: all ranks; HYBRID_SHARD:
the ranks of one node), T tokens of a training micro-batch (micro_batch_size x (max_prompt_length +
max_completion_length), or max_tokens_per_micro_batch), V vocabulary, L layers, h hidden size:
  states      16 P / S    fp32 weights, gradients and AdamW's two moments, sharded
  reference    4 P / S    with beta > 0 (fp32, sharded like the policy)
  replica      2 P        the rollout engine's full bf16 copy on every rank
  KV cache     rows x (prompt + completion) x L x 2 x kv_heads x head_dim x 2 bytes (generation_batch_size rows)
  logits       T x V x 6  bytes: bf16 logits and an fp32 chunk of the log-softmax with its gradient
  activations  T x L x h x 34 bytes without activation checkpointing, x 2 with it (one saved input per layer)
plus 20 % for the allocator's fragmentation and the gathered FSDP unit. Random weights or real ones need the same.
The measured case (0.5B shape, 1 rank, T = 8192, beta 0.04) comes out at the `check` row; the configs' figures are
estimates, not measurements: no shipped config has run on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
# name_or_path: (parameters, layers, hidden, kv_heads, head_dim, vocab), from the models' published config.json
SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (494e6, 24, 896, 2, 64, 151936),
    "Qwen/Qwen2.5-Math-1.5B": (1.54e9, 28, 1536, 2, 128, 151936),
    "Qwen/Qwen3-0.6B-Base": (0.6e9, 28, 1024, 8, 128, 151936),
    "Qwen/Qwen2.5-7B-Instruct": (7.62e9, 28, 3584, 4, 128, 152064),
}
GPUS_PER_NODE = 8  # every shipped GPU config is written for 8 GPUs per node
MEASURED = {"what": "bench/gpu_check.sh stage long, 0.5B shape, 1 rank, budget 8192 tokens, beta 0.04",
            "peak_gib": 23.7}


def estimate(P, L, h, kv, hd, V, shards, tokens, gen_rows, seq, beta, act_ckpt) -> dict:
    parts = {
        "states": 16 * P / shards,
        "reference": 4 * P / shards if beta > 0 else 0.0,
        "replica": 2 * P,
        "kv_cache": gen_rows * seq * L * 2 * kv * hd * 2,
        "logits": tokens * V * 6,
        "activations": tokens * L * h * (2 if act_ckpt else 34),
    }
    gib = {k: round(v / GIB, 2) for k, v in parts.items()}
    gib["total"] = round(1.2 * sum(parts.values()) / GIB, 1)
    return gib


def for_config(path: Path) -> dict:
    c = yaml.safe_load(path.read_text())
    name = c["model"]["name_or_path"]
    P, L, h, kv, hd, V = SHAPES[name]
    d = c.get("distributed", {})
    seq = c["data"].get("max_prompt_length", 512) + c["max_completion_length"]
    tokens = c.get("max_tokens_per_micro_batch") or c.get("micro_batch_size", 8) * seq
    gen_rows = c.get("generation_batch_size") or c.get("prompts_per_rank", 4) * c.get("num_generations", 8)
    shards = GPUS_PER_NODE  # FULL_SHARD on one node, or HYBRID_SHARD: shards within a node of 8 either way
    est = estimate(P, L, h, kv, hd, V, shards, tokens, gen_rows, seq, c.get("beta", 0.04),
                   d.get("activation_checkpointing", False))
    return {"config": path.name, "model": name, "sharding": d.get("sharding_strategy", "FULL_SHARD"),
            "tokens_per_micro_batch": tokens, **est}


def main() -> int:
    check = estimate(*SHAPES["Qwen/Qwen2.5-0.5B-Instruct"], shards=1, tokens=8192, gen_rows=64, seq=1024 + 64,
                     beta=0.04, act_ckpt=False)
    rows = [for_config(p) for p in sorted((ROOT / "configs").glob("qwen*.yaml"))]
    print(f"check: {MEASURED['what']}: estimate {check['total']} GiB, measured {MEASURED['peak_gib']} GiB")
    for r in rows:
        print(f"{r['config']:32} {r['model']:28} {r['sharding']:13} T={r['tokens_per_micro_batch']:6d}  "
              f"~{r['total']:5.1f} GiB per rank (states {r['states']}, replica {r['replica']}, logits {r['logits']}, "
              f"activations {r['activations']}, KV {r['kv_cache']})")
    print(json.dumps({"check": {"estimate": check, "measured": MEASURED}, "configs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
