"""What the FSDP engine and the local (unwrapped) engine share: torch's own optimizer step and DCP checkpoints.

The two differ only in wrapping (FSDP units or none), gradient clipping, how full weights and full state are
gathered; everything else (backward, the optimizer step and LR schedule, sharded checkpoints, the LoRA merge) is
TorchEngine's, so that their steps and checkpoints stay the same files and the same arithmetic.
"""

from __future__ import annotations

import abc
import contextlib
import math
import warnings
from typing import Any

import torch

from grpo_dist import distributed as gdist
from grpo_dist.engines.base import Engine, StepResult, build_optimizer, checkpoint_layers, clean_name, lr_schedule
from grpo_dist.models import decoder_layer_classes

OPTIMIZER_STARTED = "optimizer_started"  # the sharded checkpoint's flag: 0 = saved before the first optimizer step


@contextlib.contextmanager
def _quiet_sharded_warnings():
    """FSDP1's sharded state dicts warn on every call (deprecations inside torch, not actionable here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*(_get_pg_default_device|Multiple backends are registered).*")
        yield


class TorchEngine(Engine):
    """An engine whose policy is a torch module (wrapped by the subclass, or not) and whose AdamW step runs here.
    Subclasses say how to wrap (_wrap), clip (_clip_grad_norm) and see full parameters (_full_params)."""

    checkpoints_before_wrap = False  # True: _wrap applies activation checkpointing itself (FSDP2)

    def __init__(self, cfg, model: torch.nn.Module, ctx):
        super().__init__(cfg, ctx)
        self._stager: Any = None  # sharded_state_to_save(staged=True)'s, made at the first background save
        self._layer_classes = decoder_layer_classes(model)
        model.eval()  # no dropout anywhere: sampling, old, reference and trained log-probs must agree
        self.module = self._wrap(model, trainable=True)
        if cfg.distributed.activation_checkpointing and not self.checkpoints_before_wrap:
            checkpoint_layers(self.module, self._layer_classes)
        self.optimizer = build_optimizer(cfg, [p for p in self.module.parameters() if p.requires_grad])
        self.scheduler = lr_schedule(cfg, self.optimizer)

    @abc.abstractmethod
    def _wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        """The policy (trainable) or the reference as this engine runs it."""

    @abc.abstractmethod
    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to max_norm; the global norm before clipping, the same on every rank."""

    @abc.abstractmethod
    def _full_params(self) -> contextlib.AbstractContextManager:
        """Context in which self.module's named parameters are the full (unsharded) weights."""

    # ------------------------------------------------------------------------------------------------- update
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, skip: bool = False) -> StepResult:
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = self._clip_grad_norm(max_norm)
        applied = not skip and math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, applied=applied)

    # ---------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def _merged_lora_weights(self, dtype: torch.dtype | None):
        """LoRA: the plain model's weights, W + (alpha / r) B A, for the generation copy and vLLM. Under FSDP the
        adapters are units of their own, so a layer's base weight and its A, B are gathered together (the whole
        model at once: with LoRA the trainable part is small, and the base model is what a merge needs anyway)."""
        from grpo_dist.lora import merged, scaling
        with self._full_named_parameters() as full:
            for name, t in merged(full, scaling(self.cfg.lora)).items():
                yield name, t.detach() if dtype is None else t.detach().to(dtype)

    def iter_adapter_weights(self):
        """LoRA: the adapters' full tensors only (plain names, as stored), for rollout ranks that merge them into
        their own base weights (async_rollout.AdapterMerge). Collective: every rank must exhaust the iterator."""
        from grpo_dist.lora import is_adapter_param
        with self._full_named_parameters() as full:
            for name, t in full.items():
                if is_adapter_param(name):
                    yield name, t.detach()

    @contextlib.contextmanager
    def _full_named_parameters(self):
        """{plain name: full tensor} of every parameter, tied ones under every name (an adapted tied head is
        merged into a weight of its own), valid inside the context."""
        with self._full_params():
            yield {clean_name(n): p for n, p in self.module.named_parameters(remove_duplicate=False)}

    # ---------------------------------------------------------------------------------------------- checkpoints
    @contextlib.contextmanager
    def _optimizer_kept_unstarted(self):
        """DCP's get/set_state_dict fill an empty optimizer state by a zero-gradient step at lr 0 (step 1, zero
        moments). Before the first real step that would change every later step (Adam's bias correction counts
        it): a save or eval at step 0 must not. Yields whether the state was empty, and empties it again after."""
        unstarted = not self.optimizer.state
        try:
            yield unstarted
        finally:
            if unstarted:
                self.optimizer.state.clear()

    def supports_sharded(self) -> bool:
        return True

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        from grpo_dist import optim8bit
        if optim8bit.is_8bit(self.optimizer):  # its codes and block scales, this rank's own (optim8bit.py)
            return {"model": get_model_state_dict(self.module), **optim8bit.sharded_state(self.module, self.optimizer)}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)  # this rank's shards, plain FQNs
        return {"model": model_sd, "optim": optim_sd}

    def _legacy_sharded_state(self) -> dict:
        """get_state_dict's model and optimizer entries (fp32 moments): what sharded checkpoints of adamw_8bit held
        before its quantised state (optim8bit.sharded_state), and torch AdamW's."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    supports_async_save = True

    def sharded_state_to_save(self, staged: bool) -> dict:
        """This rank's shards of model + optimizer as save_sharded writes them; staged: copied into host memory
        (pinned and reused from save to save on CUDA), so that training may go on while a thread writes them.
        Collective (FSDP's state-dict hooks)."""
        with _quiet_sharded_warnings(), self._optimizer_kept_unstarted() as unstarted:
            state = self._sharded_state()
            # DCP needs an entry for every parameter: the filler state is written, and this flag says to drop it
            state[OPTIMIZER_STARTED] = torch.tensor(int(not unstarted))
            if staged:
                if self._stager is None:
                    from torch.distributed.checkpoint.staging import BlockingAsyncStager
                    self._stager = BlockingAsyncStager(cache_staged_state_dict=self.ctx.device.type == "cuda")
                state = self._stager.stage(state)
        return state

    def write_sharded(self, state: dict, path) -> None:
        """DCP-write a state from sharded_state_to_save. Collective in gdist.group() (the saver thread's own)."""
        import torch.distributed.checkpoint as dcp
        with _quiet_sharded_warnings():
            dcp.save(state, checkpoint_id=str(path), process_group=gdist.group())

    def save_sharded(self, path) -> None:
        self.write_sharded(self.sharded_state_to_save(staged=False), path)

    def load_sharded(self, path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from grpo_dist import optim8bit
        with _quiet_sharded_warnings():
            metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            quantised = optim8bit.sharded_holds_quantised(metadata)
            if quantised and not optim8bit.is_8bit(self.optimizer):
                raise ValueError(f"{path} holds optimizer=adamw_8bit's quantised optimizer state, which "
                                 f"optimizer={self.cfg.optimizer} cannot load from a sharded checkpoint; resume "
                                 f"with optimizer=adamw_8bit")
            # the shapes and shards to read into
            if quantised:  # the saved segments that overlap this rank's elements
                from torch.distributed.checkpoint.state_dict import get_model_state_dict
                state = {"model": get_model_state_dict(self.module),
                         **optim8bit.sharded_template(self.module, self.optimizer, metadata)}
            elif optim8bit.is_8bit(self.optimizer):  # fp32 moments (torch AdamW's, or adamw_8bit's before)
                state = self._legacy_sharded_state()
            else:
                state = self._sharded_state()
            if OPTIMIZER_STARTED in metadata:  # checkpoints written before the flag have none
                state[OPTIMIZER_STARTED] = torch.tensor(1)
            dcp.load(state, checkpoint_id=str(path), process_group=gdist.group())
            started = bool(state.pop(OPTIMIZER_STARTED, torch.tensor(1)))
            if quantised:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict
                set_model_state_dict(self.module, state["model"])
                optim8bit.load_sharded_state(self.module, self.optimizer, state)
            else:
                set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
        if not started:
            self.optimizer.state.clear()  # saved before the first step: no state, as a fresh optimizer has

    def _load_full_from_rank0(self, model_state, optim_state) -> None:
        """Collective: rank 0's full model and optimizer dicts (None elsewhere) into every rank's shards. torch's
        broadcast_from_rank0 broadcasts on the world group: where the trainers are a group of their own (rollout
        ranks, async_rollout.py) the rollout ranks never join it, so there every trainer takes a full copy over
        the trainer group (gdist.broadcast_state, held in host memory as rank 0 holds it) and loads it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        if gdist.group() is None:
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
            set_model_state_dict(self.module, model_state if self.ctx.is_main else {}, options=opts)
            self._load_optimizer_from_rank0(optim_state, opts)
            return
        opts = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.module, gdist.broadcast_state(model_state, self.ctx.device), options=opts)
        optim_state = gdist.broadcast_state(optim_state, self.ctx.device)
        if optim_state is not None:  # None on rank 0: None on every rank
            self._load_optimizer(optim_state, bool(optim_state.get("state")), opts)

    def _load_optimizer_from_rank0(self, optim_state: dict | None, opts) -> None:
        """Collective. Only rank 0 holds the dict: its answers (a state or none; stepped or not) are broadcast
        first, so that every rank makes the same set_optimizer_state_dict call, or none does."""
        from grpo_dist.distributed import broadcast_object
        from grpo_dist.optim8bit import holds_quantised
        mine = (optim_state is not None, bool(optim_state and optim_state.get("state")),
                holds_quantised(optim_state)) if self.ctx.is_main else None
        present, started, quantised = broadcast_object(mine)
        if quantised:  # adamw_8bit's codes and scales: sent one parameter at a time (optim8bit.load_full)
            self._load_quantised(optim_state if self.ctx.is_main else None, started, opts, broadcast=True)
        elif present:
            self._load_optimizer(optim_state if self.ctx.is_main else {}, started, opts)

    def _load_optimizer(self, optim_state: dict | None, started: bool, opts) -> None:
        """Collective (every rank, the same call): set_optimizer_state_dict from rank 0's (or this process's)
        dict; `started` (the same on every rank) False for a state saved before the first step, which is emptied
        again after the load (set_optimizer_state_dict fills it first, as get_state_dict does)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from grpo_dist.optim8bit import holds_quantised
        if holds_quantised(optim_state):  # every rank holds the whole dict here
            self._load_quantised(optim_state, started, opts, broadcast=False)
            return
        set_optimizer_state_dict(self.module, self.optimizer, optim_state if optim_state is not None else {},
                                 options=opts)
        if not started:
            self.optimizer.state.clear()

    def _load_quantised(self, optim_state: dict | None, started: bool, opts, broadcast: bool) -> None:
        """Collective when broadcast (rank 0 holds the dict): adamw_8bit's quantised state into this optimizer;
        optimizer=adamw takes it dequantised (fp32 moments, gathered on rank 0 as torch's loader wants them)."""
        from grpo_dist import optim8bit
        if not optim8bit.is_8bit(self.optimizer):
            dense = optim8bit.dequantised(optim_state, self.optimizer.param_groups) if optim_state else None
            if broadcast:
                self._load_optimizer(dense if self.ctx.is_main else {}, started, opts)
            else:
                self._load_optimizer(dense, started, opts)
            return
        optim8bit.load_full(self.module, self.optimizer, optim_state, broadcast)
        if not started:
            self.optimizer.state.clear()

    def _full_state_dicts(self, options) -> tuple[dict, dict | None]:
        """get_state_dict of model and optimizer with `options` (full); adamw_8bit's optimizer state gathered as
        its codes and block scales (optim8bit.gather_full, one parameter at a time) instead of fp32 moments."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        from grpo_dist import optim8bit
        with self._optimizer_kept_unstarted() as unstarted:
            if optim8bit.is_8bit(self.optimizer):
                model_sd = get_model_state_dict(self.module, options=options)
                optim_sd = optim8bit.gather_full(self.module, self.optimizer)
            else:
                model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=options)
        if unstarted and optim_sd is not None:
            optim_sd["state"] = {}  # not the filler get_state_dict made: nothing, as before any step
        return model_sd, optim_sd
