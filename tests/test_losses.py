"""Log-probs and the GRPO loss against formulas written out here (the GRPO objective of DeepSeekMath: clipped
ratio + beta * k3 KL)."""

import math

import pytest
import torch

from grpo_dist.logprobs import selective_log_probs, token_entropy
from grpo_dist.losses import LossSpec, grpo_loss, k3_kl

pytestmark = pytest.mark.fast  # the `make fast` tier


def test_selective_log_probs_equal_log_softmax_values_and_grads():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    for temp in (1.0, 0.7):
        ours = selective_log_probs(logits, labels, chunk_size=4, temperature=temp)
        ref = torch.log_softmax(logits / temp, -1).gather(-1, labels[..., None]).squeeze(-1)
        assert torch.allclose(ours, ref, atol=1e-6)
        w = torch.randn(3, 7)
        g1, = torch.autograd.grad((ours * w).sum(), logits)
        g2, = torch.autograd.grad((ref * w).sum(), logits)
        assert torch.allclose(g1, g2, atol=1e-6)


def test_selective_log_probs_bf16_logits_computed_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(4, 300).bfloat16()
    labels = torch.randint(0, 300, (4,))
    out = selective_log_probs(logits, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-6)


def test_entropy():
    logits = torch.randn(2, 3, 11)
    p = torch.softmax(logits, -1)
    assert torch.allclose(token_entropy(logits, chunk_size=2), -(p * p.log()).sum(-1), atol=1e-5)


@pytest.mark.parametrize("grad", [True, False])
def test_entropy_from_the_log_prob_pass_equals_the_sampling_distribution_entropy(grad):
    """entropy_out is the entropy of softmax(logits / temperature), what the completions were drawn from; filling
    it changes neither the log-probs nor their gradient."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40, requires_grad=grad)
    labels = torch.randint(0, 40, (3, 5))
    for temp in (1.0, 0.6):
        entropy = torch.full((3, 5), float("nan"))
        with torch.set_grad_enabled(grad):
            plain = selective_log_probs(logits, labels, chunk_size=4, temperature=temp)
            with_entropy = selective_log_probs(logits, labels, chunk_size=4, temperature=temp, entropy_out=entropy)
        p = torch.softmax(logits.detach() / temp, -1)
        assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-5)
        assert torch.equal(plain, with_entropy)
        if grad:
            w = torch.randn(3, 5)
            g1, = torch.autograd.grad((plain * w).sum(), logits)
            g2, = torch.autograd.grad((with_entropy * w).sum(), logits)
            assert torch.equal(g1, g2)


def _per_token_reference(logp, old, ref, adv, mask, beta, eps_lo, eps_hi):
    """The GRPO loss written out element by element."""
    B, T = logp.shape
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            r = math.exp(logp[i, t] - old[i, t])
            a = adv[i]
            pg = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            d = ref[i, t] - logp[i, t]
            kl = math.exp(d) - d - 1
            out[i][t] = (pg + beta * kl) * mask[i, t]
    return out


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_grpo_loss_matches_formula(loss_type):
    torch.manual_seed(1)
    B, T = 4, 6
    logp = torch.randn(B, T, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.3  # ratios both inside and outside the clip range
    ref = logp + torch.randn(B, T, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.2, -0.7, 0.0, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
                        dtype=torch.float64)
    beta, lo, hi = 0.04, 0.2, 0.28
    per_tok = _per_token_reference(logp.numpy(), old.numpy(), ref.numpy(), adv.numpy(),
                                   mask.numpy(), beta, lo, hi)
    lens = mask.sum(-1).tolist()
    norm = 7.0  # any global normaliser (other micro-batches / ranks count too)
    if loss_type == "token_mean":
        expected = sum(map(sum, per_tok)) / norm
    elif loss_type == "seq_mean_token_mean":
        expected = sum(sum(row) / lens[i] for i, row in enumerate(per_tok)) / norm
    elif loss_type == "seq_mean_token_sum":
        expected = sum(map(sum, per_tok)) / norm
    else:
        expected = sum(map(sum, per_tok)) / (norm * 10)
    spec = LossSpec(loss_type=loss_type, beta=beta, epsilon=lo, epsilon_high=hi, max_completion_length=10)
    terms = grpo_loss(logp, old, adv, mask, normaliser=norm, spec=spec, ref_logp=ref)
    assert abs(terms.loss.item() - expected) < 1e-10
    # clip fraction counts the tokens where the clipped branch won
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    clipped = ((torch.clamp(ratio, 1 - lo, 1 + hi) * a) < ratio * a).double() * mask
    assert terms.clipped_sum.item() == clipped.sum().item()


def test_padding_does_not_leak_into_loss_or_grads():
    logp = torch.zeros(1, 4, requires_grad=True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    poisoned_ref = torch.tensor([[0.0, 0.0, 50.0, -50.0]])  # garbage only where the mask is 0
    t = grpo_loss(logp, old, torch.tensor([1.0]), mask, normaliser=2.0, spec=LossSpec(beta=0.1), ref_logp=poisoned_ref)
    t.loss.backward()
    assert torch.isfinite(t.loss)
    assert logp.grad[0, 2:].abs().sum() == 0


def test_k3_is_nonnegative_and_zero_at_equality():
    x = torch.randn(100)
    y = torch.randn(100)
    assert torch.all(k3_kl(x, y) >= 0)
    assert torch.all(k3_kl(x, x) == 0)


def test_ratio_one_gradient_is_advantage_weighted():
    """num_iterations=1: old = logp.detach(), so the ratio is 1 in value but d/dlogp = A (per token / normaliser)."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    t = grpo_loss(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2), normaliser=2.0, spec=LossSpec())
    t.loss.backward()
    assert t.loss.item() == pytest.approx(-0.5)
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25]]))
