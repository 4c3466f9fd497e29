"""Training engines: the narrow interface between the GRPO algorithm and whatever shards the model.

The trainer and checkpoint.py only ever call the methods of the abstract base class `Engine` (forward through
`engine.module`, backward, step, weights for generation, full state for checkpoints). Implementations:
    engines/fsdp.py       FSDPEngine       FSDP (the default backend)
    engines/fsdp2.py      FSDP2Engine      FSDP2 (fully_shard, backend=fsdp2)
    engines/local.py      LocalEngine      one full-precision process, no wrapper (build_engine picks it)
    engines/deepspeed.py  DeepSpeedEngine  DeepSpeed ZeRO-2 / ZeRO-3
FSDPEngine, FSDP2Engine and LocalEngine share engines/torch_engine.py (TorchEngine: torch's own optimizer step and DCP
checkpoints). Engine itself, and what every engine builds the same way (activation checkpointing, AdamW, the LR
schedule, the configured optimizer settings after a resume), are in engines/base.py, which every engine imports;
this module holds build_engine, which imports the engines (one per distributed.backend: config.choices
TRAINING_BACKENDS), and re-exports base's names.
"""

from __future__ import annotations

import torch

from grpo_dist.engines.base import (OPTIMIZER_KEYS, SCHEDULE_KEYS, Engine, StepResult, adamw,  # noqa: F401
                                    apply_optimizer_settings, build_optimizer, checkpoint_layers, clean_name,
                                    copy_named_weights, lr_lambda, lr_schedule)


def shards_from_host(cfg, world_size: int) -> bool:
    """Whether build_engine's engine takes the policy (and reference) on the host and places them itself: FSDP
    moves each unit to device_id as it wraps it and shards it at once, so a GPU never holds more than one unsharded
    unit. Moving the whole model first would put all of it there in fp32 (45.7 GB at 7B, transient, before any
    sharding). The local engine (one process, no FSDP) and DeepSpeed take the model on the device."""
    return cfg.distributed.backend == "fsdp" and not _local_engine(cfg, world_size)


def _local_engine(cfg, world_size: int) -> bool:
    # One process in full precision: FSDP would shard nothing (it switches to NO_SHARD) and only add its per-layer
    # hooks, ~12% of a reference-benchmark step (bench/README.md).
    return world_size == 1 and not cfg.distributed.mixed_precision and not cfg.distributed.cpu_offload


def build_engine(cfg, model: torch.nn.Module, ctx) -> Engine:
    if cfg.distributed.backend == "fsdp":
        if _local_engine(cfg, ctx.world_size):
            from grpo_dist.engines.local import LocalEngine
            return LocalEngine(cfg, model, ctx)
        from grpo_dist.engines.fsdp import FSDPEngine
        return FSDPEngine(cfg, model, ctx)
    if cfg.distributed.backend == "fsdp2":  # on any world size: the same code as on N ranks
        from grpo_dist.engines.fsdp2 import FSDP2Engine
        return FSDP2Engine(cfg, model, ctx)
    if cfg.distributed.backend == "deepspeed":
        from grpo_dist.engines.deepspeed import DeepSpeedEngine
        return DeepSpeedEngine(cfg, model, ctx)
    raise ValueError(f"unknown distributed.backend {cfg.distributed.backend!r}")
