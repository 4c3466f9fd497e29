"""One process, full precision: the policy and the reference are plain modules, no wrapper.

Used by build_engine for distributed.backend=fsdp when the world has one rank and mixed_precision is off: FSDP
would shard nothing there (it switches to NO_SHARD), and its per-layer hooks cost ~12% of a step of the reference
benchmark. Checkpoints are the same files as the FSDP engine's (HF weights + FQN-keyed optimizer state, or a DCP
directory), so a run can resume on more ranks under FSDP and the other way round. With mixed_precision set, the
FSDP engine stays in charge even on one rank (its MixedPrecision semantics: bf16 compute, fp32 master weights).
"""

from __future__ import annotations

import functools
import math

import torch

from grpo_dist.engines import Engine, StepResult, adamw_with_schedule
from grpo_dist.engines.fsdp import _quiet_sharded_warnings, clean_name
from grpo_dist.models import decoder_layer_classes


class LocalEngine(Engine):
    def __init__(self, cfg, model: torch.nn.Module, ctx):
        self.cfg, self.ctx = cfg, ctx
        model.eval()  # no dropout anywhere: sampling, old, reference and trained log-probs must agree
        self.module = model
        if cfg.distributed.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
            layers = tuple(decoder_layer_classes(model))
            apply_activation_checkpointing(
                model, check_fn=lambda m: isinstance(m, layers),
                checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        self.optimizer, self.scheduler = adamw_with_schedule(cfg, [p for p in model.parameters() if p.requires_grad])

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.requires_grad_(False).eval()

    # ------------------------------------------------------------------------------------------------- update
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, skip: bool = False) -> StepResult:
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        params = [p for p in self.module.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        applied = not skip and math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, applied=applied)

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @torch.no_grad()
    def copy_weights_to(self, replica: torch.nn.Module) -> None:
        full = {clean_name(n): p for n, p in self.module.named_parameters()}
        for name, p in replica.named_parameters():
            p.copy_(full[name])

    # ---------------------------------------------------------------------------------------------- checkpoints
    def gather_full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True))
        return {clean_name(k): v for k, v in model_sd.items()}, optim_sd

    def load_full_state(self, model_state, optim_state) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.module, model_state, options=opts)
        if optim_state is not None:
            set_optimizer_state_dict(self.module, self.optimizer, optim_state, options=opts)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_sharded(self, path) -> None:
        import torch.distributed.checkpoint as dcp
        with _quiet_sharded_warnings():
            dcp.save(self._state(), checkpoint_id=str(path))

    def load_sharded(self, path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        with _quiet_sharded_warnings():
            state = self._state()
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
