"""FSDP2 engine (distributed.backend=fsdp2): torch.distributed.fsdp.fully_shard, per-parameter DTensor shards.

Units as FSDP1's (distributed.fsdp_wrap: one fully_shard per decoder layer plus the root, or the root alone below
100M parameters under auto); the reference is sharded the same way. MixedPrecisionPolicy(param bf16/fp16,
reduce fp32) for the policy; the reference's parameters are stored in the compute dtype already. No flat
parameters: frozen and trainable parameters share a unit freely (LoRA needs no units of its own), and tied
weights (lm_head = embed_tokens) sit in the root unit as one parameter.

Pretrained weights on several ranks: ranks != 0 build the model on the meta device and shard it there (nothing
allocated), then get storage for their shards only (to_empty) and rank 0's values, broadcast one tensor at a time:
no rank but 0 ever holds a full copy of the model.

Checkpoints are TorchEngine's / FSDP1's files: a gathered full state (plain HF names, FQN-keyed optimizer state,
rank 0 only) or a DCP directory (save_format=sharded), so a run resumes across fsdp, fsdp2 and the local engine.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from grpo_dist import distributed as gdist
from grpo_dist.engines.base import checkpoint_layers, clean_name
from grpo_dist.engines.fsdp import wrap_frozen_reference, wrap_units
from grpo_dist.engines.torch_engine import TorchEngine
from grpo_dist.models import MIXED_PRECISION_DTYPES, load_on_rank0_only

# distributed.sharding_strategy -> fully_shard's reshard_after_forward (config.py refuses the others for fsdp2)
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


class FSDP2Engine(TorchEngine):
    """Policy and reference under fully_shard; full weights are gathered unit by unit, full state by DCP's
    get_state_dict / set_model_state_dict."""

    checkpoints_before_wrap = True  # activation checkpointing goes inside the units (fully_shard wraps it)

    # ------------------------------------------------------------------------------------------------ wrapping
    def _wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        dcfg = self.cfg.distributed
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if not hasattr(self, "_mesh"):  # the trainer ranks' own group under asynchronous GRPO (rollout_ranks)
            self._mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,)) if gdist.group() is None \
                else DeviceMesh.from_group(gdist.group(), self.ctx.device.type)
        low = MIXED_PRECISION_DTYPES.get(dcfg.mixed_precision)
        # the policy computes in `low` from fp32 shards, gradients reduced in fp32; the reference stores `low`
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if trainable and low \
            else MixedPrecisionPolicy()
        # parameters, gradients and the optimizer step in host memory; copied to the device per unit on use
        offload = CPUOffloadPolicy() if dcfg.cpu_offload else OffloadPolicy()
        if trainable and dcfg.activation_checkpointing:
            checkpoint_layers(model, self._layer_classes)
        meta = any(p.is_meta for p in model.parameters())
        full = model.state_dict() if load_on_rank0_only(self.cfg, self.ctx.world_size) and self.ctx.is_main \
            else None  # rank 0's values, for the meta-built ranks (references to its tensors: no copy)
        shard = functools.partial(fully_shard, mesh=self._mesh, mp_policy=mp, offload_policy=offload,
                                  reshard_after_forward=RESHARD_AFTER_FORWARD[dcfg.sharding_strategy])
        if wrap_units(model, dcfg.fsdp_wrap) == "layer":
            for unit in self._layer_units(model):
                shard(unit)
        shard(model)  # the root: embeddings, final norm, head (and everything under fsdp_wrap=model)
        if load_on_rank0_only(self.cfg, self.ctx.world_size):
            self._take_rank0_values(model, full, meta)
        return model

    def _layer_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The decoder layers, or their activation-checkpoint wrappers (so the recompute runs inside the unit)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
        wrapper_of = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
        layers = tuple(self._layer_classes)
        return [wrapper_of.get(id(m), m) for m in model.modules() if isinstance(m, layers)]

    @torch.no_grad()
    def _take_rank0_values(self, model: torch.nn.Module, full: dict | None, meta: bool) -> None:
        """Collective. Meta-built ranks get storage for their shards and buffers; then every rank takes rank 0's
        buffers (non-persistent ones such as RoPE's inv_freq are in no state dict) and its parameter values: one
        full tensor at a time is broadcast on the compute device and each rank keeps its chunk as its shard.
        (Not set_model_state_dict's broadcast_from_rank0: under cpu_offload the shards are in host memory and it
        would broadcast host tensors, which nccl cannot.)"""
        device = torch.device("cpu") if self.cfg.distributed.cpu_offload else self.ctx.device
        if meta:
            model.to_empty(device=device)
            for b in model.buffers():  # CPU offload moves parameters only: buffers are where the rank computes
                if b.device != self.ctx.device:
                    b.data = b.data.to(self.ctx.device)
        for b in model.buffers():
            dist.broadcast(b.data, src=0, group=gdist.group())
        rank, world = self.ctx.rank, self.ctx.world_size
        for name, p in model.named_parameters():  # the same order on every rank; a tied weight once
            shard = p.to_local() if isinstance(p, DTensor) else p
            if full is not None:
                t = full[name].to(device=self.ctx.device, dtype=p.dtype)
            else:
                t = torch.empty(p.shape, dtype=p.dtype, device=self.ctx.device)
            dist.broadcast(t, src=0, group=gdist.group())
            if isinstance(p, DTensor):  # fully_shard's Shard(0): torch.chunk's pieces, empty past the last one
                pieces = torch.chunk(t, world, dim=0)
                t = pieces[rank] if rank < len(pieces) else t[:0]
            if t.shape != shard.shape:
                raise RuntimeError(f"{name}: rank {rank}'s shard is {tuple(shard.shape)}, its chunk of rank 0's "
                                   f"tensor {tuple(t.shape)}")
            shard.copy_(t)

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        return wrap_frozen_reference(self, model)

    # ------------------------------------------------------------------------------------------------- update
    def _clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
        # every rank holds the same parameters (its shards of each), so the same list: one all-reduce of the norm
        total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the sum of the shards' squares over ranks
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, None)
        return float(total)

    # ---------------------------------------------------------------------------------------------- generation
    def _units(self) -> list[tuple[str, torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]]:
        """(name prefix, unit, its own (name, parameter) pairs) for the root first, then the nested units."""
        names = {id(m): n for n, m in self.module.named_modules()}
        units = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        out: list[tuple[str, torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]] = []
        for unit in units:
            inside = names[id(unit)] + "." if names[id(unit)] else ""
            nested = [names[id(u)][len(inside):] + "." for u in units
                      if u is not unit and names[id(u)].startswith(inside)]
            own = [(n, p) for n, p in unit.named_parameters() if not any(n.startswith(s) for s in nested)]
            prefix = clean_name(names[id(unit)] + ".") if names[id(unit)] else ""
            out.append((prefix, unit, own))
        return out

    def _unshard_dtype(self) -> torch.dtype | None:
        """The dtype unshard() all-gathers in: the mixed-precision compute dtype, else the stored one (None)."""
        return MIXED_PRECISION_DTYPES.get(self.cfg.distributed.mixed_precision)

    def _full_tensor(self, p: DTensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole of a sharded parameter, cast before the all-gather (the collective moves dtype's bytes)."""
        local = p.to_local()
        local = local.to(device=self.ctx.device, dtype=dtype or local.dtype)  # from host memory under cpu_offload
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()

    @torch.no_grad()
    def iter_full_weights(self, dtype: torch.dtype | None = None):
        """One unit at a time (a decoder layer, or the root's embeddings, norm and head): the unit is all-gathered
        (by its own unshard() when that gathers in dtype: the compute dtype under mixed precision), its own
        parameters are yielded, and it is resharded before the next unit is gathered."""
        if self.cfg.lora.r:
            yield from self._merged_lora_weights(dtype)
            return
        stored = next(self.module.parameters()).dtype
        for prefix, unit, own in self._units():
            if (self._unshard_dtype() or stored) == (dtype or stored):
                assert isinstance(unit, FSDPModule)
                unit.unshard()
                try:
                    unsharded = dict(unit.named_parameters())  # its own now plain tensors, by the same names
                    for name, _ in own:
                        t = unsharded[name].detach()
                        yield prefix + clean_name(name), t if dtype is None else t.to(dtype)
                finally:
                    unit.reshard()
            else:  # another dtype than the unit gathers in: parameter by parameter, cast before the all-gather
                for name, p in own:
                    assert isinstance(p, DTensor)
                    yield prefix + clean_name(name), self._full_tensor(p, dtype)

    @contextlib.contextmanager
    def _full_params(self):
        """Every unit unsharded (in the dtype it gathers in) for the duration."""
        units = [u for _, u, _ in self._units() if isinstance(u, FSDPModule)]
        for u in units:
            u.unshard()
        try:
            yield
        finally:
            for u in units:
                u.reshard()

    @contextlib.contextmanager
    def _full_named_parameters(self):
        """The LoRA merge reads the stored (fp32 master) weights, as FSDP1's summon_full_params gives them."""
        full: dict[int, torch.Tensor] = {}
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in full:  # a tied weight: gathered once, under both names
                full[id(p)] = self._full_tensor(p, None) if isinstance(p, DTensor) else p
            out[clean_name(name)] = full[id(p)]
        yield out

    # ---------------------------------------------------------------------------------------------- checkpoints
    def gather_full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        # full_state_dict + cpu_offload: gathered tensor by tensor into rank 0's host memory, nothing elsewhere
        model_sd, optim_sd = self._full_state_dicts(StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.ctx.is_main:
            return None, None
        return {clean_name(k): v for k, v in model_sd.items()}, optim_sd

    def load_full_state(self, model_state, optim_state) -> None:
        # Rank 0 holds the dicts; the others receive their shards by broadcast, one tensor at a time.
        # Every rank loads an optimizer state, or none does (rank 0 alone knows whether there is one).
        self._load_full_from_rank0(model_state, optim_state)
