"""Training engines: the narrow interface between the GRPO algorithm and whatever shards the model.

The trainer only ever calls the methods of `Engine` (forward through `engine.module`, backward, step, weights for
generation, full state for checkpoints); FSDP is the default implementation, DeepSpeed ZeRO the alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

import torch


@dataclass
class StepResult:
    grad_norm: float
    applied: bool  # False when the step was skipped (non-finite loss or gradients on some rank)


class Engine:
    """What the trainer needs from a backend. Every method that talks to other ranks must be called on all ranks."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, skip: bool = False) -> StepResult:
        """Clip, then apply the optimizer and LR schedule, unless `skip` or the grad norm is not finite."""
        raise NotImplementedError

    def current_lr(self) -> float:
        raise NotImplementedError

    def copy_weights_to(self, replica: torch.nn.Module) -> None:
        """Write the full current weights into a plain (unsharded) model used for generation. Collective."""
        copy_named_weights(replica, self.iter_full_weights())

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The full current weights as (HF parameter name, tensor), gathered one unit at a time and cast to dtype
        (None: as stored), so that no rank ever holds the whole unsharded model in fp32. Each tensor is valid only
        until the next one is requested (copy it). Tied weights come once, under their first name. Collective:
        every rank must exhaust the iterator."""
        raise NotImplementedError

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard a frozen model (no grads, no optimizer state) the same way as the policy."""
        raise NotImplementedError

    def gather_full_state(self) -> tuple[dict | None, dict | None]:
        """(model state dict, optimizer state dict) on rank 0, (None, None) elsewhere. Collective."""
        raise NotImplementedError

    def load_full_state(self, model_state: dict | None, optim_state: dict | None) -> None:
        """Inverse of gather_full_state: rank 0 passes the dicts, the others None. Collective."""
        raise NotImplementedError

    def save_sharded(self, path) -> None:
        """Optional (save_format=sharded): write model + optimizer state as a torch.distributed.checkpoint (DCP)
        directory at `path`, every rank its own shards, nothing gathered. Collective. The model entries must be
        under "model." with the plain HF parameter names, so export_checkpoint can read them."""
        raise NotImplementedError

    def load_sharded(self, path) -> None:
        """Inverse of save_sharded, also at another world size (DCP reshards). Collective."""
        raise NotImplementedError

    # Optional, called by checkpoint.py when an engine defines them (DeepSpeed does): save_engine_state(ckpt_dir)
    # adds backend-specific state for an exact resume next to the HF files; load_engine_state(ckpt_dir) restores it
    # after load_full_state. Both collective.

    def supports_sharded(self) -> bool:
        return type(self).save_sharded is not Engine.save_sharded

    def scheduler_state(self) -> dict:
        raise NotImplementedError

    def load_scheduler_state(self, state: dict) -> None:
        raise NotImplementedError

    def apply_optimizer_settings(self, cfg) -> None:
        """After a resume: the configured AdamW settings and LR schedule replace the checkpoint's."""
        apply_optimizer_settings(getattr(self, "base_optimizer", None) or self.optimizer, self.scheduler, cfg)


@torch.no_grad()
def copy_named_weights(replica: torch.nn.Module, weights) -> int:
    """Copy (name, tensor) pairs into the replica's parameters of those names; every parameter of the replica
    (tied ones count once) must be written exactly once, else the replica would sample from stale weights."""
    dst = dict(replica.named_parameters())
    written = set()
    for name, tensor in weights:
        if name not in dst:
            raise KeyError(f"weight sync: the replica has no parameter {name!r}")
        dst[name].copy_(tensor)
        written.add(name)
    missing = sorted(set(dst) - written)
    if missing:
        raise KeyError(f"weight sync: {len(missing)} replica parameters got no weights, e.g. {missing[0]!r}")
    return len(written)


def lr_lambda(warmup_steps: int, total_steps: int, kind: str):
    """Multiplier of the base LR at optimizer step s: linear warmup, then constant / linear / cosine decay to 0."""
    import math

    def f(s: int) -> float:
        if warmup_steps and s < warmup_steps:
            return (s + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def adamw_with_schedule(cfg, params):
    """AdamW from learning_rate / adam_* / weight_decay, and its LR schedule over max_steps x num_iterations."""
    params = list(params)
    # the fused kernels (CPU and CUDA): the reference benchmark's optimizer step took 2.2 ms
    # instead of 8.0 ms with the per-parameter loop (bench/README.md)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay, fused=fused or None)
    total = cfg.max_steps * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, total,
                                                                       cfg.lr_scheduler_type))
    return optimizer, scheduler


OPTIMIZER_KEYS = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")
SCHEDULE_KEYS = ("warmup_steps", "lr_scheduler_type", "max_steps", "num_iterations")


def apply_optimizer_settings(optimizer, scheduler, cfg) -> None:
    """Make a restored optimizer and LR schedule follow the configured values (a resume restores the checkpoint's
    param groups and base LRs). The schedule's lambda is always built from the configured warmup/type/length; its
    position (last_epoch) stays the checkpoint's, so the LR is the new base LR times the new schedule at that step."""
    for g in optimizer.param_groups:
        g.update(betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay,
                 initial_lr=cfg.learning_rate)
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    position = max(scheduler.last_epoch, 0)
    lrs = [base * fn(position) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    scheduler._last_lr = lrs


def build_engine(cfg, model: torch.nn.Module, ctx) -> Engine:
    if cfg.distributed.backend == "fsdp":
        if ctx.world_size == 1 and not cfg.distributed.mixed_precision and not cfg.distributed.cpu_offload:
            # One process in full precision: FSDP would shard nothing (it switches to NO_SHARD) and only add its
            # per-layer hooks, ~12% of a reference-benchmark step (bench/README.md).
            from grpo_dist.engines.local import LocalEngine
            return LocalEngine(cfg, model, ctx)
        from grpo_dist.engines.fsdp import FSDPEngine
        return FSDPEngine(cfg, model, ctx)
    if cfg.distributed.backend == "deepspeed":
        from grpo_dist.engines.deepspeed import DeepSpeedEngine
        return DeepSpeedEngine(cfg, model, ctx)
    raise ValueError(f"unknown distributed.backend {cfg.distributed.backend!r}")
