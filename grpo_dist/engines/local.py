"""One process, full precision: the policy and the reference are plain modules, no wrapper.

Used by build_engine for distributed.backend=fsdp when the world has one rank and mixed_precision is off: FSDP
would shard nothing there (it switches to NO_SHARD), and its per-layer hooks cost ~12% of a step of the reference
benchmark. Checkpoints are the same files as the FSDP engine's (HF weights + FQN-keyed optimizer state, or a DCP
directory), so a run can resume on more ranks under FSDP and the other way round. With mixed_precision set, the
FSDP engine stays in charge even on one rank (its MixedPrecision semantics: bf16 compute, fp32 master weights).

Everything that does not depend on the wrapper (backward, the optimizer step, LR schedule, DCP save/load, the
LoRA merge) is TorchEngine's, shared with FSDPEngine; only wrapping, gradient clipping and gathering differ.
"""

from __future__ import annotations

import contextlib

import torch

from grpo_dist.engines.base import clean_name
from grpo_dist.engines.torch_engine import TorchEngine


class LocalEngine(TorchEngine):
    def _wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        return model  # nothing to shard

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.requires_grad_(False).eval()

    def _clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    def _full_params(self):
        return contextlib.nullcontext()  # the parameters are the full weights

    @torch.no_grad()
    def iter_full_weights(self, dtype: torch.dtype | None = None):
        if self.cfg.lora.r:
            yield from self._merged_lora_weights(dtype)
            return
        for name, p in self.module.named_parameters():  # already full: one tensor at a time, cast if asked
            yield clean_name(name), p.detach() if dtype is None else p.detach().to(dtype)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def gather_full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        model_sd, optim_sd = self._full_state_dicts(StateDictOptions(full_state_dict=True))
        return {clean_name(k): v for k, v in model_sd.items()}, optim_sd

    def load_full_state(self, model_state, optim_state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        opts = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.module, model_state, options=opts)
        if optim_state is not None:
            self._load_optimizer(optim_state, bool(optim_state.get("state")), opts)
