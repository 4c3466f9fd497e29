"""The GRPO loss (PPO clipped ratio + beta * Schulman k3 KL, token-masked), its KL estimators and the sampler
correction's importance weights. The per-token log-probs they take come from logprobs.py.

Pure tensor code, no torch.distributed. The trainer passes the normaliser (token or sequence count of the whole
optimizer step, over all micro-batches and ranks) so the update does not depend on micro-batch size or world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_dist.config import K1_IN_LOSS  # the one-line refusal of k1 as a loss term
from grpo_dist.config.choices import KL_ESTIMATORS, LOSS_TYPES  # the config's choices, one source


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased, low variance."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1



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
    clipped_sum: torch.Tensor   # tokens whose policy term is clipped: the clipped branch, or the dual-clip bound
    ratio_sum: torch.Tensor
    dual_clipped_sum: torch.Tensor | None = None  # of those, the tokens held at the dual-clip bound -c * A


@dataclass(frozen=True)
class LossSpec:
    """The loss's settings, fixed for a run (the trainer builds one from its config; TRL's names). The defaults
    give plain GRPO without a KL term."""
    loss_type: str = "token_mean"
    epsilon: float = 0.2
    epsilon_high: float | None = None           # None: epsilon (symmetric clip)
    beta: float = 0.0                           # KL coefficient; 0 when the KL is not in the loss
    kl_estimator: str = "k3"
    importance_sampling_level: str = "token"
    dual_clip_c: float | None = None
    entropy_coef: float = 0.0
    max_completion_length: int | None = None    # dr_grpo's constant normaliser


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              normaliser: float, spec: LossSpec, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None, is_weights: torch.Tensor | None = None) -> LossTerms:
    """GRPO loss for one micro-batch.

    logp, old_logp, ref_logp, mask: [B, T]; advantages: [B].
    per-token: -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A) + beta * k3(logp, ref_logp),  r = exp(logp - old_logp)
    spec options (its defaults give the line above without the KL term: beta = 0):
      importance_sampling_level=sequence   r = exp(mean_t(logp - old_logp)) per sequence (GSPO)
      dual_clip_c=c (> 1)                  for A < 0 the policy term is min(that, -c * A): the ratio counts at most
                                           c times (dual-clip PPO; verl's clip_ratio_c)
      kl_estimator=k1|k2|k3                the KL term's estimator (kl_estimate)
      entropy_coef=h (with entropy [B, T]) - h * entropy is added per token (an entropy bonus), aggregated alike
    aggregation, spec.loss_type (normaliser is the count over the whole optimizer step, all micro-batches and ranks):
      token_mean            sum(per_tok * mask) / normaliser            (normaliser = number of completion tokens)
      seq_mean_token_mean   sum_seq(sum(per_tok * mask) / len_seq) / normaliser   (normaliser = number of sequences)
      seq_mean_token_sum    sum_seq(sum(per_tok * mask)) / normaliser             (normaliser = number of sequences)
      dr_grpo               sum(per_tok * mask) / (normaliser * max_completion_length)  (normaliser = sequences)
    is_weights ([B, T], no grad): importance weights of the sampler correction; they multiply the policy term
    (before the KL term is added), as in TRL's vLLM importance-sampling correction.
    """
    if spec.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {spec.loss_type!r}")
    if spec.beta != 0.0 and spec.kl_estimator == "k1":
        raise ValueError(K1_IN_LOSS)
    epsilon = spec.epsilon
    eps_high = epsilon if spec.epsilon_high is None else spec.epsilon_high
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    ratio = importance_ratio(logp, old_logp, mask, spec.importance_sampling_level)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_tok = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(per_tok, dtype=torch.bool)
    if spec.dual_clip_c is not None:  # a huge ratio on a negative advantage must not blow up the update
        dual = (adv < 0) & (per_tok > -spec.dual_clip_c * adv)
        per_tok = torch.where(dual, -spec.dual_clip_c * adv, per_tok)
    if is_weights is not None:
        per_tok = per_tok * is_weights.to(per_tok.dtype)
    pg_tok = per_tok
    kl = None
    if spec.beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_estimate(logp, ref_logp, spec.kl_estimator)
        per_tok = per_tok + spec.beta * kl
    if spec.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy (with its gradient)")
        per_tok = per_tok - spec.entropy_coef * entropy

    masked = per_tok * mask
    if spec.loss_type == "token_mean":
        loss = masked.sum() / normaliser
    elif spec.loss_type == "seq_mean_token_mean":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    elif spec.loss_type == "seq_mean_token_sum":
        loss = masked.sum() / normaliser
    else:
        if not spec.max_completion_length:
            raise ValueError("loss_type dr_grpo needs max_completion_length")
        loss = masked.sum() / (normaliser * spec.max_completion_length)

    with torch.no_grad():
        # the min picked the clipped branch, or the dual-clip bound replaced the term (the two never meet: the
        # bound acts only where the unclipped branch of a negative advantage won)
        was_clipped = ((clipped < unclipped) | dual).to(mask.dtype)
        return LossTerms(loss=loss, pg_sum=(pg_tok * mask).sum(), kl_sum=(kl * mask).sum() if kl is not None
                         else torch.zeros((), dtype=logp.dtype), clipped_sum=(was_clipped * mask).sum(),
                         ratio_sum=(ratio * mask).sum(), dual_clipped_sum=(dual.to(mask.dtype) * mask).sum())


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
