"""The engine interface and what every engine builds the same way: the abstract base class `Engine` (and its
StepResult), the weight copy into a generation replica (copy_named_weights, clean_name), activation checkpointing
(checkpoint_layers), AdamW (adamw, build_optimizer), the LR schedule (lr_lambda, lr_schedule) and the configured
optimizer settings after a resume (apply_optimizer_settings).

A leaf of grpo_dist.engines: every engine module imports its base class from here, and grpo_dist/engines/__init__.py
(build_engine, which picks an engine) imports the engines, so no import leads from an engine back to the
package.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch

from grpo_dist.param_names import clean_name  # noqa: F401  (the engines import it from here)


@dataclass
class StepResult:
    grad_norm: float
    applied: bool  # False when the step was skipped (non-finite loss or gradients on some rank)


class Engine(abc.ABC):
    """What the trainer and checkpoint.py need from a training backend, and all they call.

    Every engine sets, in its __init__:
        module     the policy as the trainer runs it: forward, and `engine.backward` of a loss computed from it
        optimizer  the optimizer whose state the checkpoints hold (DeepSpeed: its ZeRO wrapper of the AdamW)
        scheduler  the LR schedule (lr_schedule); scheduler.optimizer is the torch AdamW whose param groups carry
                   the learning rate the step uses
    Abstract methods are what a backend must provide; the others are defaults a backend may override (sharded
    checkpoints, backend state for an exact resume). A method marked Collective must be called on every rank, in
    the same order.
    """

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx

    # ------------------------------------------------------------------------------------------------ wrapping
    @abc.abstractmethod
    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard a frozen model (no grads, no optimizer state) the same way as the policy. Collective."""

    # ------------------------------------------------------------------------------------------------- update
    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (a micro-batch's, already scaled by the trainer); averaged over ranks
        by the time step() applies them."""

    @abc.abstractmethod
    def step(self, skip: bool = False) -> StepResult:
        """Clip to max_grad_norm, then apply the optimizer and advance the LR schedule, unless `skip` or the
        global grad norm is not finite (then nothing moves: weights, moments, step count, schedule). Clears the
        gradients either way. Collective."""

    def current_lr(self) -> float:
        """The learning rate the next step uses."""
        return self.scheduler.optimizer.param_groups[0]["lr"]

    # ---------------------------------------------------------------------------------------------- generation
    @abc.abstractmethod
    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The full current weights as (HF parameter name, tensor), gathered one unit at a time and cast to dtype
        (None: as stored), so that no rank ever holds the whole unsharded model in fp32. Each tensor is valid only
        until the next one is requested (copy it). Tied weights come once, under their first name. Collective:
        every rank must exhaust the iterator."""

    def copy_weights_to(self, replica: torch.nn.Module) -> None:
        """Write the full current weights into a plain (unsharded) model used for generation. Collective."""
        copy_named_weights(replica, self.iter_full_weights())

    # ---------------------------------------------------------------------------------------------- checkpoints
    @abc.abstractmethod
    def gather_full_state(self) -> tuple[dict | None, dict | None]:
        """(model state dict with plain HF names and full tensors, optimizer state dict) on rank 0, (None, None)
        elsewhere. Collective."""

    @abc.abstractmethod
    def load_full_state(self, model_state: dict | None, optim_state: dict | None) -> None:
        """Inverse of gather_full_state: rank 0 passes the dicts, the others None. The engine may keep the passed
        tensors as its own (and update them in later steps): pass copies of state that must stay. Collective."""

    def supports_sharded(self) -> bool:
        """Whether save_sharded / load_sharded exist (save_format=sharded); the default engine has only full
        checkpoints."""
        return False

    def save_sharded(self, path) -> None:
        """Optional (save_format=sharded; see supports_sharded): write model + optimizer state as a
        torch.distributed.checkpoint (DCP) directory at `path`, every rank its own shards, nothing gathered.
        Collective. The model entries must be under "model." with the plain HF parameter names, so
        export_checkpoint can read them."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format")

    def load_sharded(self, path) -> None:
        """Inverse of save_sharded, also at another world size (DCP reshards). Collective."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format")

    # Whether a save may go on in a background thread (async_save): the engine's state can be copied out at once
    # (gather_full_state, sharded_state_to_save + write_sharded) and save_engine_state writes nothing. DeepSpeed's
    # own checkpoint runs its collectives in the training group: its saves stay synchronous.
    supports_async_save = False

    def sharded_state_to_save(self, staged: bool) -> dict:
        """Optional (supports_async_save with save_format=sharded): the state save_sharded writes, staged: copied
        to host memory. Collective."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format")

    def write_sharded(self, state: dict, path) -> None:
        """Write a state from sharded_state_to_save as save_sharded would. Collective in gdist.group()."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format")

    def save_engine_state(self, ckpt_dir: Path) -> None:  # noqa: B027  (optional: no state by default)
        """Backend-specific state for an exact resume, written into the checkpoint directory next to the HF files
        (DeepSpeed: its partitioned optimizer under deepspeed/). Called on every save; by default there is none.
        Collective."""

    def load_engine_state(self, ckpt_dir: Path) -> bool:
        """Restore what save_engine_state wrote, after load_full_state / load_sharded. True if such state was
        loaded; by default there is none. Collective."""
        return False

    def scheduler_state(self) -> dict:
        """The LR schedule's state (its position) for trainer_state.json."""
        return self.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

    def apply_optimizer_settings(self, cfg) -> None:
        """After a resume: the configured AdamW settings and LR schedule replace the checkpoint's."""
        apply_optimizer_settings(self.scheduler.optimizer, self.scheduler, cfg)


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


def checkpoint_layers(module: torch.nn.Module, layer_classes) -> None:
    """Activation checkpointing: every decoder layer recomputed in the backward pass (torch's non-reentrant
    wrapper, on every engine: HF's gradient_checkpointing_enable is off in eval mode, where the policy runs)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    layers = tuple(layer_classes)
    apply_activation_checkpointing(
        module, check_fn=lambda m: isinstance(m, layers),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


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


_AdamW = TypeVar("_AdamW", bound=torch.optim.AdamW)


def adamw(cfg, params, optimizer_class: type[_AdamW], allow_fused: bool = True) -> _AdamW:
    """An AdamW (torch.optim.AdamW, or a subclass: DeepSpeed's holdable one) from learning_rate / adam_* /
    weight_decay over params."""
    params = list(params)
    # the fused kernels (CPU and CUDA): the reference benchmark's optimizer step took 2.2 ms
    # instead of 8.0 ms with the per-parameter loop (bench/README.md)
    fused = allow_fused and bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                                 for p in params)
    return optimizer_class(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                           eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay, fused=fused or None)


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The optimizer config key `optimizer` names: torch AdamW, or bitsandbytes' AdamW8bit (grpo_dist/optim8bit.py)."""
    if cfg.optimizer == "adamw_8bit":
        from grpo_dist.optim8bit import build_adamw_8bit
        return build_adamw_8bit(cfg, params)
    return adamw(cfg, params, torch.optim.AdamW)


def lr_schedule(cfg, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of warmup_steps / lr_scheduler_type over max_steps x num_iterations optimizer steps."""
    total = cfg.max_steps * cfg.num_iterations
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, total, cfg.lr_scheduler_type))


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
