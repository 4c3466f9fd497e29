"""Per-token log-probs and entropy from logits, memory-lean: fp32 log_softmax(logits / temperature)[label]
computed chunk by chunk, never a full [rows, vocab] fp32 tensor, with hand-written backwards.

Pure tensor code, no torch.distributed. Used by the trainer's scoring and training passes; the loss formulas that
consume these log-probs are in losses.py.
"""

from __future__ import annotations

import torch

# A chunk holds at most this many logits (16 MiB in fp32) on a CPU, whatever `chunk_size` asks: at vocabulary
# 151,936 that is 27 rows, so the fp32 temporaries stay a few percent of the logits themselves. On a GPU that size
# means one small kernel launch after another (8192 completion rows = 300 chunks x ~5 kernels per pass), so CUDA
# chunks may hold 32x more (512 MiB of fp32 temporaries, 883 rows at that vocabulary).
CHUNK_ELEMENTS = 1 << 22
CUDA_CHUNK_ELEMENTS = 1 << 27


def _rows_per_chunk(chunk_size: int | None, vocab: int, device=None) -> int:
    """Rows per chunk: chunk_size (None: as many as the device's cap allows), capped at the device's logits."""
    cap = CUDA_CHUNK_ELEMENTS if torch.device(device or "cpu").type == "cuda" else CHUNK_ELEMENTS
    most = max(1, cap // max(vocab, 1))
    return most if chunk_size is None else max(1, min(chunk_size, most))


def _out_dtype(logits) -> torch.dtype:
    """fp32, or fp64 for fp64 logits (model.dtype=float64: nothing rounded to fp32 on the way)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled_chunk(logits, s, e, temperature):
    """Rows s:e of the logits in fp32 (fp64 ones stay fp64), divided by the temperature (x / 1.0 would be a pass
    for nothing)."""
    x = logits[s:e].to(_out_dtype(logits))
    return x / temperature if temperature != 1.0 else x


def _chunk_log_softmax(logits, s, e, temperature):
    # the same kernel as the naive full log_softmax, row by row, so the values agree with it exactly
    return torch.log_softmax(_scaled_chunk(logits, s, e, temperature), dim=-1)


def _chunked_log_probs(logits, labels, chunk_size, temperature, entropy_out=None):
    rows = logits.shape[0]
    chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], logits.device)
    out = torch.empty(rows, dtype=_out_dtype(logits), device=logits.device)
    for s in range(0, rows, chunk_size):
        e = s + chunk_size
        logp = _chunk_log_softmax(logits, s, e, temperature)
        out[s:e] = logp.gather(-1, labels[s:e, None]).squeeze(-1)
        if entropy_out is not None:  # from the same log-softmax: no second pass over the logits
            entropy_out[s:e] = -(logp.exp() * logp).sum(-1)
    return out


class _SelectiveLogProb(torch.autograd.Function):
    """log_softmax(logits)[label] in fp32, computed chunk by chunk.

    Never holds a [rows, vocab] fp32 tensor beyond one chunk: the forward keeps only the logits (in their own dtype),
    and the backward recomputes softmax chunk by chunk. A plain `log_softmax(logits.float())`
    keeps an fp32 log-softmax for the backward and builds two more [rows, vocab] tensors in it.
    With overwrite_logits, the backward writes the gradient into the logits' own storage (chunk by chunk, each
    chunk read before it is overwritten), so the whole computation costs no [rows, vocab] tensor at all.
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, temperature, overwrite_logits, entropy_out):
        out = _chunked_log_probs(logits, labels, chunk_size, temperature, entropy_out)
        ctx.save_for_backward(logits, labels)
        ctx.chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], logits.device)
        ctx.temperature, ctx.overwrite = temperature, overwrite_logits
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        t = ctx.temperature
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            # d logp[label] / d logits = (onehot(label) - softmax(logits / t)) * grad_out / t: softmax scaled by
            # -grad_out / t, then grad_out / t added at the label (2x faster than exp(log_softmax) and a second
            # [rows, vocab] product: bench/README.md)
            scale = grad_out[s:e, None] / t
            g = torch.softmax(_scaled_chunk(logits, s, e, t), dim=-1).mul_(-scale)
            g.scatter_add_(-1, labels[s:e, None], scale)
            grad[s:e] = g
        return grad, None, None, None, None, None


def selective_log_probs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None,
                        temperature: float = 1.0, overwrite_logits: bool = False,
                        entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V], labels [...] -> fp32 log_softmax(logits / temperature)[label] of shape [...], without a full
    fp32 log-softmax. Dividing by the sampling temperature makes these the log-probs the completions were drawn
    with. chunk_size bounds the rows processed at once (None: auto), capped at CHUNK_ELEMENTS logits on a CPU and
    CUDA_CHUNK_ELEMENTS on a GPU.

    overwrite_logits=True (memory lever for the training pass): the backward stores the gradient in the logits'
    storage, so the logits hold garbage once backward has run; read them (e.g. entropy) before. Autograd still
    raises if another node saved the same logits and needs them after. Use it only on logits that are contiguous
    (a reshape must not copy) and that nothing else reads after the backward.

    entropy_out (fp32, shape of labels): filled with the entropy of softmax(logits / temperature) per position, a
    no-grad monitoring signal taken from the same log-softmax (saves a pass over the logits)."""
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    flat_entropy = entropy_out.view(-1) if entropy_out is not None else None
    if torch.is_grad_enabled() and flat_logits.requires_grad:
        out = _SelectiveLogProb.apply(flat_logits, flat_labels, chunk_size, temperature, overwrite_logits,
                                      flat_entropy)
    else:
        out = _chunked_log_probs(flat_logits, flat_labels, chunk_size, temperature, flat_entropy)
    return out.view(shape)


class _SelectiveLogProbEntropy(torch.autograd.Function):
    """(log_softmax(z)[label], entropy(softmax(z))) with z = logits / t, both differentiable, chunk by chunk.

    For the entropy bonus (entropy_coef): dH/dz_j = -p_j * (log p_j + H), so the backward adds
    -grad_H * p * (logp + H) / t to the log-prob gradient, from the same recomputed chunk. Memory as
    _SelectiveLogProb (one fp32 chunk at a time; overwrite_logits writes the gradient into the logits)."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, temperature, overwrite_logits):
        entropy = torch.empty(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        out = _chunked_log_probs(logits, labels, chunk_size, temperature, entropy)
        ctx.save_for_backward(logits, labels, entropy)
        ctx.chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], logits.device)
        ctx.temperature, ctx.overwrite = temperature, overwrite_logits
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        logits, labels, entropy = ctx.saved_tensors
        t = ctx.temperature
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            logp = _chunk_log_softmax(logits, s, e, t)
            p = logp.exp()
            scale = grad_out[s:e, None] / t
            g = (logp + entropy[s:e, None]).mul_(p).mul_(-grad_entropy[s:e, None] / t)  # entropy part
            g.sub_(p * scale)
            g.scatter_add_(-1, labels[s:e, None], scale)
            grad[s:e] = g
        return grad, None, None, None, None


def selective_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None,
                                    temperature: float = 1.0, overwrite_logits: bool = False):
    """As selective_log_probs, plus the entropy of softmax(logits / temperature) per position, both with gradient
    (for the entropy bonus). Returns (logp, entropy), fp32, of the shape of labels."""
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    logp, entropy = _SelectiveLogProbEntropy.apply(flat_logits, flat_labels, chunk_size, temperature,
                                                   overwrite_logits)
    return logp.view(shape), entropy.view(shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution per position, fp32, chunked (a monitoring signal, no grad)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=_out_dtype(flat), device=logits.device)
    chunk_size = _rows_per_chunk(chunk_size, flat.shape[-1], flat.device)
    for s in range(0, flat.shape[0], chunk_size):
        lp = torch.log_softmax(flat[s:s + chunk_size].to(out.dtype), dim=-1)
        out[s:s + chunk_size] = -(lp.exp() * lp).sum(-1)
    return out.view(logits.shape[:-1])


# Fused LM head (issue 37): log-probs straight from the hidden states, chunk by chunk, so the [L, V] logits of a
# micro-batch never exist at once (today's logits of 8192 tokens at vocabulary 151,936 are 2.4 GB in bf16, and a
# second copy in the backward). Model families whose head is a plain Linear on the last hidden state, with nothing
# applied to the logits after it (checked in transformers' modeling code of each).
FUSED_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3")


def fused_head_reason(model) -> str | None:
    """Why head_log_probs cannot stand in for this model's LM head (None: it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FUSED_HEAD_MODELS:
        return f"model_type {kind!r} is not one of {', '.join(FUSED_HEAD_MODELS)}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the output embedding is a {type(head).__name__}, not a plain Linear (LoRA on lm_head, or wrapped)"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its logits after the head"
    return None


def _head_chunk(hidden, weight, bias, s, e, temperature, softcap):
    """(z, y): rows s:e of the head's logits in its own dtype, and y = softcap(z) / temperature in fp32 (fp64 for
    an fp64 model), as selective_log_probs would see them."""
    z = torch.nn.functional.linear(hidden[s:e], weight, bias)
    y = z.to(_out_dtype(z))
    if softcap is not None:
        y = torch.tanh(y / softcap) * softcap
    return z, (y / temperature if temperature != 1.0 else y)


class _HeadLogProb(torch.autograd.Function):
    """log_softmax(softcap(hidden @ weight.T + bias) / t)[label] (and the entropy) chunk by chunk; the backward
    recomputes each chunk's logits, so only one chunk of [rows, V] exists at a time in either direction."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, softcap, entropy):
        rows = hidden.shape[0]
        # chunk_size rows (None: 4x selective_log_probs' cap on a CPU, so each chunk's matmul reads the head's
        # weight for more than a few dozen rows)
        step = _rows_per_chunk(chunk_size, weight.shape[0] // (4 if hidden.device.type == "cpu" else 1),
                               hidden.device)
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        out = torch.empty(rows, dtype=dtype, device=hidden.device)
        ent = torch.empty(rows, dtype=dtype, device=hidden.device)
        for s in range(0, rows, step):
            logp = torch.log_softmax(_head_chunk(hidden, weight, bias, s, s + step, temperature, softcap)[1], -1)
            out[s:s + step] = logp.gather(-1, labels[s:s + step, None]).squeeze(-1)
            if entropy is not None:
                ent[s:s + step] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, ent)
        ctx.step, ctx.t, ctx.softcap, ctx.entropy = step, temperature, softcap, entropy
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, bias, labels, ent = ctx.saved_tensors
        t, cap, step = ctx.t, ctx.softcap, ctx.step
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], step):
            e = s + step
            z, y = _head_chunk(hidden, weight, bias, s, e, t, cap)
            g = grad_out[s:e, None].to(acc)
            # d logp[label] / dy = onehot(label) - p; d H / dy = -p (logp + H)
            if ctx.entropy == "grad" and grad_ent is not None:
                logp = torch.log_softmax(y, -1)
                p = logp.exp()
                dy = (logp + ent[s:e, None]).mul_(p).mul_(-grad_ent[s:e, None].to(acc))
                dy.sub_(p.mul_(g))
            else:
                dy = torch.softmax(y, -1).mul_(-g)  # in place: one [rows, V] buffer per chunk
            dy.scatter_add_(-1, labels[s:e, None], g)
            if t != 1.0:
                dy.div_(t)
            if cap is not None:  # d softcap(z) / dz = 1 - tanh(z / cap)^2
                dy.mul_(1 - torch.tanh(z.to(acc) / cap) ** 2)
            del z, y
            dz = dy.to(hidden.dtype)
            if need_h:
                torch.mm(dz, weight, out=grad_h[s:e])
            if need_w:
                if dz.dtype == acc:  # accumulate in place, no [V, H] temporary per chunk
                    grad_w.addmm_(dz.t(), hidden[s:e])
                else:
                    grad_w += (dz.t() @ hidden[s:e]).to(acc)
            if need_b:
                grad_b += dy.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   temperature: float = 1.0, chunk_size: int | None = None, softcap: float | None = None,
                   entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [L, H] (the last hidden states of the positions that predict `labels` [L]), the LM head's weight
    [V, H] and bias -> (log_softmax(softcap(hidden @ weight.T + bias) / temperature)[label] [L] in fp32 (fp64 for
    fp64), entropy [L] or None). entropy: None, "metric" (no gradient) or "grad" (differentiable). The logits are
    made in the head's dtype as the model's own head would, then scored in fp32, chunk_size rows at a time (as
    selective_log_probs); no [L, V] tensor exists at once, in the forward or the backward."""
    logp, ent = _HeadLogProb.apply(hidden, weight, bias, labels.long(), temperature, chunk_size, softcap, entropy)
    return logp, (ent if entropy is not None else None)
