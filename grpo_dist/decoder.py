"""Lean KV-cached decoding for Llama-family models (Qwen2, Qwen3, Llama, Mistral).

At rollout sizes a transformers forward spends most of a decode step outside the model's arithmetic: a growing
cache re-allocated by torch.cat every token, mask construction, rotate_half's cat, three q/k/v matmuls where one
would do (a profile of the tiny reference model: 8 ms per token, of which 2.3 ms in cat). This module runs the same
computation with:
  - a preallocated cache [rows, kv_heads, prompt + max_new_tokens, head_dim] per layer, written in place;
  - one q|k|v and one gate|up matmul per layer: the trainer's generation replica has its q/k/v (gate/up) weights
    re-pointed into one buffer once (prepare_replica), so weight refreshes fill it in place at no extra memory;
    other models are left untouched and run separate matmuls;
  - RoPE on q and k together as one multiply and one add from a precomputed [[cos, -sin], [sin, cos]] table (no
    flip or concatenation), RMSNorm as torch's fused rms_norm, softmax without dtype round trips, k's RoPE result
    written straight into its cache column: 17 ops per layer per decode step in fp32, 19 in bf16 (36 before;
    bench/decode_ops.py counts them), each with transformers' arithmetic;
  - the prompt prefilled once per group and its cache copied to the G rows that share it.
Anything it does not model (other architectures, dynamic RoPE, sliding windows shorter than the sequence, adapters
wrapping the projections) makes `lean_decoder_unsupported` return the reason, and the caller falls back to the
transformers forward. Tests check logits against the transformers forward for every supported architecture.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq does not change with the sequence length
ATTENTION_WIDTH = 64  # a decode step attends over the keys rounded up to a multiple of this (attention_width)


def lean_decoder_unsupported(model, total_length: int) -> str | None:
    """Why `LeanDecoder` cannot run this model for sequences of total_length tokens, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    inner: Any = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return "lm_head is not a plain Linear"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a projection is not a plain Linear (adapter or quantised layer)"
        # Qwen2/Qwen3 keep a per-layer window (None on full-attention layers); Mistral reads it from the config
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        if window is not None and window < total_length:
            return f"sliding window {window} is shorter than the sequence ({total_length} tokens)"
    return None


def _not_views_of(params: list[torch.Tensor], buffer: torch.Tensor) -> bool:
    """True when the parameters are no longer consecutive views of buffer (e.g. after model.to())."""
    offset = 0
    for p in params:
        if p.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr() or \
                p.storage_offset() != buffer.storage_offset() + offset or not p.is_contiguous():
            return True
        offset += p.numel()
    return False


@torch.no_grad()
def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One buffer holding the parameters back to back; each parameter becomes a view of its slice."""
    buffer = torch.cat([p.detach() for p in params], dim=0)
    row = 0
    for p in params:
        p.data = buffer[row:row + p.shape[0]]
        row += p.shape[0]
    return buffer


def fuse_projections(model) -> list[dict]:
    """Re-point each layer's q/k/v weights (and biases) and gate/up weights into single buffers, so that LeanDecoder
    runs one matmul where there were three (two). The model computes exactly what it did; in-place weight copies
    into its parameters (the trainer's refresh) now fill the buffers. For a model that only generates (the
    trainer's replica): parameters that share storage cannot be saved with safetensors. Idempotent; call outside
    inference mode."""
    fused = fused_projections(model)
    if fused is not None:
        return fused
    fused = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv_b, gate_up_b = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], [m.gate_proj.bias, m.up_proj.bias]
        fused.append(dict(
            qkv_w=_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            qkv_b=_fuse(qkv_b) if qkv_b[0] is not None else None,
            gate_up_w=_fuse([m.gate_proj.weight, m.up_proj.weight]),
            gate_up_b=_fuse(gate_up_b) if gate_up_b[0] is not None else None))
    model._grpo_fused_projections = fused
    return fused


def prepare_replica(model) -> bool:
    """Fuse the projections of a generation-only copy of the policy when LeanDecoder covers its architecture.
    Returns whether it did."""
    if lean_decoder_unsupported(model, total_length=0) is not None:
        return False
    fuse_projections(model)
    return True


def fused_projections(model) -> list[dict] | None:
    """The buffers of fuse_projections while the parameters are still views of them (model.to() or a load with
    assign=True replaces them), else None."""
    fused = getattr(model, "_grpo_fused_projections", None)
    if fused is None:
        return None
    for layer, f in zip(model.model.layers, fused):
        a, m = layer.self_attn, layer.mlp
        if _not_views_of([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], f["qkv_w"]) or \
                _not_views_of([m.gate_proj.weight, m.up_proj.weight], f["gate_up_w"]) or \
                (f["qkv_b"] is not None and _not_views_of([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], f["qkv_b"])) \
                or (f["gate_up_b"] is not None and _not_views_of([m.gate_proj.bias, m.up_proj.bias], f["gate_up_b"])):
            return None
    return fused


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, the same arithmetic (normalise in fp32, cast back, then scale), in torch's rms_norm: one
    fused kernel on CUDA where the composite was 6-8. fp32: the weight inside (bitwise transformers' on a CPU);
    bf16/fp16: rms_norm upcasts to fp32 inside and casts its result back, then the weight multiplies after the cast,
    as transformers does (torch would scale before the cast); fp64: transformers normalises in fp32 there too.
    A weight of more dimensions than one (Qwen3's q/k norm, one row per head) multiplies after the norm."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.dtype == torch.float64:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


class _Layer(NamedTuple):
    """One decoder layer's tensors, gathered once per rollout (attribute lookups cost more than small ops here)."""
    input_norm: torch.Tensor
    qkv_w: torch.Tensor | list  # one fused weight, or [q, k, v] weights of a model not prepared by fuse_projections
    qkv_b: torch.Tensor | list | None
    qk_norm: torch.Tensor | None  # Qwen3: per-head scales, q heads then k heads ([H + Hkv, D])
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor | list  # fused, or [gate, up]
    gate_up_b: torch.Tensor | list | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


class LeanDecoder:
    """prefill(ids, mask, repeats, max_new_tokens) once, then step(tokens) per token; each returns next-token logits
    [rows, vocab]. Built per rollout from the model's current weights (views, no copies)."""

    def __init__(self, model, cuda_graphs: bool = False, capture: bool = True, compile_step: bool = False,
                 capacity: tuple[int, int] | None = None, say=None):
        config, inner = model.config, model.model
        # decode steps replayed from CUDA graphs, one per batch-size bucket and attention width, on buffers allocated
        # once for capacity = (rows, prompt + completion tokens), the run's largest (CUDAGraphSteps; config
        # lean_cuda_graphs; None: the first prefill's); capture=False runs the same static steps without graphs
        # (what the CPU tests check); say: where the one line of an eager fallback goes (None: print)
        self.graphs = CUDAGraphSteps(self, capture and cuda_graphs, capacity, say) \
            if cuda_graphs or compile_step else None
        # the parameters' addresses: a captured graph reads the weights where they were (weights_moved)
        self._weight_ptrs = [p.data_ptr() for p in model.parameters()]
        if compile_step:  # config lean_compile: torch.compile of the static step (its cache column is a tensor, so
            # steps do not recompile; each decode batch size and attention width does, as each gets its own graph)
            self.static_step = torch.compile(self.static_step, dynamic=False)  # type: ignore[method-assign]
        unfused: list[Any] = [None] * len(inner.layers)
        fused: list[Any] = fused_projections(model) or unfused
        first = inner.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer, f in zip(inner.layers, fused):
            a, m = layer.self_attn, layer.mlp
            qk_norm = None
            if getattr(a, "q_norm", None) is not None:
                qk_norm = torch.cat([a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)])
            if f is None:  # not fused: separate matmuls, outputs concatenated (no side effect on the model)
                f = dict(qkv_w=[a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                         qkv_b=[a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
                         gate_up_w=[m.gate_proj.weight, m.up_proj.weight], gate_up_b=[m.gate_proj.bias, m.up_proj.bias])
            self.layers.append(_Layer(layer.input_layernorm.weight, f["qkv_w"], f["qkv_b"], qk_norm, a.o_proj.weight,
                                      a.o_proj.bias, layer.post_attention_layernorm.weight, f["gate_up_w"],
                                      f["gate_up_b"], m.down_proj.weight, m.down_proj.bias))
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head_w, self.lm_head_b = model.lm_head.weight, model.lm_head.bias
        self.inv_freq = inner.rotary_emb.inv_freq
        self.attention_scaling = inner.rotary_emb.attention_scaling
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------------------------------------------ pieces
    def _rope_tables(self, max_position: int, dtype) -> None:
        """RoPE as a 2 x 2 rotation of the head's two halves: out half a = sum over input half b of rope[pos, a, b] *
        half b, with rope[pos] = [[cos, -sin], [sin, cos]] per frequency ([positions, 2, 2, D/2]). One multiply
        and one add per step (_rope_products), no flip or concatenation of rotate_half, and the same arithmetic as
        transformers' q * cos + rotate_half(q) * sin: each output is round(round(x1 * c) + round(x2 * (+-s)))."""
        pos = torch.arange(max_position, device=self.inv_freq.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        self.rope = torch.stack([torch.stack([cos, -sin], -2), torch.stack([sin, cos], -2)], -3)

    def _rope_products(self, qk: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """qk [..., heads, D], rope [..., 1, 2, 2, D/2] -> the products [..., heads, 2 (out half), 2 (in half), D/2];
        RoPE's result is their sum over the in half (_rope_tables)."""
        return qk.unflatten(-1, (2, self.head_dim // 2))[..., None, :, :] * rope

    def _qk_v(self, w: _Layer, x: torch.Tensor):
        """Input -> q|k after the (Qwen3) q/k norm, before RoPE, [..., H + Hkv, D], and v, [..., Hkv, D]: views of
        one q|k|v matmul's output."""
        D, nqk = self.head_dim, self.n_heads + self.n_kv
        h = _rms_norm(x, w.input_norm, self.eps)
        if isinstance(w.qkv_w, list):
            qkv = torch.cat([F.linear(h, wt, b) for wt, b in zip(w.qkv_w, w.qkv_b)], -1)  # type: ignore[arg-type]
        else:
            qkv = F.linear(h, w.qkv_w, w.qkv_b)  # type: ignore[arg-type]
        qk = qkv[..., :nqk * D].unflatten(-1, (nqk, D))
        v = qkv[..., nqk * D:].unflatten(-1, (self.n_kv, D))
        if w.qk_norm is not None:
            qk = _rms_norm(qk, w.qk_norm, self.eps)
        return qk, v

    def _mlp(self, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, w.post_norm, self.eps)
        if isinstance(w.gate_up_w, list):
            gate, up = (F.linear(h, wt, b) for wt, b in zip(w.gate_up_w, w.gate_up_b))  # type: ignore[arg-type]
        else:
            gate, up = F.linear(h, w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)  # type: ignore[arg-type]
        return x + F.linear(F.silu(gate) * up, w.down_w, w.down_b)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(x, self.final_norm, self.eps), self.lm_head_w, self.lm_head_b)

    # ------------------------------------------------------------------------------------------------ prefill
    def weights_moved(self, model) -> bool:
        """True when the model's parameters no longer sit where this decoder read them (replaced, not filled in place:
        model.to(), a load with assign=True); its graphs would read the old ones."""
        return [p.data_ptr() for p in model.parameters()] != self._weight_ptrs

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: torch.Tensor | None, max_new_tokens: int):
        """ids/mask [b, P] left-padded unique prompts; row i is decoded repeats[i] times (None: once). Returns the
        logits of the last prompt position, one row per decoded row."""
        b, P = ids.shape
        H, dtype, dev = self.n_heads, self.embed.dtype, ids.device
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = b if repeats is None else int(repeats.sum())
        expand = (lambda t: t) if repeats is None else (lambda t: t.repeat_interleave(repeats, 0))
        # the run's buffers (CUDA graphs, allocated once), else this rollout's own
        run = None if self.graphs is None else self.graphs.begin(rows, P + max_new_tokens, dtype, dev)
        if run is None:
            self._rope_tables(int(positions[:, -1].max()) + max_new_tokens + 1, dtype)
        else:
            self.rope = run.rope  # the same values per position, for every position the run can reach
        rope = self.rope[positions][:, :, None]  # [b, P, 1 (heads), 2, 2, D/2]
        # query i sees keys j <= i that are real tokens; padding queries see themselves (their output is unused)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        attend = ((causal[None] & mask.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)[None])[:, None]
        self.length = P
        self._allocate(rows, P, P + max_new_tokens, expand(mask.bool()), run)
        x = F.embedding(ids, self.embed)
        for w, (k_cache, v_cache) in zip(self.layers, self.cache):
            qk, v = self._qk_v(w, x)
            y = self._rope_products(qk, rope)
            qk = (y[..., 0, :] + y[..., 1, :]).flatten(-2)
            q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=self.scaling,
                                                 enable_gqa=H != self.n_kv)
            x = self._mlp(w, x + F.linear(out.transpose(1, 2).flatten(2), w.o_w, w.o_b))
            k_cache[:, :, :P] = expand(k)
            v_cache[:, :, :P] = expand(v)
        self._finite_columns = P  # columns written (the prompt's); attention_width zeroes more before they are read
        if run is None:
            self._positions = expand(positions[:, -1] + 1)  # every row's next position; its first rows are decoded
        else:
            self._positions = run.positions
            run.positions[:rows] = expand(positions[:, -1] + 1)
        self.next_position = self._positions[:rows]
        return expand(self._logits(x[:, -1]))

    def _allocate(self, rows: int, P: int, total: int, prompt_valid: torch.Tensor, run: StaticBuffers | None) -> None:
        """The caches [rows, kv_heads, columns, D] per layer and the additive key bias (-inf on prompt padding, one
        copy per kv head so that it broadcasts over the [rows * kv_heads, ...] batches of step()): new tensors of
        `total` columns, or the first rows of the run's buffers (run.length columns, the same addresses every
        rollout, as CUDA graphs need)."""
        dtype, dev, D = self.embed.dtype, prompt_valid.device, self.head_dim
        columns = total if run is None else run.length
        key_valid = torch.ones(rows, columns, dtype=torch.bool, device=dev)
        key_valid[:, :P] = prompt_valid
        bias = torch.zeros(rows, columns, dtype=dtype, device=dev).masked_fill_(~key_valid, float("-inf"))
        if run is None:
            self.key_bias = bias.repeat_interleave(self.n_kv, 0)[:, None, :]
            self._key_bias_rows = self.key_bias.view(rows, self.n_kv, 1, columns)  # compact() moves rows
            self._buffers = [(torch.empty(rows, self.n_kv, total, D, dtype=dtype, device=dev),
                              torch.empty(rows, self.n_kv, total, D, dtype=dtype, device=dev)) for _ in self.layers]
        else:
            run.bias_rows[:rows] = bias[:, None, None, :]
            run.bias_rows[rows:].zero_()  # rows a bucket pads with attend to finite keys: no NaN anywhere
            run.positions[rows:].zero_()
            self._key_bias_rows = run.bias_rows
            self.key_bias = run.bias_rows[:rows].flatten(0, 1)
            self._buffers = list(run.kv)
        self.cache = [(k[:rows], v[:rows]) for k, v in self._buffers]  # the whole buffers stay in _buffers

    # ------------------------------------------------------------------------------------------------ decode
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([rows] long); returns the next-token logits [rows, vocab]."""
        if self.graphs is not None and self.graphs.run_active:
            return self.graphs.step(tokens)
        col = self.length
        logits = self.static_step(tokens, self.next_position, col, self.attention_width(col + 1))
        self.length = col + 1
        self.next_position.add_(1)
        return logits

    def attention_width(self, length: int) -> int:
        """Cache columns a decode step attends over for `length` keys: length rounded up to ATTENTION_WIDTH (the
        extra ones masked), so that a CUDA graph captured for one width serves ATTENTION_WIDTH steps, and the eager
        step does the graph's arithmetic exactly. The columns up to that width are kept finite (zeroed before
        first use): a masked key still enters the matmul, and 0 x NaN would be NaN."""
        width = min(self.key_bias.shape[-1], -(-length // ATTENTION_WIDTH) * ATTENTION_WIDTH)
        if width > self._finite_columns:
            for k_buf, v_buf in self._buffers:
                k_buf[:, :, self._finite_columns:width].zero_()
                v_buf[:, :, self._finite_columns:width].zero_()
            self._finite_columns = width
        return width

    def static_step(self, tokens: torch.Tensor, positions: torch.Tensor, col: int | torch.Tensor,
                    width: int) -> torch.Tensor:
        """One decode step: the token of each row goes into cache column `col` (an int, or a [1] long tensor: then
        no Python number changes from step to step, what a CUDA graph captures) and attention reads the first
        `width` columns, those after col masked out. tokens, positions: [rows]. Returns the logits; self.length and
        the positions are the caller's to move."""
        H, Hkv, D, B = self.n_heads, self.n_kv, self.head_dim, tokens.shape[0]
        rope = self.rope[positions][:, None]  # [B, 1 (heads), 2, 2, D/2]
        later = torch.arange(width, device=tokens.device) > col
        bias = self.key_bias[..., :width].masked_fill(later, float("-inf"))
        x = F.embedding(tokens, self.embed)
        for w, (k_cache, v_cache) in zip(self.layers, self.cache):
            qk, v = self._qk_v(w, x)
            y = self._rope_products(qk, rope)
            q = y[:, :H, :, 0] + y[:, :H, :, 1]  # [B, H, 2, D/2], contiguous: the attention's layout below
            if isinstance(col, int):  # k's RoPE sum written straight into its cache column
                torch.add(y[:, H:, :, 0], y[:, H:, :, 1], out=k_cache[:, :, col].unflatten(-1, (2, D // 2)))
                v_cache[:, :, col] = v
            else:
                k_cache.index_copy_(2, col, (y[:, H:, :, 0] + y[:, H:, :, 1]).flatten(-2)[:, :, None])
                v_cache.index_copy_(2, col, v[:, :, None])
            # grouped-query attention, one query per row: the H/Hkv query heads of each kv head against its cache,
            # batched over rows x kv heads: [B*Hkv, H/Hkv, D] @ [B*Hkv, D, width]
            q = q.view(B * Hkv, H // Hkv, D)
            keys, values = k_cache.view(B * Hkv, -1, D)[:, :width], v_cache.view(B * Hkv, -1, D)[:, :width]
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self.scaling)
            # bf16/fp16: softmax computes in fp32 inside and rounds once (bitwise the former float()-softmax-to()
            # on a CPU); fp64 keeps transformers' fp32 softmax
            probs = scores.float().softmax(-1).to(q.dtype) if scores.dtype == torch.float64 else scores.softmax(-1)
            out = torch.bmm(probs, values).view(B, H * D)
            x = self._mlp(w, x + F.linear(out, w.o_w, w.o_b))
        return self._logits(x)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the decode rows `keep` (ascending indices into the current rows; grpo_dist.compaction): they
        move to the front of the preallocated cache, whose first len(keep) rows become the decode batch (no new
        allocation; the buffers keep their addresses, as CUDA graphs need)."""
        n, L = len(keep), self.length
        for k_buf, v_buf in self._buffers:
            k_buf[:n, :, :L] = k_buf[keep, :, :L]
            v_buf[:n, :, :L] = v_buf[keep, :, :L]
        self.cache = [(k[:n], v[:n]) for k, v in self._buffers]
        self._key_bias_rows[:n] = self._key_bias_rows[keep]
        self.key_bias = self._key_bias_rows[:n].flatten(0, 1)
        self._positions[:n] = self.next_position[keep]
        self.next_position = self._positions[:n]


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """The decode batch sizes that get CUDA graphs: the powers of two below max_rows, and max_rows (256 rows: 9
    buckets). A batch of B rows runs in the smallest bucket >= B, the rows after B padding (computed, never read):
    at most twice the rows, where a graph per size would capture up to max_rows graphs per attention width."""
    return tuple(sorted({1 << i for i in range(max(1, max_rows).bit_length()) if 1 << i < max_rows} | {max_rows}))


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows`, None when none does."""
    return next((b for b in buckets if b >= rows), None)


class StaticBuffers:
    """What a captured decode step reads and writes, allocated once for the run's largest (rows, length) on the
    model's device: per layer K and V [rows, kv_heads, length, D] (zeros: every column is finite before first use),
    the key bias, the rows' positions and tokens, the cache column, and the RoPE table of every position the run
    can reach. A rollout uses their first rows and columns; compaction moves rows inside them."""

    def __init__(self, decoder: LeanDecoder, rows: int, length: int, dtype, device):
        d = decoder
        self.rows, self.length, self.buckets = rows, length, graph_buckets(rows)
        shape = (rows, d.n_kv, length, d.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in d.layers]
        self.bias_rows = torch.zeros(rows, d.n_kv, 1, length, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        d._rope_tables(length + 1, dtype)  # a row's next position after the last step is at most `length`
        self.rope = d.rope

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv for t in kv) + \
            self.bias_rows.numel() * self.bias_rows.element_size()


class CUDAGraphSteps:
    """LeanDecoder's decode steps replayed from CUDA graphs: a decode step is ~20 small kernels per layer, and at
    small models the host cannot launch them as fast as the GPU runs them. Captured once per run: the KV cache and
    every input live in StaticBuffers, allocated at the first prefill for the run's largest (rows, length)
    (`capacity`), so a graph captured for one rollout replays in every later one, evaluation included. One graph
    per (bucket, attention width): buckets are graph_buckets(rows) (compaction moves a batch into a smaller one),
    widths are LeanDecoder.attention_width's multiples of 64, captured the first time they decode, into one memory
    pool. The graphs run the eager step's arithmetic, so lean_cuda_graphs does not change what is sampled.
    A rollout the buffers cannot hold (more rows than the largest bucket, a longer prompt + completion) decodes
    eagerly on its own caches, with one line naming why (said once per reason; `fallbacks` counts them).
    capture=False: static_step runs uncaptured on the same buffers and buckets (no CUDA needed: the CPU tests)."""

    def __init__(self, decoder: LeanDecoder, capture: bool = True, capacity: tuple[int, int] | None = None,
                 say=None):
        self.decoder, self.capture, self.capacity = decoder, capture, capacity
        self.say = say or (lambda line: print(line, flush=True))
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.views: dict[int, tuple[list, torch.Tensor]] = {}  # bucket -> its cache and key-bias views
        self.pool: Any = None
        self.pool_bytes = 0  # memory the captures reserved (the graph pool), bytes
        self.run: StaticBuffers | None = None
        self.run_active = False  # this rollout decodes on the run's buffers
        self.fallbacks: dict[str, int] = {}  # eager rollouts, by reason

    def why_eager(self, rows: int, total: int) -> str | None:
        """Why a rollout of `rows` rows and `total` prompt + completion tokens cannot use the run's buffers."""
        run = self.run
        if run is None:
            return None
        if rows > run.rows:
            return f"rows: {rows} decode rows exceed the largest CUDA-graph bucket ({run.rows})"
        if total > run.length:
            return f"length: prompt + completion of {total} tokens exceed the captured cache ({run.length})"
        return None

    def begin(self, rows: int, total: int, dtype, device) -> StaticBuffers | None:
        """Called by prefill: the run's buffers (allocated the first time), or None (one line) to decode eagerly."""
        if self.run is None:
            cap_rows, cap_len = self.capacity or (rows, total)
            self.run = StaticBuffers(self.decoder, max(cap_rows, 1), max(cap_len, 1), dtype, device)
        why = self.why_eager(rows, total)
        self.run_active = why is None
        if why is not None:
            kind = why.split(":")[0]
            if kind not in self.fallbacks:
                self.say(f"[grpo_dist] lean decoder: this rollout decodes eagerly, without CUDA graphs: "
                         f"{why.split(': ', 1)[1]} (said once; later ones are counted)")
            self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1
            return None
        self.run.tokens[rows:].zero_()
        return self.run

    def memory(self) -> dict:
        """The run's KV cache and graph pool, bytes, and the graphs captured."""
        return dict(cache_bytes=self.run.nbytes() if self.run else 0, pool_bytes=self.pool_bytes,
                    graphs=len(self.graphs), buckets=self.run.buckets if self.run else (),
                    rows=self.run.rows if self.run else 0, length=self.run.length if self.run else 0)

    def _views(self, bucket: int) -> tuple[list, torch.Tensor]:
        if bucket not in self.views:
            run = self.run
            assert run is not None
            self.views[bucket] = ([(k[:bucket], v[:bucket]) for k, v in run.kv], run.bias_rows[:bucket].flatten(0, 1))
        return self.views[bucket]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        d, run, B = self.decoder, self.run, tokens.shape[0]
        assert run is not None
        bucket = bucket_of(B, run.buckets)
        assert bucket is not None  # begin() sent larger rollouts to the eager path; compaction only shrinks
        width = d.attention_width(d.length + 1)
        run.tokens[:B].copy_(tokens)
        run.col.fill_(d.length)
        if not self.capture:
            logits = self._static(bucket, width)
        else:
            if (bucket, width) not in self.graphs:
                self.graphs[bucket, width] = self._capture(bucket, width)
            graph, logits = self.graphs[bucket, width]
            graph.replay()
        d.length += 1
        d.next_position.add_(1)
        return logits[:B].clone()  # the graph's output buffer is overwritten by the next replay

    def _static(self, bucket: int, width: int) -> torch.Tensor:
        """static_step over the bucket's rows of the run's buffers (the decoder's own views are the batch's rows)."""
        d, run = self.decoder, self.run
        assert run is not None
        cache, bias = d.cache, d.key_bias
        d.cache, d.key_bias = self._views(bucket)
        try:
            return d.static_step(run.tokens[:bucket], run.positions[:bucket], run.col, width)
        finally:
            d.cache, d.key_bias = cache, bias

    def _capture(self, bucket: int, width: int):
        """Warm-up on a side stream, then capture into the shared pool (torch's documented order); what the capture
        reserved is counted in pool_bytes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (it writes the same cache column the replay will)
            self._static(bucket, width)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph: they never run at once
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._static(bucket, width)
        self.pool_bytes += torch.cuda.memory_reserved() - reserved
        return graph, logits
