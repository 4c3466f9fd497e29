"""Per-token log-probs (memory-lean) and the GRPO loss: PPO clipped ratio + beta * Schulman k3 KL, token-masked.

Pure tensor code, no torch.distributed. The trainer passes the normaliser (token or sequence count of the whole
optimizer step, over all micro-batches and ranks) so the update does not depend on micro-batch size or world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")


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


def _scaled_chunk(logits, s, e, temperature):
    """Rows s:e of the logits in fp32, divided by the temperature (x / 1.0 would be a pass for nothing)."""
    x = logits[s:e].float()
    return x / temperature if temperature != 1.0 else x


def _chunk_log_softmax(logits, s, e, temperature):
    # the same kernel as the naive full log_softmax, row by row, so the values agree with it exactly
    return torch.log_softmax(_scaled_chunk(logits, s, e, temperature), dim=-1)


def _chunked_log_probs(logits, labels, chunk_size, temperature, entropy_out=None):
    rows = logits.shape[0]
    chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], logits.device)
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
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
        entropy = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
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
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    chunk_size = _rows_per_chunk(chunk_size, flat.shape[-1], flat.device)
    for s in range(0, flat.shape[0], chunk_size):
        lp = torch.log_softmax(flat[s:s + chunk_size].float(), dim=-1)
        out[s:s + chunk_size] = -(lp.exp() * lp).sum(-1)
    return out.view(logits.shape[:-1])


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased, low variance."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence"):
    k1 = logp - ref (unbiased, high variance, can be negative), k2 = (logp - ref)^2 / 2 (biased, low variance),
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, >= 0)."""
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token"):
    """[B, T] ratio pi / pi_old. token: exp(logp - old) per token (GRPO). sequence: GSPO's length-normalised
    sequence ratio exp(mean over the sequence's tokens of (logp - old)), the same value on every token of a row."""
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return torch.exp(seq).expand_as(logp)
    raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")


@dataclass
class LossTerms:
    loss: torch.Tensor          # scalar to backpropagate (already divided by the global normaliser)
    pg_sum: torch.Tensor        # sums over this micro-batch's masked tokens, for metrics (detached)
    kl_sum: torch.Tensor
    clipped_sum: torch.Tensor   # tokens where the clipped branch was taken
    ratio_sum: torch.Tensor


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              normaliser: float, loss_type: str = "token_mean", ref_logp: torch.Tensor | None = None,
              beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
              max_completion_length: int | None = None, importance_sampling_level: str = "token",
              dual_clip_c: float | None = None, kl_estimator: str = "k3", entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, is_weights: torch.Tensor | None = None) -> LossTerms:
    """GRPO loss for one micro-batch.

    logp, old_logp, ref_logp, mask: [B, T]; advantages: [B].
    per-token: -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A) + beta * k3(logp, ref_logp),  r = exp(logp - old_logp)
    options (defaults give the line above):
      importance_sampling_level=sequence   r = exp(mean_t(logp - old_logp)) per sequence (GSPO)
      dual_clip_c=c (> 1)                  for A < 0 the policy term is min(that, -c * A): the ratio counts at most
                                           c times (dual-clip PPO; verl's clip_ratio_c)
      kl_estimator=k1|k2|k3                the KL term's estimator (kl_estimate)
      entropy_coef=h (with entropy [B, T]) - h * entropy is added per token (an entropy bonus), aggregated alike
    aggregation (normaliser is the count over the whole optimizer step, all micro-batches and ranks):
      token_mean            sum(per_tok * mask) / normaliser            (normaliser = number of completion tokens)
      seq_mean_token_mean   sum_seq(sum(per_tok * mask) / len_seq) / normaliser   (normaliser = number of sequences)
      seq_mean_token_sum    sum_seq(sum(per_tok * mask)) / normaliser             (normaliser = number of sequences)
      dr_grpo               sum(per_tok * mask) / (normaliser * max_completion_length)  (normaliser = sequences)
    is_weights ([B, T], no grad): importance weights of the sampler correction; they multiply the policy term
    (before the KL term is added), as in TRL's vLLM importance-sampling correction.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling_level)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_tok = -torch.minimum(unclipped, clipped)
    if dual_clip_c is not None:  # a huge ratio on a negative advantage must not blow up the update
        per_tok = torch.where(adv < 0, torch.minimum(per_tok, -dual_clip_c * adv), per_tok)
    if is_weights is not None:
        per_tok = per_tok * is_weights.to(per_tok.dtype)
    pg_tok = per_tok
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        per_tok = per_tok + beta * kl
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy (with its gradient)")
        per_tok = per_tok - entropy_coef * entropy

    masked = per_tok * mask
    if loss_type == "token_mean":
        loss = masked.sum() / normaliser
    elif loss_type == "seq_mean_token_mean":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    elif loss_type == "seq_mean_token_sum":
        loss = masked.sum() / normaliser
    else:
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo needs max_completion_length")
        loss = masked.sum() / (normaliser * max_completion_length)

    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(mask.dtype)  # the min picked the clipped branch
        return LossTerms(loss=loss, pg_sum=(pg_tok * mask).sum(), kl_sum=(kl * mask).sum() if kl is not None
                         else torch.zeros((), dtype=logp.dtype), clipped_sum=(was_clipped * mask).sum(),
                         ratio_sum=(ratio * mask).sum())


@torch.no_grad()
def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                         cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights that correct for rollouts drawn by a sampler whose
    probabilities differ from the trainer's (other kernels, bf16, another engine). [B, T] -> [B, T]:
      token      w_t = min(exp(old_t - sampler_t), cap)
      sequence   w_t = min(exp(sum_s mask_s * (old_s - sampler_s)), cap)   for every token t of the row
    old_logp: the trainer's log-probs of the rollout policy; padding positions (mask 0) get weight 0."""
    mask = mask.to(old_logp.dtype)
    log_ratio = (old_logp - sampler_logp.to(old_logp.dtype)) * mask
    if mode == "token":
        w = torch.exp(log_ratio)
    elif mode == "sequence":
        w = torch.exp(log_ratio.sum(-1, keepdim=True)).expand_as(log_ratio)
    else:
        raise ValueError(f"sampler correction mode must be token or sequence, got {mode!r}")
    return w.clamp(max=cap) * mask


def uses_sequence_normaliser(loss_type: str) -> bool:
    """token_mean divides by tokens; every other loss_type divides by sequences."""
    return loss_type != "token_mean"
