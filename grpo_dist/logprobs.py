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
