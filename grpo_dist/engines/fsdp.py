"""FSDP (FullyShardedDataParallel, use_orig_params=True) engine: policy, frozen reference, optimizer, schedule."""

from __future__ import annotations

import functools
import warnings

import torch
from torch.distributed.fsdp import (CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from grpo_dist import distributed as gdist
from grpo_dist import optim8bit
from grpo_dist.engines.base import clean_name
from grpo_dist.engines.torch_engine import TorchEngine
from grpo_dist.models import (MIXED_PRECISION_DTYPES, cast_parameters_, fill_from_rank0, load_on_rank0_only,
                              materialize_meta)

# Below this many parameters the whole model is one FSDP unit under fsdp_wrap=auto. Unsharded it takes < 400 MB in
# fp32 (torch's size_based_auto_wrap_policy uses the same 1e8 as its default unit size). Per-layer units there add a
# collective and a hook pair per layer and pass: 2 ranks of the reference benchmark (4 layers) ran ~10% faster as one
# unit (bench/README.md).
WHOLE_MODEL_UNIT_BELOW = 100_000_000


def wrap_units(model: torch.nn.Module, setting: str) -> str:
    """'layer' or 'model' for distributed.fsdp_wrap = setting (auto decides by parameter count; meta models count
    too)."""
    if setting != "auto":
        return setting
    return "model" if sum(p.numel() for p in model.parameters()) < WHOLE_MODEL_UNIT_BELOW else "layer"


def _refuse_full_precision_no_shard_lora(cfg, world_size: int) -> None:
    """LoRA freezes the base weights. Under NO_SHARD in full precision FSDP unshards a frozen unit in place
    (its flat parameter is its own shard) and, with no gradient for it, never re-registers its parameters after
    the forward: they drop out of named_parameters and state_dict, and the first weight sync after a step finds
    none. With mixed precision (a separate low-precision copy) or a sharded strategy they come back."""
    dcfg = cfg.distributed
    if cfg.lora.r and world_size > 1 and dcfg.sharding_strategy == "NO_SHARD" and not dcfg.mixed_precision \
            and not dcfg.cpu_offload:
        from grpo_dist.config import ConfigError
        raise ConfigError(f"config key 'distributed.sharding_strategy' = NO_SHARD with LoRA (lora.r > 0) on "
                          f"{world_size} ranks needs distributed.mixed_precision (bf16 or fp16); in full precision "
                          f"use FULL_SHARD or SHARD_GRAD_OP")


def wrap_frozen_reference(engine: TorchEngine, model: torch.nn.Module) -> torch.nn.Module:
    """The reference model as FSDP1 and FSDP2 shard it: frozen, in eval mode, wrapped like the policy. It never
    trains: fp32 shards would only cost memory. Parameters take the compute dtype (the same rounding as the mixed
    precision cast of the policy, so the KL starts at exactly 0); buffers stay as the policy's do."""
    model.requires_grad_(False)
    model.eval()
    cast_parameters_(model, MIXED_PRECISION_DTYPES.get(engine.cfg.distributed.mixed_precision))
    return engine._wrap(model, trainable=False)


class FSDPEngine(TorchEngine):
    """Policy and reference as FSDP units (use_orig_params); full weights and state are gathered unit by unit."""

    # ------------------------------------------------------------------------------------------------ wrapping
    def _wrap(self, model: torch.nn.Module, trainable: bool) -> FSDP:
        dcfg = self.cfg.distributed
        if trainable:
            _refuse_full_precision_no_shard_lora(self.cfg, self.ctx.world_size)
        if self.ctx.world_size == 1:
            warnings.filterwarnings("ignore", message=".*switching to use `NO_SHARD`.*")
        mp = None
        if dcfg.mixed_precision:
            low = MIXED_PRECISION_DTYPES[dcfg.mixed_precision]
            mp = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32 if trainable else low)
        on_cuda = self.ctx.device.type == "cuda"
        rank0_load = load_on_rank0_only(self.cfg, self.ctx.world_size)
        device = self.ctx.device
        if rank0_load and not on_cuda:
            # Rank 0 read the weights; the other ranks hold a meta model. sync_module_states is refused on CPU:
            # give the meta ranks storage and broadcast rank 0's tensors in place before wrapping (measured lower
            # peak than set_model_state_dict's broadcast after wrapping, which stages full tensors: bench/memory.py)
            fill_from_rank0(model, device)
        wrapped = FSDP(
            model,
            process_group=gdist.group(),  # None: the world; the trainer ranks' own under rollout_ranks > 0
            sharding_strategy=ShardingStrategy[dcfg.sharding_strategy],
            auto_wrap_policy=self._wrap_policy(model, trainable),
            mixed_precision=mp,
            # parameters (and so gradients and the optimizer step) in host memory; unsharded per unit on use
            cpu_offload=CPUOffload(offload_params=True) if dcfg.cpu_offload else None,
            device_id=self.ctx.device,  # required on CPU too, else FSDP looks for an accelerator
            use_orig_params=True,
            limit_all_gathers=True,
            # issue the next unit's all-gather before this unit's forward runs (fewer stalls on each collective:
            # -5-9% of a 2-rank reference-benchmark step), at the cost of one more unsharded unit in memory
            forward_prefetch=True,
            # On CUDA rank 0's weights are broadcast while wrapping (the others built on the meta device); on CPU
            # this is refused: seeded tiny models are identical anyway, pretrained ones get the broadcast below.
            sync_module_states=on_cuda,
            # meta parameters get storage unit by unit as FSDP wraps, and are sharded at once: a non-zero rank
            # never holds more than one unsharded unit of a meta-built model (a decoder layer, or a < 100M model)
            param_init_fn=(lambda m: materialize_meta(m, device)) if rank0_load and on_cuda else None,  # type: ignore[arg-type]
        )
        return wrapped

    def _wrap_policy(self, model: torch.nn.Module, trainable: bool):
        layers = None if wrap_units(model, self.cfg.distributed.fsdp_wrap) == "model" else functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=self._layer_classes)
        if not (trainable and self.cfg.lora.r):
            return layers
        # LoRA: every adapter matrix is its own unit. A unit's flat parameter gets a gradient as large as the
        # whole flat parameter once any of its parameters trains: adapters sharing a unit with the frozen base
        # weights would cost a base-sized gradient per rank (measured: 13392 gradient elements for 832 adapter
        # ones on the tiny model), the memory LoRA is meant to save.
        from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy
        adapter = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: not list(m.children()) and any(
            p.requires_grad for p in m.parameters()))  # the leaves that train: lora_A / lora_B Linears
        return adapter if layers is None else functools.partial(_or_policy, policies=[adapter, layers])

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        return wrap_frozen_reference(self, model)

    # ------------------------------------------------------------------------------------------------- update
    def _clip_grad_norm(self, max_norm: float) -> float:
        if self.cfg.model.dtype == "float64":
            return self._clip_grad_norm_float64(max_norm)
        return float(self.module.clip_grad_norm_(max_norm))  # type: ignore[operator]  # global norm over all shards: same on all ranks

    @torch.no_grad()
    def _clip_grad_norm_float64(self, max_norm: float) -> float:
        """FSDP's clip_grad_norm_ takes its norms in fp32 and refuses fp64 gradients: the same clipping in fp64.
        The squares of this rank's gradient shards, summed over the ranks (NO_SHARD ranks hold every gradient
        whole; HYBRID_SHARD is refused with float64 by the config), then torch's clip coefficient. Collective."""
        import torch.distributed as dist
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for g in grads:
            squares += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        if self.ctx.world_size > 1 and self.cfg.distributed.sharding_strategy != "NO_SHARD":
            dist.all_reduce(squares, group=gdist.group())  # every rank, whatever its shard holds
        total = squares.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return float(total)

    # ---------------------------------------------------------------------------------------------- generation
    def _full_params(self):
        return FSDP.summon_full_params(self.module, writeback=False, recurse=True)

    def iter_full_weights(self, dtype: torch.dtype | None = None):
        """One FSDP unit at a time (a decoder layer, or the root's embeddings, norm and head; the whole model under
        fsdp_wrap=model, which only applies below 100M parameters): the unit is all-gathered, its own parameters
        are yielded in dtype, and it is resharded before the next unit is gathered."""
        if self.cfg.lora.r:
            yield from self._merged_lora_weights(dtype)
            return
        names = {id(m): n for n, m in self.module.named_modules()}
        for unit in FSDP.fsdp_modules(self.module):  # root first, then nested units in module order
            prefix = clean_name(names[id(unit)] + ".") if names[id(unit)] else ""
            nested = {id(p) for m in unit.modules() if isinstance(m, FSDP) and m is not unit for p in m.parameters()}
            with FSDP.summon_full_params(unit, writeback=False, recurse=False):
                for name, p in unit.named_parameters():
                    if id(p) not in nested:
                        yield prefix + clean_name(name), p.detach() if dtype is None else p.detach().to(dtype)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def gather_full_state(self):
        offload = self.ctx.device.type != "cpu"  # offload_to_cpu=True segfaults when the tensors are on CPU already
        with warnings.catch_warnings():
            # FSDP1's state_dict_type is "being deprecated" in favour of get_state_dict; the spec keeps this API.
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
            return self._gather_full_state(offload)

    def _gather_full_state(self, offload: bool):
        with FSDP.state_dict_type(self.module, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            model_sd = self.module.state_dict()
            # torch 2.13's FSDP.optim_state_dict leaves an empty state empty; guarded as DCP's calls are
            with self._optimizer_kept_unstarted() as unstarted:
                optim_sd = optim8bit.gather_full(self.module, self.optimizer) if optim8bit.is_8bit(self.optimizer) \
                    else FSDP.optim_state_dict(self.module, self.optimizer, group=gdist.group())
        if not self.ctx.is_main or optim_sd is None:
            return None, None
        if unstarted:
            optim_sd["state"] = {}
        return {clean_name(k): v for k, v in model_sd.items()}, optim_sd

    def load_full_state(self, model_state, optim_state) -> None:
        # Rank 0 holds the dicts; the others receive their shards by broadcast (one copy in host memory per node).
        # Every rank loads an optimizer state, or none does (rank 0 alone knows whether there is one).
        self._load_full_from_rank0(model_state, optim_state)
