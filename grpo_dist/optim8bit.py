"""8-bit AdamW (config key optimizer: adamw_8bit; 001 section 2.2): bitsandbytes' AdamW8bit, whose two moments
are stored as one byte per element plus one fp32 scale per block of 256 (~2 bytes per parameter instead of 8).

Why bitsandbytes (measured here, docs/optimizers.md): its CPU backend runs the 8-bit step on this CPU-only box in
milliseconds and under FSDP1's sharded use_orig_params parameters (shards of any size, empty ones included);
torchao's AdamW8bit compiles every parameter shape with torch.compile on CPU (two steps of a 3-layer toy model on
2 ranks: ~115 s against ~2 s) and its state, a tensor subclass, cannot be gathered by FSDP.optim_state_dict.
Neither library's own state dict survives FSDP's gathering (bitsandbytes hides its per-shard quantisation state in
a nested dict that FSDP then finds different on every rank), so AdamW8bit here converts its state.

The state dict (what checkpoints hold) has, per parameter, only fp32 tensors of the parameter's shape (FSDP gathers
and re-shards nothing else, and all of one dtype), so it is gathered like torch AdamW's: `step`, `exp_avg` and
`exp_avg_sq` (the moments, exactly the values the 8-bit step dequantizes, code x block scale: torch AdamW's own
keys, so a checkpoint moves between adamw and adamw_8bit), plus each element's block scale (`absmax1`, `absmax2`;
-1 where the shard keeps fp32 moments, as bitsandbytes does below min_8bit_size elements): 16 bytes per parameter
on disk, twice torch AdamW's. Loading recovers codes (the nearest code to moment / scale) and scales exactly when
the blocks line up as they were saved (same world size and sharding: the resume is bitwise); otherwise (another
world size, or a torch AdamW checkpoint) the moments are quantised afresh.

FSDP2 (fully_shard): bitsandbytes' kernels refuse DTensors, so ShardedAdamW8bit steps each parameter's local shard
(to_local() shares its storage) and returns the same state dict with DTensors placed like the parameter, which DCP
shards (save_format=sharded) or gathers (full) as it does torch AdamW's moments.
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK = 256  # bitsandbytes' block size of the blockwise 8-bit optimizers
EXTRA = "adamw8bit"  # setup.cfg extra: pip install 'grpo_dist[adamw8bit]'


def available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def missing_problem() -> list[str]:
    """The one config line for optimizer=adamw_8bit without bitsandbytes."""
    if available():
        return []
    return [f"config key 'optimizer' = adamw_8bit needs bitsandbytes: pip install 'grpo_dist[{EXTRA}]'"]


def build_adamw_8bit(cfg, params) -> torch.optim.Optimizer:
    """AdamW8bit from learning_rate / adam_* / weight_decay over params; ShardedAdamW8bit when they are DTensors
    (FSDP2's fully_shard)."""
    import bitsandbytes as bnb
    from bitsandbytes import functional as F
    from torch.distributed.tensor import DTensor

    class AdamW8bit(bnb.optim.AdamW8bit):
        def state_dict(self):
            sd = torch.optim.Optimizer.state_dict(self)
            params = [p for g in self.param_groups for p in g["params"]]
            sd["state"] = {i: self._portable(st, params[i]) for i, st in sd["state"].items()}
            return sd

        def _portable(self, st: dict, p: torch.Tensor) -> dict:
            return _portable(st, p)

        def load_state_dict(self, state_dict, move_to_device=True):
            params = [p for g in self.param_groups for p in g["params"]]
            saved_groups = state_dict["param_groups"]
            if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
                raise ValueError("loaded optimizer state has different parameter groups")
            for g, sg in zip(self.param_groups, saved_groups):
                g.update({k: v for k, v in sg.items() if k != "params"})
            # saved keys (indices, or names under torch.distributed.checkpoint) map onto params in order, as torch's
            by_key = dict(zip((k for g in saved_groups for k in g["params"]), params))
            self.state.clear()
            for key, st in state_dict["state"].items():
                if st:
                    self.state[by_key[key]] = self._native(st, by_key[key])

        def _eight_bit(self, p: torch.Tensor) -> bool:
            """Whether parameter p gets 8-bit moments: bitsandbytes' rule by p's elements (FSDP1: this rank's
            shard; a DTensor counts the whole parameter, so under FSDP2 every rank and 1 process decide alike)."""
            return p.numel() >= self.args.min_8bit_size  # type: ignore[attr-defined]

        def _native(self, st: dict, p: torch.Tensor) -> dict:
            return self._native_local(st, p, self._eight_bit(p))

        def _native_local(self, st: dict, p: torch.Tensor, eight_bit: bool) -> dict:
            n = p.numel()
            step = int(float(st["step"]))
            m = st["exp_avg"].to(p.device, torch.float32).reshape(p.shape)
            v = st["exp_avg_sq"].to(p.device, torch.float32).reshape(p.shape)
            if not eight_bit:  # fp32 moments for small tensors
                return {"step": step, "state1": m.clone(), "state2": v.clone()}
            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            out = {"step": step, "qmap1": self.name2qmap["dynamic"].to(p.device),
                   "qmap2": self.name2qmap["udynamic"].to(p.device)}
            for k, x in (("1", m), ("2", v)):
                saved = st.get(f"absmax{k}")
                scale = saved.to(p.device, torch.float32).flatten() if saved is not None else \
                    torch.full((n,), -1.0, device=p.device)
                blocks = scale[::BLOCK]
                if bool((blocks >= 0).all()) and torch.equal(blocks.repeat_interleave(BLOCK)[:n], scale):
                    # the blocks as saved: codes and scales exactly as they were
                    out[f"state{k}"] = _nearest_codes(x.flatten(), scale, out[f"qmap{k}"]).reshape(p.shape)
                    out[f"absmax{k}"] = blocks.clone()
                else:  # another layout (world size) or fp32 moments: quantise as bitsandbytes does
                    codes, qs = F.quantize_blockwise(x.flatten().contiguous(), code=out[f"qmap{k}"],
                                                     blocksize=BLOCK)
                    out[f"state{k}"] = codes.reshape(p.shape)
                    out[f"absmax{k}"] = qs.absmax.float()
            return out

    class ShardedAdamW8bit(AdamW8bit):
        """AdamW8bit over fully_shard's DTensor parameters. bitsandbytes' kernels take plain tensors only, and a
        DTensor's to_local() shares storage with this rank's shard: the step runs on the local shard and its local
        gradient, so the update lands in the parameter. The state holds local tensors; state_dict() wraps them as
        DTensors placed like their parameter (what DCP shards, gathers and re-shards, as torch AdamW's moments)."""

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    local, grad = _local(p), _local(p.grad)
                    if not local.is_contiguous():  # the kernel writes the flat storage in place
                        raise RuntimeError("adamw_8bit under FSDP2 needs contiguous parameter shards")
                    config = self.get_config(gindex, pindex, group)
                    state = self.state[p]
                    if not state:
                        state.update(self._fresh_state(p, local))
                    state["step"] += 1
                    if local.numel():  # an empty shard (a rank past the last chunk) has nothing to update
                        self._update(state, config, local, grad.contiguous())
            return loss

        def _fresh_state(self, p: torch.Tensor, local: torch.Tensor) -> dict:
            """Zero moments for this rank's shard: 8-bit codes with one scale per 256 elements of the shard, or
            fp32 (bitsandbytes' init_state, on the local tensor)."""
            if not self._eight_bit(p):
                return {"step": 0, "state1": torch.zeros_like(local, dtype=torch.float32),
                        "state2": torch.zeros_like(local, dtype=torch.float32)}
            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            blocks = -(-local.numel() // BLOCK)
            return {"step": 0, "qmap1": self.name2qmap["dynamic"].to(local.device),
                    "qmap2": self.name2qmap["udynamic"].to(local.device),
                    "state1": torch.zeros_like(local, dtype=torch.uint8),
                    "state2": torch.zeros_like(local, dtype=torch.uint8),
                    "absmax1": torch.zeros(blocks, dtype=torch.float32, device=local.device),
                    "absmax2": torch.zeros(blocks, dtype=torch.float32, device=local.device)}

        def _update(self, state: dict, config: dict, p: torch.Tensor, g: torch.Tensor) -> None:
            """One AdamW step of bitsandbytes' kernels on plain tensors (its update_step without the DTensors)."""
            beta1, beta2 = config["betas"][0], config["betas"][1]
            if state["state1"].dtype == torch.uint8:
                F.optimizer_update_8bit_blockwise(
                    self.optimizer_name, g, p, state["state1"], state["state2"], beta1, beta2, 0.0, 0.0,
                    config["eps"], state["step"], config["lr"], state["qmap1"], state["qmap2"], state["absmax1"],
                    state["absmax2"], config["weight_decay"], gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
            else:
                F.optimizer_update_32bit(
                    self.optimizer_name, g, p, state["state1"], beta1, config["eps"], state["step"], config["lr"],
                    state["state2"], beta2, 0.0, 0.0, config["weight_decay"], 1.0, None, max_unorm=0.0,
                    skip_zeros=config["skip_zeros"])

        def _portable(self, st: dict, p: torch.Tensor) -> dict:
            assert isinstance(p, DTensor)
            out = _portable(st, p.to_local())
            return {k: v if k == "step" else DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                                shape=p.shape, stride=p.stride())
                    for k, v in out.items()}

        def _native(self, st: dict, p: torch.Tensor) -> dict:
            # DCP hands DTensors placed like p (sharded load, or rank 0's full state distributed): their shards
            return self._native_local({k: _local(v) for k, v in st.items()}, _local(p), self._eight_bit(p))

    params = list(params)
    sharded = any(isinstance(p, DTensor) for p in params)
    if sharded and not all(isinstance(p, DTensor) for p in params):
        raise ValueError("adamw_8bit: DTensor and plain parameters in one optimizer")
    return (ShardedAdamW8bit if sharded else AdamW8bit)(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay)


def _local(t):
    """A DTensor's local shard (the same storage), or t itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _portable(st: dict, p: torch.Tensor) -> dict:
    """One parameter's bitsandbytes state as tensors of the parameter's shape (see the module docstring)."""
    step = torch.tensor(float(st["step"]))
    if st["state1"].dtype != torch.uint8:  # fp32 moments (a shard under min_8bit_size)
        none = torch.full(p.shape, -1.0, device=p.device)
        return {"step": step, "exp_avg": st["state1"].float().clone(), "exp_avg_sq": st["state2"].float().clone(),
                "absmax1": none, "absmax2": none.clone()}
    n = p.numel()
    out = {"step": step}
    for k, name in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        scale = st[f"absmax{k}"].float().repeat_interleave(BLOCK)[:n].reshape(p.shape)
        out[name] = st[f"qmap{k}"].float()[st[f"state{k}"].long()] * scale
        out[f"absmax{k}"] = scale
    return out


def _nearest_codes(x: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The code whose value x scale is x (x = qmap[code] x scale, written by _portable): the nearest entry of qmap
    to x / scale (the entries are far apart against fp32 rounding). A block of scale 0 holds zeros: any code."""
    r = torch.where(scale > 0, x / scale.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(x))
    values, order = qmap.float().sort()
    i = torch.searchsorted(values, r).clamp(1, len(values) - 1)
    nearer_left = (r - values[i - 1]).abs() <= (values[i] - r).abs()
    return order[torch.where(nearer_left, i - 1, i)].to(torch.uint8)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's live state tensors on this rank (what the bench reports per parameter)."""
    seen, total = set(), 0
    for st in optimizer.state.values():
        for v in st.values():
            v = _local(v)  # torch AdamW's FSDP2 moments are DTensors: this rank holds their shards
            if torch.is_tensor(v) and v.data_ptr() not in seen:  # the shared qmaps count once
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total
