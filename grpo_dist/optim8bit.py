"""8-bit AdamW (config key optimizer: adamw_8bit; 001 section 2.2): bitsandbytes' AdamW8bit, whose two moments
are stored as one byte per element plus one fp32 scale per block of 256 (~2 bytes per parameter instead of 8).

Why bitsandbytes (measured here, docs/optimizers.md): its CPU backend runs the 8-bit step on this CPU-only box in
milliseconds and under FSDP1's sharded use_orig_params parameters (shards of any size, empty ones included);
torchao's AdamW8bit compiles every parameter shape with torch.compile on CPU (two steps of a 3-layer toy model on
2 ranks: ~115 s against ~2 s) and its state, a tensor subclass, cannot be gathered by FSDP.optim_state_dict.
Neither library's own state dict survives FSDP's gathering (bitsandbytes hides its per-shard quantisation state in
a nested dict that FSDP then finds different on every rank), so AdamW8bit here converts its state.

Checkpoints hold the quantised state itself (codes, block scales and where the blocks start: ~2 bytes per
parameter), gathered and scattered one parameter at a time by gather_full / load_full (full format) and
sharded_state / load_sharded_state (DCP): see "quantised checkpoint state" below and docs/optimizers.md.

state_dict() (torch's machinery: FSDP.optim_state_dict, DCP's get_state_dict, DeepSpeed) still gives, per
parameter, only fp32 tensors of the parameter's shape (FSDP gathers and re-shards nothing else, and all of one
dtype): `step`, `exp_avg` and `exp_avg_sq` (the moments the 8-bit step dequantizes, code x block scale: torch
AdamW's own keys) plus each element's block scale (`absmax1`, `absmax2`; -1 where the shard keeps fp32 moments, as
bitsandbytes does below min_8bit_size elements): 16 bytes per parameter, the layout checkpoints held before.
load_state_dict takes it (and torch AdamW's) back: codes (the nearest code to moment / scale) and scales are
recovered when the blocks line up as they were saved; otherwise the moments are quantised afresh.

FSDP2 (fully_shard): bitsandbytes' kernels refuse DTensors, so ShardedAdamW8bit steps each parameter's local shard
(to_local() shares its storage); its checkpoints take each rank's row shard as one segment of the flattened
parameter, and its state_dict() is the fp32-moment layout above as DTensors placed like the parameter.
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
            if Q8 in st:  # the quantised state of the whole parameter (one process, this bitsandbytes' code books)
                return native_from_quantised(self, st, qmaps(self), p, 0)
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



def nested_tensor_bytes(obj) -> int:
    """Bytes of every tensor in a nested state (dicts, lists, tuples): what a state_dict or a checkpoint's optimizer
    part holds (the bench and the tests measure the quantised state with it)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nested_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nested_tensor_bytes(v) for v in obj)
    return 0

# ----------------------------------------------------------------------------------- quantised checkpoint state
# What checkpoints of adamw_8bit hold per parameter (FQN-keyed, like torch AdamW's): bitsandbytes' own codes and
# block scales, ~2 bytes per parameter. The blocks of 256 start where each rank's elements start (FSDP1's flat
# shards, FSDP2's row shards), so the saved layout is described, not assumed: `q8_block_start` holds each block's
# first element in the flattened parameter (a block ends where the next starts); a block of absmax -1 is a shard
# that kept fp32 moments (bitsandbytes below min_8bit_size), whose values are in `q8_fp32`. Loading into the same
# layout copies codes and scales (bitwise resume); into another one it dequantises the rank's elements and
# quantises them afresh. FSDP's and DCP's optimizer gathering want tensors of the parameter's shape and one dtype
# per FSDP unit, so these functions gather (and scatter) the state themselves, one parameter at a time.
Q8 = "q8_codes"  # the key that marks a quantised per-parameter state: uint8 [2, *shape], the codes of both moments
QMAP = "q8_qmap"  # the state dict's code books [2, 256] (one copy, next to "state" and "param_groups")


def is_8bit(optimizer) -> bool:
    """Whether optimizer is this module's AdamW8bit (checkpoints take its quantised state)."""
    return hasattr(optimizer, "_native_local")


def holds_quantised(optim_sd: dict | None) -> bool:
    """Whether a full (FQN-keyed) optimizer state dict holds the quantised state (else fp32 moments, or nothing)."""
    return optim_sd is not None and any(Q8 in st for st in optim_sd.get("state", {}).values())


def _layout(module: torch.nn.Module, optimizer) -> list[tuple[str, torch.Tensor, int, torch.Size]]:
    """(name, parameter, offset of this rank's elements in the flattened parameter, full shape) per optimizer
    parameter in param_groups order: FSDP1 (use_orig_params: a parameter is this rank's slice of its flat shard),
    FSDP2 (DTensor row shards) or a plain parameter (all of it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from grpo_dist.param_names import clean_name
    names = {id(p): clean_name(n) for n, p in module.named_parameters()}
    flat: dict[int, tuple[int, torch.Size]] = {}
    for unit in FSDP.fsdp_modules(module):
        handle = getattr(unit, "_handle", None)
        if handle is not None:
            fp = handle.flat_param
            for p, info, shape in zip(fp._params, fp._shard_param_infos, fp._shapes):
                flat[id(p)] = (info.intra_param_start_idx if info.in_shard else 0, torch.Size(shape))
    out = []
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        if id(p) in flat:
            offset, shape = flat[id(p)]
        elif isinstance(p, DTensor):
            offset, shape = _row_offset(p), p.shape
        else:
            offset, shape = 0, p.shape
        out.append((names[id(p)], p, offset, shape))
    return out


def _row_offset(p) -> int:
    """The flat offset of a DTensor's local shard (fully_shard: rows of dim 0)."""
    import math

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(not isinstance(pl, Shard) or pl.dim != 0 for pl in p.placements):
        raise ValueError(f"adamw_8bit checkpoints need parameters sharded on dim 0, not {p.placements}")
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * math.prod(p.shape[1:])


def _segment(st: dict, offset: int) -> dict:
    """This rank's state of one parameter in host memory: codes [2, n], block starts, scales [2, blocks], fp32
    moments [2, m] (a shard that kept them: one block of absmax -1)."""
    s1, s2 = st["state1"].flatten(), st["state2"].flatten()
    n = s1.numel()
    if s1.dtype == torch.uint8:
        codes, fp32 = torch.stack([s1, s2]).cpu(), torch.empty(2, 0)
        starts = offset + torch.arange(0, n, BLOCK, dtype=torch.long)
        absmax = torch.stack([st["absmax1"].float(), st["absmax2"].float()]).cpu()
    else:
        codes, fp32 = torch.zeros(2, n, dtype=torch.uint8), torch.stack([s1, s2]).float().cpu()
        starts = torch.tensor([offset] if n else [], dtype=torch.long)
        absmax = torch.full((2, len(starts)), -1.0)
    return {"step": float(st["step"]), "offset": offset, "codes": codes, "starts": starts, "absmax": absmax,
            "fp32": fp32}


def _merge(segments: list, shape: torch.Size | None) -> dict | None:
    """One parameter's quantised state from every rank's segment (None: no rank holds state for it); shape None:
    adjacent segments of a part of it, from the first one's offset."""
    segs = sorted((s for s in segments if s is not None), key=lambda s: s["offset"])
    if not segs:
        return None
    codes = torch.cat([s["codes"] for s in segs], 1)
    if shape is not None and codes.shape[1] != shape.numel():
        raise RuntimeError(f"adamw_8bit state covers {codes.shape[1]} of the parameter's {shape.numel()} elements")
    return {"step": torch.tensor(float(segs[0]["step"])), Q8: codes.reshape(2, *(shape or (-1,))),
            "q8_block_start": torch.cat([s["starts"] for s in segs]),
            "q8_absmax": torch.cat([s["absmax"] for s in segs], 1), "q8_fp32": torch.cat([s["fp32"] for s in segs], 1)}


def _block_ends(q: dict, end: int) -> torch.Tensor:
    starts = q["q8_block_start"]
    return torch.cat([starts[1:], torch.tensor([end], dtype=torch.long)])


def dequantised_range(q: dict, qmap: torch.Tensor, offset: int, n: int, lo: int = 0) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """fp32 moments (qmap[k][code] x block scale, or the kept fp32 value) of elements [offset, offset + n) of a
    parameter whose quantised state q covers elements [lo, lo + its codes)."""
    codes, starts, absmax, fp32 = q[Q8].reshape(2, -1), q["q8_block_start"], q["q8_absmax"], q["q8_fp32"]
    ends = _block_ends(q, lo + codes.shape[1])
    idx = torch.arange(offset, offset + n, dtype=torch.long)
    blk = torch.searchsorted(starts, idx, right=True) - 1
    kept = absmax[0] < 0
    lengths = ends - starts
    before = torch.cumsum(lengths * kept, 0) - lengths * kept  # fp32 elements of the blocks before each block
    pos = (before[blk] + idx - starts[blk]).clamp(0, max(fp32.shape[1] - 1, 0))
    out = []
    for k in range(2):
        value = qmap[k].float()[codes[k, idx - lo].long()] * absmax[k, blk].clamp(min=0)
        out.append(torch.where(kept[blk], fp32[k][pos], value) if fp32.shape[1] else value)
    return out[0], out[1]


def _fp32_position(q: dict, i0: int, end: int) -> int:
    """Where block i0's elements start in q8_fp32 (the fp32 blocks before it, in order)."""
    lengths = _block_ends(q, end) - q["q8_block_start"]
    return int((lengths[:i0] * (q["q8_absmax"][0, :i0] < 0)).sum())


def qmaps(optimizer) -> torch.Tensor:
    """bitsandbytes' code books of the two moments ([2, 256] in host memory): what a code means, saved with the
    codes (a later bitsandbytes with other code books then re-quantises instead of copying)."""
    if "dynamic" not in optimizer.name2qmap:
        optimizer.fill_qmap()
    return torch.stack([optimizer.name2qmap["dynamic"], optimizer.name2qmap["udynamic"]]).float().cpu()


def native_from_quantised(optimizer, q: dict, qmap: torch.Tensor, p: torch.Tensor, offset: int, lo: int = 0) -> dict:
    """bitsandbytes' state for this rank's elements of p (offset in the flattened parameter) from the quantised
    state q (covering elements from lo; codes of the code books qmap): codes and scales copied where the saved
    blocks are this rank's blocks, else dequantised and quantised afresh (another world size)."""
    local = _local(p)
    n, eight_bit, step = local.numel(), optimizer._eight_bit(p), int(float(q["step"]))
    mine = qmaps(optimizer)
    starts, absmax, codes = q["q8_block_start"], q["q8_absmax"], q[Q8].reshape(2, -1)
    end = lo + codes.shape[1]
    ends = _block_ends(q, end)
    i0 = int(torch.searchsorted(starts, torch.tensor(offset)))
    dev, shape = local.device, local.shape
    if n and eight_bit and torch.equal(qmap.float(), mine):
        nb, sel = -(-n // BLOCK), slice(i0, i0 + -(-n // BLOCK))
        if starts[sel].numel() == nb and torch.equal(starts[sel], offset + torch.arange(0, n, BLOCK)) \
                and int(ends[i0 + nb - 1]) == offset + n and bool((absmax[:, sel] >= 0).all()):
            a = offset - lo
            return {"step": step, "qmap1": optimizer.name2qmap["dynamic"].to(dev),
                    "qmap2": optimizer.name2qmap["udynamic"].to(dev),
                    "state1": codes[0, a:a + n].reshape(shape).to(dev).clone(),
                    "state2": codes[1, a:a + n].reshape(shape).to(dev).clone(),
                    "absmax1": absmax[0, sel].to(dev).clone(), "absmax2": absmax[1, sel].to(dev).clone()}
    if n and not eight_bit and i0 < len(starts) and int(starts[i0]) == offset and int(ends[i0]) == offset + n \
            and float(absmax[0, i0]) < 0:
        j = _fp32_position(q, i0, end)
        return {"step": step, "state1": q["q8_fp32"][0, j:j + n].reshape(shape).to(dev).clone(),
                "state2": q["q8_fp32"][1, j:j + n].reshape(shape).to(dev).clone()}
    m, v = dequantised_range(q, qmap, offset, n, lo)
    return optimizer._native_local({"step": step, "exp_avg": m, "exp_avg_sq": v}, local, eight_bit)


def gather_full(module: torch.nn.Module, optimizer) -> dict | None:
    """Collective: the optimizer's full quantised state dict ({"state": {name: quantised state}, "param_groups"})
    on rank 0 (None elsewhere), gathered one parameter at a time into host memory."""
    from grpo_dist import distributed as gdist
    layout = _layout(module, optimizer)
    state = {}
    for name, p, offset, shape in layout:
        st = optimizer.state.get(p)
        # a rank with none of p's elements (FSDP1) may hold a state of empty tensors: nothing to save, nor its step
        segments = gdist.gather_object(_segment(st, offset) if st and _local(p).numel() else None)
        if segments is not None:
            q = _merge(segments, shape)
            if q is not None:
                state[name] = q
    if gdist.group_size() > 1 and torch.distributed.get_rank() != 0:
        return None
    names = iter(name for name, *_ in layout)
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[next(names) for _ in g["params"]])
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups, QMAP: qmaps(optimizer)}


def load_full(module: torch.nn.Module, optimizer, optim_sd: dict | None, broadcast: bool) -> None:
    """Collective when broadcast (rank 0 holds optim_sd, the others None: sent one parameter at a time): the
    quantised state dict of gather_full into this rank's optimizer."""
    from grpo_dist import distributed as gdist
    head = ([{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]], optim_sd[QMAP]) \
        if optim_sd else None
    if broadcast:
        head = gdist.broadcast_object(head)
    assert head is not None, "load_full without a state dict on rank 0"
    groups, qmap = head
    if len(groups) != len(optimizer.param_groups):
        raise ValueError("loaded optimizer state has different parameter groups")
    for g, saved in zip(optimizer.param_groups, groups):
        g.update(saved)
    optimizer.state.clear()
    for name, p, offset, _ in _layout(module, optimizer):
        q = optim_sd["state"].get(name) if optim_sd else None
        if broadcast:
            q = gdist.broadcast_object(q)
        if q is not None and _local(p).numel():  # none of p's elements here (FSDP1): no state, as gather_full
            optimizer.state[p] = native_from_quantised(optimizer, q, qmap, p, offset)


def dequantised(optim_sd: dict, groups: list[dict]) -> dict:
    """A quantised full state dict as torch AdamW's (step, exp_avg, exp_avg_sq of the parameter's shape): what
    optimizer=adamw loads from an adamw_8bit checkpoint. groups: that optimizer's param_groups, whose options
    are kept where bitsandbytes' groups have none of the same name."""
    state = {}
    for name, q in optim_sd["state"].items():
        shape = q[Q8].shape[1:]
        m, v = dequantised_range(q, optim_sd[QMAP], 0, shape.numel())
        state[name] = {"step": q["step"].float(), "exp_avg": m.reshape(shape), "exp_avg_sq": v.reshape(shape)}
    mine = [{k: saved.get(k, v) for k, v in g.items() if k != "params"} for g, saved in
            zip(groups, optim_sd["param_groups"])]
    return {"state": state, "param_groups": [dict(g, params=saved["params"]) for g, saved in
                                             zip(mine, optim_sd["param_groups"])]}


# Sharded (DCP) checkpoints: every rank writes its own segments (codes, block starts and scales, as in _segment)
# under SHARDED/<name>@<offset>/; a rank loads the saved segments that overlap its elements (the metadata lists
# them): its own one when the layout is unchanged (bitwise), its neighbours' parts otherwise (re-quantised).
SHARDED = "optim8bit"
HEAD = "optim8bit_head"  # param_groups (without params) and the code books


def sharded_state(module: torch.nn.Module, optimizer) -> dict:
    """This rank's quantised optimizer state as DCP entries (no collective; host memory, one parameter at a time)."""
    segments = {}
    for name, p, offset, _ in _layout(module, optimizer):
        st = optimizer.state.get(p)
        if st and _local(p).numel():
            seg = _segment(st, offset)
            segments[f"{name}@{offset}"] = {k: seg[k] if k != "step" else torch.tensor(seg[k])
                                            for k in ("step", "codes", "starts", "absmax", "fp32")}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {SHARDED: segments, HEAD: {"groups": groups, "qmap": qmaps(optimizer)}}


def sharded_holds_quantised(metadata: dict) -> bool:
    """Whether a DCP checkpoint's state_dict_metadata holds adamw_8bit's quantised optimizer state."""
    return any(k.startswith(HEAD + ".") for k in metadata)


def _saved_segments(metadata: dict) -> dict[str, dict[int, dict]]:
    """{name: {offset: {field: (size, dtype)}}} of the segments a DCP checkpoint holds."""
    out: dict[str, dict[int, dict]] = {}
    for key, md in metadata.items():
        if key.startswith(SHARDED + "."):
            where, field = key[len(SHARDED) + 1:].rsplit(".", 1)
            name, offset = where.rsplit("@", 1)
            out.setdefault(name, {}).setdefault(int(offset), {})[field] = (md.size, md.properties.dtype)
    return out


def sharded_template(module: torch.nn.Module, optimizer, metadata: dict) -> dict:
    """The DCP entries this rank loads: the saved segments that overlap its elements of each parameter."""
    saved = _saved_segments(metadata)
    segments = {}
    for name, p, offset, _ in _layout(module, optimizer):
        n = _local(p).numel()
        for start, fields in saved.get(name, {}).items():
            if n and start < offset + n and start + fields["codes"][0][1] > offset:
                segments[f"{name}@{start}"] = {f: torch.empty(size, dtype=dtype) for f, (size, dtype) in
                                               fields.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]  # DCP fills them in
    return {SHARDED: segments, HEAD: {"groups": groups, "qmap": torch.empty(2, 256)}}


def load_sharded_state(module: torch.nn.Module, optimizer, loaded: dict) -> None:
    """sharded_template's entries, read by DCP, into this rank's optimizer (no collective)."""
    groups = loaded[HEAD]["groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError("loaded optimizer state has different parameter groups")
    for g, saved in zip(optimizer.param_groups, groups):
        g.update(saved)
    by_name: dict[str, list] = {}
    for key, seg in loaded[SHARDED].items():
        name, offset = key.rsplit("@", 1)
        by_name.setdefault(name, []).append(dict(seg, offset=int(offset)))
    optimizer.state.clear()
    for name, p, offset, _ in _layout(module, optimizer):
        q = _merge(by_name.get(name, []), None)
        if q is not None:
            lo = min(s["offset"] for s in by_name[name])
            optimizer.state[p] = native_from_quantised(optimizer, q, loaded[HEAD]["qmap"], p, offset, lo)
