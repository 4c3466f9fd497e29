"""The fused LM head (logprobs.head_log_probs, packing.packed_log_probs): log-probs and entropies straight from the
hidden states, chunk by chunk, against a plain log_softmax of the full logits written out here; gradients of the
hidden states, the head's weight and bias equal; no [L, V] tensor saved for the backward of a packed pass."""

import pytest
import torch

from helpers import EQUIV_BASE as BASE
from helpers import fixed_rollout


def _plain(h, w, b, labels, t, cap):
    """log_softmax(softcap(h W^T + b) / t)[label] and the entropy, all at once (the definition)."""
    z = torch.nn.functional.linear(h, w, b)
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    logp = torch.log_softmax(z / t, -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cap,entropy", [(None, None), (None, "metric"), (None, "grad"), (3.0, "grad")])
def test_head_log_probs_equal_a_plain_log_softmax(dtype, cap, entropy):
    from grpo_dist.logprobs import head_log_probs
    g = torch.Generator().manual_seed(0)
    L, H, V, t = 13, 8, 50, 0.7
    h, w, b = (torch.randn(*s, generator=g, dtype=dtype, requires_grad=True) for s in ((L, H), (V, H), (V,)))
    labels = torch.randint(0, V, (L,), generator=g)
    a, c = torch.randn(L, generator=g, dtype=dtype), torch.randn(L, generator=g, dtype=dtype)
    logp, ent = head_log_probs(h, w, b, labels, t, chunk_size=4, softcap=cap, entropy=entropy)
    want_lp, want_ent = _plain(h, w, b, labels, t, cap)
    assert logp.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp, want_lp, **tol)
    if entropy is None:
        assert ent is None
    else:
        torch.testing.assert_close(ent, want_ent, **tol)
    loss = (a * logp).sum() + ((c * ent).sum() if entropy == "grad" else 0.0)
    want = (a * want_lp).sum() + ((c * want_ent).sum() if entropy == "grad" else 0.0)
    got, ref = torch.autograd.grad(loss, (h, w, b)), torch.autograd.grad(want, (h, w, b))
    for x, y in zip(got, ref):  # 1e-5 relative to the largest gradient entry
        assert (x - y).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-5) * y.abs().max()


@pytest.mark.fast
def test_metric_entropy_carries_no_gradient():
    from grpo_dist.logprobs import head_log_probs
    h, w = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    _, ent = head_log_probs(h, w, None, torch.arange(5), entropy="metric")
    assert not ent.requires_grad


def _tiny(tie=False):
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE)
    model = load_model(cfg.model, load_tokenizer(cfg.model)).double().train()
    if tie:  # as SmolLM2: the head's weight is the input embedding's
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("tie,share,lora", [(False, False, False), (True, True, False), (False, True, True)])
def test_packed_pass_through_the_fused_head_equals_the_logits_path(tie, share, lora):
    """A packed training pass (float64) through the fused head: log-probs, entropies and every parameter's gradient
    those of today's path (full logits, then selective_log_probs), tied head or not, shared prompts or not; and
    no tensor of [L, V] logits is saved for its backward (the old path saves the logits)."""
    from grpo_dist.logprobs import selective_log_probs_and_entropy
    from grpo_dist.packing import pack_rows, packed_log_probs, packed_logits
    model = _tiny(tie)
    if lora:
        from grpo_dist.config import LoraConfig
        from grpo_dist.lora import apply_lora
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        assert not model.lm_head.weight.requires_grad
    batch, _ = fixed_rollout()
    packed = pack_rows(batch.rows(list(range(len(batch)))), share)
    L, V = len(packed.labels), model.config.vocab_size
    weights = torch.randn(L, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        logp, ent = packed_log_probs(model, packed, 0.9, None, "grad")
    assert (L, V) not in saved
    loss = (weights * logp + 0.1 * ent).sum()
    got = torch.autograd.grad(loss, params)
    ref_lp, ref_ent = selective_log_probs_and_entropy(packed_logits(model, packed), packed.labels, temperature=0.9)
    want = torch.autograd.grad((weights * ref_lp + 0.1 * ref_ent).sum(), params)
    torch.testing.assert_close(logp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= 1e-10 * max(y.abs().max(), 1e-3)


@pytest.mark.fast
def test_fused_head_falls_back_for_a_head_that_is_not_a_plain_linear():
    from grpo_dist.logprobs import fused_head_reason

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"model_type": "llama"})()
            self.head = torch.nn.Sequential(torch.nn.Linear(2, 3))

        def get_output_embeddings(self):
            return self.head
    assert "not a plain Linear" in fused_head_reason(Wrapped())
    Wrapped.config = None
    m = Wrapped()
    m.config = type("C", (), {"model_type": "gemma2"})()
    assert "model_type 'gemma2'" in fused_head_reason(m)
