"""DeepSpeed ZeRO-2 / ZeRO-3 engine: the same Engine interface as FSDP, so the GRPO algorithm does not change.

What grpo_dist keeps for itself, whatever the DeepSpeed config says, so that both backends take the same step:
  * the optimizer (AdamW from learning_rate / adam_* / weight_decay) and the LR schedule (warmup_steps,
    lr_scheduler_type). An "optimizer" / "scheduler" section of a DeepSpeed config is ignored with a warning.
  * gradient accumulation: the trainer runs the micro-batches and calls step() once per optimizer step, so
    DeepSpeed's gradient_accumulation_steps is 1 (it must not divide the loss again).
  * gradient_clipping = max_grad_norm.
DeepSpeed averages gradients over ranks as FSDP does, so the trainer's `loss * world_size` means the same here.

Skipped steps: DeepSpeed skips a step by itself when the gradients are not finite (on every rank: the norm is
global). For a step the trainer asks to skip with finite gradients (e.g. no token on any rank), the AdamW here
is told to hold: DeepSpeed computes and reports the norm, and nothing (weights, moments, step count, schedule)
moves.

Checkpoints: checkpoint.py writes the HF directory from gather_full_state() (rank 0), then calls
save_engine_state(dir), which adds DeepSpeed's own partitioned checkpoint under dir/deepspeed/ (fp32 master
weights and optimizer moments per rank) for an exact resume. Without it (a checkpoint from FSDP, or a different
world size) the weights come from the HF files and the optimizer starts fresh, with a warning.

`deepspeed` is an optional dependency (`pip install -e .[deepspeed]`); this module imports it only when an
engine is built, so the config helpers below work without it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_dist import distributed as gdist
from grpo_dist.config import ConfigError
from grpo_dist.config.choices import MIXED_PRECISIONS
from grpo_dist.engines.base import Engine, StepResult, adamw, checkpoint_layers, clean_name, lr_schedule
from grpo_dist.models import cast_parameters_, decoder_layer_classes, fill_from_rank0, load_on_rank0_only

ENGINE_STATE_DIR = "deepspeed"  # inside checkpoint-<step>/
_TAG = "state"
_OPTIM_MARKER = {"format": "deepspeed", "note": "optimizer state is DeepSpeed's own, under deepspeed/"}
_GATHER_NUMEL = 50_000_000  # ZeRO-3: gather at most this many elements at once when copying full weights


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:  # a ConfigError: train.py reports it in one line and exits with 2
        raise ConfigError(
            "distributed.backend=deepspeed needs the deepspeed package, which is not installed "
            f"({e}). Install the extra: pip install -e .[deepspeed]  (on a machine without CUDA: "
            "DS_BUILD_OPS=0 pip install -e .[deepspeed])") from e
    if not hasattr(deepspeed.DeepSpeedEngine, "managed_gradient_accumulation"):
        raise ConfigError(f"distributed.backend=deepspeed needs deepspeed>=0.19.8 (managed_gradient_accumulation), "
                          f"found {deepspeed.__version__}: pip install -e .[deepspeed]")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # no per-rank config dumps in the training log
    return deepspeed


# ------------------------------------------------------------------------------------------------- configuration
def load_deepspeed_file(path: str) -> dict:
    """A DeepSpeed config from JSON (.json) or YAML (bounded like the trainer's config: config.load_yaml), with
    errors naming the file."""
    import yaml

    from grpo_dist.config import load_yaml
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key 'distributed.deepspeed_config': {path} does not exist")
    try:
        # not yaml for .json: YAML 1.1 reads JSON's 1e9 as a string
        data = json.loads(p.read_text()) if p.suffix == ".json" else load_yaml(p.read_text(), path)
    except ConfigError:
        raise
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config must be a mapping, got {type(data).__name__}")
    return data


def _find_auto(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _find_auto(v, f"{prefix}{k}.")
    elif d == "auto":
        yield prefix[:-1]


def build_deepspeed_config(cfg, world_size: int, hidden_size: int | None = None) -> dict:
    """The config handed to deepspeed.initialize: the user's file (distributed.deepspeed_config) or
    {zero_optimization: {stage: distributed.zero_stage}}, with the keys that must agree with grpo_dist's own
    config filled in or overridden (see the module docstring). Pure function: needs no deepspeed."""
    dcfg = cfg.distributed
    src = dcfg.deepspeed_config or "distributed.zero_stage"
    ds = copy.deepcopy(load_deepspeed_file(dcfg.deepspeed_config)) if dcfg.deepspeed_config else {}

    for section in ("optimizer", "scheduler"):
        if section in ds:
            ds.pop(section)
            warnings.warn(f"{src}: the '{section}' section is ignored: grpo_dist builds AdamW and the LR schedule "
                          f"from its own keys (learning_rate, adam_*, weight_decay, warmup_steps, "
                          f"lr_scheduler_type) so that both backends take the same step")

    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{src}: 'zero_optimization' must be a mapping")
    stage = zero.get("stage", "auto")
    if stage == "auto" or not dcfg.deepspeed_config:
        stage = dcfg.zero_stage
    if stage not in (2, 3):
        raise ConfigError(f"{src}: zero_optimization.stage={stage!r}; grpo_dist supports ZeRO stage 2 and 3")
    zero["stage"] = stage
    if hidden_size:  # the usual sizes for "auto" buckets (proportional to a layer's weight matrix)
        h2 = hidden_size * hidden_size
        for key, value in (("reduce_bucket_size", h2), ("stage3_prefetch_bucket_size", int(0.9 * h2)),
                           ("stage3_param_persistence_threshold", 10 * hidden_size)):
            if zero.get(key) == "auto":
                zero[key] = value
    if dcfg.cpu_offload:  # fp32 masters + Adam moments (and at stage 3 the parameters) live in host memory
        zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": True})
        if stage == 3:
            zero.setdefault("offload_param", {"device": "cpu", "pin_memory": True})
        ds.setdefault("zero_force_ds_cpu_optimizer", False)  # our torch AdamW steps the offloaded partitions
    for key in ("cpu_offload", "offload_optimizer", "offload_param"):
        if key in zero and zero[key] not in (None, False, {}) and \
                not (isinstance(zero[key], dict) and zero[key].get("device", "none") == "none"):
            warnings.warn(f"{src}: zero_optimization.{key} is passed to DeepSpeed as is; grpo_dist's tests do not "
                          f"cover offloading")

    # Precision: "auto" / absent follow distributed.mixed_precision; an explicit setting in the file wins, but
    # must not contradict an explicit mixed_precision.
    mp = dcfg.mixed_precision
    for kind in MIXED_PRECISIONS:  # DeepSpeed's sections have the names of distributed.mixed_precision's values
        sec = ds.get(kind)
        enabled = sec.get("enabled", "auto") if isinstance(sec, dict) else "auto"
        if enabled == "auto":
            ds.setdefault(kind, {})
            if not isinstance(ds[kind], dict):
                ds[kind] = {}
            ds[kind]["enabled"] = mp == kind
        elif enabled and mp not in (None, kind):
            raise ConfigError(f"{src}: {kind}.enabled=true contradicts distributed.mixed_precision={mp}")
        elif not enabled and mp == kind:
            raise ConfigError(f"{src}: {kind}.enabled=false contradicts distributed.mixed_precision={mp}")
    if ds["bf16"]["enabled"] and ds["fp16"]["enabled"]:
        raise ConfigError(f"{src}: bf16 and fp16 are both enabled")

    # Keys grpo_dist owns: the trainer accumulates micro-batches itself and calls step() once.
    clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0
    owned = {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
             "train_batch_size": cfg.micro_batch_size * world_size, "gradient_clipping": clip}
    why = {"gradient_accumulation_steps": "the trainer accumulates micro-batches and steps once",
           "gradient_clipping": "max_grad_norm"}
    for key, value in owned.items():
        given = ds.get(key, "auto")
        if key in why and given != "auto" and given != value:
            warnings.warn(f"{src}: {key}={given} is replaced by {value} ({why[key]})")
        ds[key] = value  # the batch sizes are DeepSpeed's bookkeeping only
    # backward() only accumulates; step() reduces and updates (without this, every backward of a GAS=1 engine
    # is a boundary and the gradients of earlier micro-batches are lost).
    ds["managed_gradient_accumulation"] = False
    ds["zero_allow_untested_optimizer"] = True  # our AdamW subclass (see _HoldableAdamW)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)

    left = list(_find_auto(ds))
    if left:
        raise ConfigError(f"{src}: no value for 'auto' at {', '.join(left)}; set numbers there")
    return ds


# ---------------------------------------------------------------------------------------------------- the engine
class _HoldableAdamW(torch.optim.AdamW):
    """AdamW whose step does nothing while `hold` is set. DeepSpeed runs the optimizer inside its partitioned step
    (after reducing, norming and clipping the gradients); holding it is how a step with finite gradients is
    skipped without touching DeepSpeed's internals."""

    hold = False

    def step(self, closure=None):
        if self.hold:
            return None
        return super().step(closure)


class DeepSpeedEngine(Engine):
    module: Any  # a deepspeed.DeepSpeedEngine (deepspeed has no type hints)

    def __init__(self, cfg, model: torch.nn.Module, ctx):
        super().__init__(cfg, ctx)
        self.ds_lib = import_deepspeed()
        self.ds_config = build_deepspeed_config(cfg, ctx.world_size, getattr(model.config, "hidden_size", None))
        self.stage = self.ds_config["zero_optimization"]["stage"]
        self.mixed = self.ds_config["bf16"]["enabled"] or self.ds_config["fp16"]["enabled"]
        if dist.is_initialized():  # our process group (gloo / nccl) becomes DeepSpeed's
            self.ds_lib.init_distributed(dist_backend=ctx.backend, dist_init_required=False)
        model.eval()  # no dropout anywhere: sampling, old, reference and trained log-probs must agree
        self._fill(model)
        if cfg.distributed.activation_checkpointing:
            checkpoint_layers(model, decoder_layer_classes(model))
        # torch's default AdamW kernels, as before: the fused ones are untried on DeepSpeed's flat fp32 partitions
        self.base_optimizer = adamw(cfg, [p for p in model.parameters() if p.requires_grad], _HoldableAdamW,
                                    allow_fused=False)
        self.module, self.optimizer, _, _ = self.ds_lib.initialize(
            model=model, optimizer=self.base_optimizer, config=copy.deepcopy(self.ds_config),
            dist_init_required=False)
        self.module.module.eval()
        # DeepSpeed rewrites the param groups of the base optimizer in place (flat fp32 partitions), keeping the
        # group dicts, so the schedule set on them is the one the partitioned step reads.
        self.scheduler = lr_schedule(cfg, self.base_optimizer)

    # ------------------------------------------------------------------------------------------------ wrapping
    def _fill(self, model: torch.nn.Module) -> None:
        """Pretrained weights on several ranks: rank 0 read them, the others built on the meta device
        (models.load_on_rank0_only); they get storage on their device and rank 0's values before DeepSpeed sees
        the model. Collective."""
        if load_on_rank0_only(self.cfg, self.ctx.world_size):
            fill_from_rank0(model, self.ctx.device)

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        model.requires_grad_(False)
        model.eval()
        self._fill(model)
        if self.stage == 2:
            # ZeRO-2 keeps full weights on every rank anyway: the reference is a plain replicated model, its
            # parameters in the compute dtype of the policy and its buffers (RoPE's inv_freq) in fp32 as the
            # policy's stay (DeepSpeed casts parameters only): the KL at step 0 is then exactly 0.
            low = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else \
                torch.float16 if self.ds_config["fp16"]["enabled"] else None
            return cast_parameters_(model, low)
        # ZeRO-3 inference: partitioned like the policy, no optimizer.
        ref_cfg = {k: v for k, v in self.ds_config.items() if k not in ("gradient_clipping",)}
        ref, *_ = self.ds_lib.initialize(model=model, config=copy.deepcopy(ref_cfg), dist_init_required=False)
        ref.module.eval()
        return ref

    # ------------------------------------------------------------------------------------------------- update
    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)  # gradient_accumulation_steps=1: DeepSpeed does not rescale the loss

    def step(self, skip: bool = False) -> StepResult:
        self.base_optimizer.hold = skip
        try:
            self.module.step()
        finally:
            self.base_optimizer.hold = False
        norm = self.module.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else math.nan
        # DeepSpeed skipped a non-finite step on every rank (global norm); `skip` is agreed by the trainer.
        applied = not skip and math.isfinite(grad_norm)
        if applied:
            self.scheduler.step()
        return StepResult(grad_norm=grad_norm, applied=applied)

    # ------------------------------------------------------------------------------------------- full weights
    def _param_chunks(self, remove_duplicate: bool = True):
        """Lists of (name, param) in a fixed order (the same on every rank), each small enough to gather."""
        chunk, numel = [], 0
        for name, p in self.module.module.named_parameters(remove_duplicate=remove_duplicate):
            chunk.append((clean_name(name), p))
            numel += getattr(p, "ds_numel", p.numel())
            if numel >= _GATHER_NUMEL:
                yield chunk
                chunk, numel = [], 0
        if chunk:
            yield chunk

    def _gathered(self, params, modifier_rank=None):
        return self.ds_lib.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=self.stage == 3)

    @torch.no_grad()
    def iter_full_weights(self, dtype: torch.dtype | None = None):
        if self.cfg.lora.r:
            yield from self._merged_lora_weights(dtype)
            return
        for chunk in self._param_chunks():  # ZeRO-3: one gathered chunk at a time
            with self._gathered([p for _, p in chunk]):
                for name, p in chunk:
                    yield name, p.detach() if dtype is None else p.detach().to(dtype)

    def _merged_lora_weights(self, dtype: torch.dtype | None):
        """LoRA: the plain model's weights W + (alpha / r) B A. A merge needs a layer's base weight and its A, B
        together: ZeRO-3 gathers the whole model at once (with LoRA the trainable part is small, and the base is
        what the rollout engine receives anyway). Every name of a tied weight: an adapted tied head is merged into
        a weight of its own."""
        from grpo_dist.lora import merged, scaling
        named = {clean_name(n): p for n, p in self.module.module.named_parameters(remove_duplicate=False)}
        with self._gathered(list({id(p): p for p in named.values()}.values())):
            for name, t in merged(named, scaling(self.cfg.lora)).items():
                yield name, t.detach() if dtype is None else t.detach().to(dtype)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def gather_full_state(self):
        from deepspeed.utils import safe_get_full_fp32_param
        out = {} if self.ctx.is_main else None
        seen: dict[int, str] = {}
        for chunk in self._param_chunks(remove_duplicate=False):
            unique = [p for _, p in chunk if id(p) not in seen]
            with self._gathered(unique):
                for name, p in chunk:
                    if id(p) in seen:  # tied weights: the same tensor under a second name
                        if out is not None:
                            out[name] = out[seen[id(p)]]
                        continue
                    seen[id(p)] = name
                    # With bf16/fp16 the fp32 master weights are the model; safe_get_full_fp32_param is a
                    # collective in both stages, so every rank calls it.
                    # Frozen parameters (LoRA's base) have no fp32 master: DeepSpeed holds them in the compute dtype.
                    full = safe_get_full_fp32_param(p) if self.mixed and p.requires_grad else p
                    if out is not None:
                        out[name] = full.detach().to("cpu", copy=True)
        if out is not None:
            for name, b in self.module.module.state_dict().items():
                name = clean_name(name)  # (the checkpoint wrapper strips its prefix from state_dict keys itself)
                if name not in out:  # persistent buffers (never partitioned)
                    out[name] = b.detach().to("cpu", copy=True)
        return (out, dict(_OPTIM_MARKER)) if self.ctx.is_main else (None, None)

    @torch.no_grad()
    def load_full_state(self, model_state, optim_state) -> None:
        """Weights from a full state dict on rank 0 (e.g. an HF checkpoint, possibly FSDP's). The optimizer state
        is DeepSpeed's own (load_engine_state); an FSDP optimizer state is not converted."""
        problem = None
        if self.ctx.is_main:
            names = [n for chunk in self._param_chunks() for n, _ in chunk]
            missing = [n for n in names if n not in model_state]
            if missing:
                problem = f"the checkpoint has no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        problem = gdist.broadcast_object(problem)
        if problem:
            raise KeyError(problem)
        for chunk in self._param_chunks():
            with self._gathered([p for _, p in chunk], modifier_rank=0):
                for name, p in chunk:
                    if self.ctx.is_main:
                        p.copy_(model_state[name])
                    if self.stage == 2 and self.ctx.world_size > 1:
                        dist.broadcast(p.data, 0)
        self.optimizer.refresh_fp32_params()  # type: ignore[attr-defined]  # DeepSpeed's ZeRO optimizer  # master weights follow the loaded ones
        if self.ctx.is_main and optim_state is not None and optim_state.get("format") != "deepspeed":
            warnings.warn("the checkpoint's optimizer state is not DeepSpeed's (another backend?): weights are "
                          "loaded, the AdamW moments start from zero")

    def save_engine_state(self, ckpt_dir: Path) -> None:
        """DeepSpeed's partitioned checkpoint (fp32 masters + moments per rank) for an exact resume. Collective."""
        self.module.save_checkpoint(str(Path(ckpt_dir) / ENGINE_STATE_DIR), tag=_TAG, save_latest=False)

    def load_engine_state(self, ckpt_dir: Path) -> bool:
        """Restore DeepSpeed's state when the checkpoint has it for this world size. Collective; True if loaded."""
        d = Path(ckpt_dir) / ENGINE_STATE_DIR / _TAG
        shards = sorted(d.glob("*optim_states.pt")) if d.is_dir() else []
        saved = len(shards)
        usable = saved == self.ctx.world_size
        usable = bool(gdist.all_reduce_max([0.0 if usable else 1.0], self.ctx.device)[0] == 0)  # agree
        if not usable:
            if self.ctx.is_main:
                why = "has none" if saved == 0 else f"was written by {saved} ranks, this run has {self.ctx.world_size}"
                warnings.warn(f"{ckpt_dir}: DeepSpeed state {why}; resuming from the HF weights with fresh AdamW "
                              f"moments (not an exact resume)")
            return False
        path, _ = self.module.load_checkpoint(str(d.parent), tag=_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load its checkpoint from {d}")
        return True
