"""How big a colocated vLLM engine is made (rollout_engine=vllm): its KV cache, its share of the GPU and its batch
limits, from the model's shape and the rows one engine generates at once, instead of a flat share of the card
(0.3 of an 80 GB card is 24 GB, for a 0.5B model whose rollouts need well under 1 GB of KV cache: the rest is
taken from training). Pure functions: rollout_engines.VLLMRolloutEngine reads the model's config.json and the
card's size and passes the numbers in. A value the user set (vllm.gpu_memory_utilization, vllm.kv_cache_gb,
vllm.max_num_seqs, vllm.max_num_batched_tokens) is used as given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
BLOCK_TOKENS = 16              # vLLM's default KV block: a sequence holds whole blocks
DEFAULT_BATCHED_TOKENS = 4096  # TRL's colocate value: vLLM v1's memory profiler is misled by its larger default
RESERVE_BYTES = 2 * GiB        # CUDA context, CUDA graphs, cuBLAS / NCCL workspaces, allocator slack
MAX_UTILIZATION = 0.95         # vLLM refuses a share above the free memory; never plan the whole card


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only model (config.json)."""
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True)
class VLLMPlan:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int | None            # None: vLLM fills the share the user gave (gpu_memory_utilization only)
    gpu_memory_utilization: float | None  # None without a GPU (the CPU backend takes the KV cache size only)
    needed_utilization: float | None = None  # the share the plan wanted, where it was more than MAX_UTILIZATION


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tp: int) -> int:
    """K and V of every layer for one token on one rank: 2 x layers x (KV heads / tp) x head_dim x bytes (the KV
    heads are split over the ranks of a tensor-parallel group, or replicated where there are fewer than ranks)."""
    return 2 * shape.num_layers * max(1, shape.num_kv_heads // tp) * shape.head_dim * dtype_bytes


def plan(shape: ModelShape, dtype_bytes: int, rows: int, max_model_len: int, tp: int, gpu_total_bytes: int | None,
         *, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
         kv_cache_gb: float | None = None, gpu_memory_utilization: float | None = None) -> VLLMPlan:
    """The engine's sizes. rows: the completions one engine generates at once (prompts x num_generations of
    every rank of its TP group); gpu_total_bytes: the card's memory (None on CPU).

        max_num_seqs           = rows  (every completion of a step in flight at once; at most the token budget)
        max_num_batched_tokens = max(4096, max_num_seqs)  (vLLM needs one token per sequence at least)
        kv_cache_bytes         = max_num_seqs x ceil(max_model_len / 16) x 16 x kv_bytes_per_token
        gpu_memory_utilization = (weights / tp + kv_cache_bytes + activations + 2 GiB) / gpu_total_bytes
                                 (at most 0.95), with
        activations            = max_num_batched_tokens x 2 x intermediate_size / tp x dtype_bytes  (gate and up)
                                 + max_num_seqs x vocab_size x 4 x 2  (fp32 logits and their log-softmax)
    """
    if max_num_seqs is not None:
        seqs = max_num_seqs
    else:
        seqs = max(1, rows) if max_num_batched_tokens is None else max(1, min(rows, max_num_batched_tokens))
    batched = max_num_batched_tokens if max_num_batched_tokens is not None else max(DEFAULT_BATCHED_TOKENS, seqs)
    kv: int | None
    if kv_cache_gb is not None:
        kv = int(kv_cache_gb * GiB)
    elif gpu_memory_utilization is not None and gpu_total_bytes is not None:
        kv = None
    else:
        kv = seqs * math.ceil(max_model_len / BLOCK_TOKENS) * BLOCK_TOKENS * kv_bytes_per_token(shape, dtype_bytes, tp)
    if gpu_total_bytes is None:
        return VLLMPlan(seqs, batched, kv, None)
    if gpu_memory_utilization is not None:
        return VLLMPlan(seqs, batched, kv, gpu_memory_utilization)
    assert kv is not None
    weights = shape.num_params * dtype_bytes / tp
    activations = batched * 2 * shape.intermediate_size / tp * dtype_bytes + seqs * shape.vocab_size * 4 * 2
    needed = (weights + kv + activations + RESERVE_BYTES) / gpu_total_bytes
    return VLLMPlan(seqs, batched, kv, min(MAX_UTILIZATION, needed),
                    needed if needed > MAX_UTILIZATION else None)


def cpu_kv_cache_gib(p: VLLMPlan) -> int:
    """VLLM_CPU_KVCACHE_SPACE: whole GiB (vLLM reads an integer), rounded up, 1 at least."""
    return max(1, math.ceil((p.kv_cache_bytes or GiB) / GiB))


def model_shape(conf: dict, num_params: int | None = None) -> ModelShape:
    """ModelShape of a config.json (its text_config in multimodal ones). num_params: the exact count where the
    caller has the model; else estimated from the dimensions of a Llama-style decoder (embedding, attention,
    gated MLP, and an untied head unless tie_word_embeddings)."""
    sub = conf.get("text_config")
    c = sub if isinstance(sub, dict) and "num_hidden_layers" not in conf else conf
    hidden, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter, vocab = int(c.get("intermediate_size") or 4 * hidden), int(c["vocab_size"])
    if num_params is None:
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        heads_out = 1 if conf.get("tie_word_embeddings", c.get("tie_word_embeddings", False)) else 2
        num_params = vocab * hidden * heads_out + layers * (attention + 3 * hidden * inter)
    return ModelShape(num_params, layers, kv_heads, head_dim, inter, vocab)


def read_model_shape(model_dir: str, num_params: int | None = None) -> ModelShape | None:
    """model_shape of model_dir/config.json, or None where it cannot be read (a Hub id not in the cache)."""
    from grpo_dist.preflight import model_config_file
    path = model_config_file(model_dir)
    if path is None:
        return None
    try:
        return model_shape(json.loads(Path(path).read_text(encoding="utf-8")), num_params)
    except (OSError, ValueError, KeyError, TypeError):
        return None
