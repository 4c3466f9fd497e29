"""Model building: everything a trainer rank trains and samples with, made from (config, context) in one place
(and the data checks that come before it: load_split, check_prompt_lengths).

build_models loads the policy, makes the generation replica, applies LoRA, wraps the policy in its engine (the
optimizer and LR schedule with it) and builds the reference model; build_rollouts then makes the rollout engine,
after a resume has restored the RNG streams (vLLM reseeds the process RNGs when it is built). The order of the
collectives and RNG draws is the trainer's of before (bitwise tests and resume rely on it): policy load (rank 0 reads,
the others build on the meta device), replica (buffers broadcast), LoRA (its init draws from lora's own generator),
engine (sharding from rank 0), reference model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import flops
from grpo_dist import lora
from grpo_dist.async_rollout import RolloutsElsewhere
from grpo_dist.config import ConfigError, GRPOConfig
from grpo_dist.config.choices import FSDP_BACKENDS
from grpo_dist.data import DataError, load_examples, prompt_length_check, truncate_long_prompts
from grpo_dist.decoder import prepare_replica
from grpo_dist.engines import Engine, build_engine, shards_from_host
from grpo_dist.models import (MIXED_PRECISION_DTYPES, cast_parameters_, copy_in_dtype, load_model, load_on_rank0_only,
                              materialize_meta)
from grpo_dist.packing import fallback_line, share_prompts_reason
from grpo_dist.rollout_engines import build_rollout_engine, tied_aliases


@dataclass
class Models:
    """The built parts of a trainer rank."""
    tokenizer: Any
    hf_model: torch.nn.Module  # the policy as loaded: its config and generation_config go into checkpoints
    engine: Engine  # the policy (with its LoRA adapters), its optimizer and LR schedule
    ref_model: torch.nn.Module | lora.Reference | None  # None with beta = 0
    gen_model: torch.nn.Module | None  # the generation replica (lean / hf rollouts on this rank), else None
    tied_weights: dict  # {name: [its other names]} of tied parameters, read before any wrapper renames them
    padding_free: bool  # the passes run packed rows (packing.py)
    share_prompts: bool  # rows of one prompt read one copy of it
    num_params: int  # of the policy as loaded (before LoRA)
    flops_shape: tuple  # mfu (flops.py): matmul parameters and attention dims, before LoRA or a wrapper
    peak_flops: float | None
    save_format: str  # resolved: full or sharded
    rollout_engine: Any = None  # build_rollouts, once a resume restored the RNG


def build_models(cfg: GRPOConfig, ctx: gdist.DistContext, tokenizer) -> Models:
    """Collective. Pretrained weights on several ranks: rank 0 reads them, the others build on the meta device and
    get their shards from rank 0 while the engine wraps (one model copy in host RAM per node while loading)."""
    meta = load_on_rank0_only(cfg, ctx.world_size) and not ctx.is_main
    # FSDP shards from the host (engines.shards_from_host): no full fp32 model on a GPU before sharding
    host = shards_from_host(cfg, ctx.world_size)
    policy = _load_model(cfg, ctx, tokenizer, "model", meta, to_device=not host)
    compute_dtype = MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision)
    # vLLM holds its own copy of the weights; lean / hf sample from a replica built here; with rollout_ranks > 0
    # the rollout ranks sample (async_rollout.py) and a trainer rank builds neither
    gen_model = _build_replica(cfg, ctx, policy, meta, compute_dtype) \
        if not cfg.rollout_ranks and cfg.rollout_engine != "vllm" else None
    tied_weights = tied_aliases(policy)  # plain names, read before any wrapper renames them
    padding_free = cfg.padding_free and _can_pack(policy, ctx)
    share_prompts = padding_free and cfg.share_prompts and _can_share_prompts(policy, ctx)
    num_params = sum(p.numel() for p in policy.parameters())
    flops_shape = (flops.matmul_params(policy), *flops.attention_dims(policy.config))
    if cfg.lora.r:  # after the replica copy: the replica stays a plain model and gets merged weights
        lora.apply_lora(policy, cfg.lora, cfg.model.init_seed)
        _untie_replica(cfg, gen_model, lora.adapted_tied_weights(policy))
    engine = build_engine(cfg, policy, ctx)
    if cfg.lora.r and cfg.lora.dropout:
        lora.activate_dropout(engine.module)
    if cfg.save_format == "sharded" and not engine.supports_sharded():
        raise ConfigError(f"config key 'save_format' = sharded is not supported by distributed.backend="
                          f"{cfg.distributed.backend}; use full or auto")
    # LoRA checkpoints hold the adapter (+ optimizer) only: always the full (gathered) format
    save_format = "full" if cfg.lora.r else ckpt.resolve_save_format(cfg.save_format, num_params, engine)
    ref_model: torch.nn.Module | lora.Reference | None = None
    if cfg.beta != 0.0 and cfg.lora.r:  # LoRA: the reference is the policy without its adapters
        ref_model = lora.Reference(engine.module)
    elif cfg.beta != 0.0:  # with beta = 0 the reference model is neither built nor run
        ref = _load_model(cfg, ctx, tokenizer, "reference model", meta, to_device=False)
        if cfg.distributed.backend in FSDP_BACKENDS:  # kept in the compute dtype: cast before the GPU
            cast_parameters_(ref, compute_dtype)
        ref_model = engine.wrap_reference(ref if meta or host else ref.to(ctx.device))
    return Models(tokenizer, policy, engine, ref_model, gen_model, tied_weights, padding_free, share_prompts,
                  num_params, flops_shape, flops.peak_flops(cfg.peak_flops, ctx.device), save_format)


def build_rollouts(cfg: GRPOConfig, ctx: gdist.DistContext, models: Models, resumed: bool):
    """The rollout engine (models.rollout_engine): vLLM, or lean / hf sampling from the replica; with rollout_ranks
    > 0 a stand-in (the rollout ranks sample). vLLM's engine reseeds the process RNGs when it is built: a resumed
    run goes on with the checkpoint's streams (bitwise what the uninterrupted run drew), not with the seed's again.
    Every generate follows a weight sync: vLLM starts from dummy weights (no checkpoint read per rank)."""
    rng = ckpt.rng_state() if resumed else None
    models.rollout_engine = build_rollout_engine(cfg, ctx, models.gen_model, models.tokenizer, models.tied_weights,
                                                 num_params=models.num_params, synced=True) \
        if not cfg.rollout_ranks else RolloutsElsewhere()
    if rng is not None:
        ckpt.set_rng_state(rng)
    return models.rollout_engine


def load_split(cfg: GRPOConfig, split: str, is_main: bool) -> list:
    """The train or eval examples, prompts longer than data.max_prompt_length cut (one warning on rank 0)."""
    examples = load_examples(cfg.data, split)
    where = (cfg.data.path if split == "train" else cfg.data.eval_path) or f"data.preset={cfg.data.preset} ({split})"
    return truncate_long_prompts(examples, cfg.data.max_prompt_length, where, warn=is_main)


def check_prompt_lengths(cfg: GRPOConfig, ctx: gdist.DistContext, examples, tokenizer) -> None:
    """Collective. Rank 0 counts the training prompts that rollouts would cut (data.prompt_length_check), every rank
    gets its verdict: above data.max_truncated_prompt_fraction the run stops (DataError, exit 2), else one warning."""
    warning, error = None, None
    if ctx.is_main:
        warning, error = prompt_length_check(examples, cfg.data, tokenizer)
        if warning:
            print(f"[grpo_dist] {warning}", flush=True)
    error = gdist.broadcast_object(error)
    if error:
        raise DataError(error)


def _build_replica(cfg, ctx, policy, meta: bool, compute_dtype):
    """The generation replica: a plain copy of the policy, refreshed from the shards every step (its storage is
    untouched until the first refresh on meta-built ranks). With mixed precision its parameters hold the compute
    dtype: rollouts then sample from the weights the training passes compute with, at half the memory. Buffers stay
    as they are, like FSDP's MixedPrecision keeps them: RoPE's inv_freq rounded to bf16 would shift positions
    against the training forward more and more along the sequence."""
    replica = copy_in_dtype(policy, compute_dtype).eval()  # cast while copying: no full fp32 copy
    if meta:
        materialize_meta(replica, ctx.device)
    else:  # a policy left on the host for FSDP: the replica goes to the device in the compute dtype
        replica.to(ctx.device)
    if load_on_rank0_only(cfg, ctx.world_size):  # a collective: meta-built ranks take rank 0's buffers
        gdist.broadcast_tensors(list(replica.buffers()))
    replica.requires_grad_(False)
    prepare_replica(replica)  # one q|k|v and gate|up matmul per layer when decoding (decoder.py)
    return replica


def _can_pack(policy, ctx) -> bool:
    """Whether the passes can run packed rows (padding_free); one line on rank 0 when they fall back."""
    line = fallback_line(policy)
    if line and ctx.is_main:
        print(line, flush=True)
    return line is None


def _can_share_prompts(policy, ctx) -> bool:
    """Whether rows with the same prompt can read one copy of it (share_prompts); one line on rank 0 if not."""
    why = share_prompts_reason(policy)
    if why and ctx.is_main:
        print(f"[grpo_dist] share_prompts: {why}; every row computes its own prompt", flush=True)
    return why is None


def _load_model(cfg, ctx, tokenizer, what: str, meta: bool, to_device: bool = True) -> torch.nn.Module:
    """load_model, on this rank's device unless meta or not to_device; rank 0 says what it loads and how long it
    took (a big model takes minutes)."""
    m = cfg.model
    name = m.name_or_path or f"tiny {(m.tiny or {}).get('architecture', 'qwen2')} (random weights)"
    if ctx.is_main:
        print(f"[grpo_dist] loading {what} {name} ...", flush=True)
    t0 = time.perf_counter()
    model = load_model(m, tokenizer, on_meta=meta)
    model = model.to(ctx.device) if to_device and not meta else model
    if ctx.is_main:
        print(f"[grpo_dist] loading {what} {name} ... done in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


def _untie_replica(cfg, gen_model, names: list[str]) -> None:
    """An adapted tied head: the merge gives it weights of its own (lora.adapted_tied_weights)."""
    if names and cfg.rollout_engine == "vllm":
        raise ConfigError(f"config key 'lora.target_modules' adapts {names[0]}, which this model ties to its "
                          f"embeddings: not supported with rollout_engine=vllm (its model keeps them tied); "
                          f"use rollout_engine=lean or hf, or leave lm_head out")
    if gen_model is not None:
        lora.untie(gen_model, names)
