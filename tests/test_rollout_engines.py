"""Rollout engines without vLLM (tests/test_vllm.py has the vLLM ones): the truncated importance-sampling
correction against its formula, the lean / hf engines' own log-probs against the trainer's, the streamed weight
sync out of FSDP units, and the rollout_engine config key."""

import math
import subprocess
import sys

import pytest
import torch

from grpo_dist.losses import LossSpec, grpo_loss, truncated_is_weights

from dist_utils import run_ranks

TINY = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64, tie_word_embeddings: true}",
        "reward_workers=0", "progress_bar=false", "report_to=[]", "prompts_per_rank=2", "num_generations=3",
        "max_completion_length=6", "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]"]


def test_truncated_is_weights_match_the_formula_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    old, sampler = -torch.rand(4, 7, generator=g) * 3, -torch.rand(4, 7, generator=g) * 3
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    cap = 2.0
    token = truncated_is_weights(old, sampler, mask, "token", cap)
    seq = truncated_is_weights(old, sampler, mask, "sequence", cap)
    for b in range(4):
        log_seq_ratio = sum(float(old[b, t] - sampler[b, t]) for t in range(7) if mask[b, t])
        for t in range(7):
            want_tok = min(math.exp(float(old[b, t] - sampler[b, t])), cap) if mask[b, t] else 0.0
            want_seq = min(math.exp(log_seq_ratio), cap) if mask[b, t] else 0.0
            assert token[b, t].item() == pytest.approx(want_tok, rel=1e-5)
            assert seq[b, t].item() == pytest.approx(want_seq, rel=1e-5)
    assert (token <= cap).all() and (token > 0).any() and (token < cap).any()  # both branches taken
    # the weights multiply the policy term only, not the KL term: loss = sum(mask * (w * pg + beta * k3)) / N
    logp = old + 0.1 * torch.randn(4, 7, generator=g)
    ref, adv = old - 0.2, torch.randn(4, generator=g)
    spec = LossSpec(beta=0.1)
    plain = grpo_loss(logp, old, adv, mask, normaliser=10.0, spec=spec, ref_logp=ref)
    weighted = grpo_loss(logp, old, adv, mask, normaliser=10.0, spec=spec, ref_logp=ref, is_weights=token)
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert weighted.loss.item() == pytest.approx(float(((token * pg + 0.1 * k3) * mask).sum() / 10.0), rel=1e-5)
    assert weighted.loss.item() != pytest.approx(plain.loss.item(), rel=1e-3)


def _engine_logprobs(rank, world, engine_kind):
    """Rollouts of one engine vs the trainer's log-probs of the same tokens (the metric the trainer logs)."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, TINY + [f"rollout_engine={engine_kind}", "output_dir=/tmp/unused_engines",
                                    "temperature=0.7", "max_steps=1", "sampler_correction=token"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    batch = tr.rollout(tr.sampler.next_batch())
    assert batch.sampler_logprobs.shape == batch.completion_ids.shape
    assert (batch.sampler_logprobs[batch.completion_mask == 0] == 0).all()
    assert (batch.sampler_logprobs[batch.completion_mask == 1] < 0).all()
    metrics = tr.learn(batch, torch.zeros(len(batch)))
    return tr.rollout_engine.name, metrics["sampler_logprob_diff"], metrics["sampler_kl"], metrics["is_weight_mean"]


@pytest.mark.parametrize("kind", ["lean", "hf"])
def test_lean_and_hf_engines_return_the_trainers_log_probs(tmp_path, kind):
    name, diff, kl, w = run_ranks(_engine_logprobs, 1, tmp_path, kind)[0]
    assert name == kind
    # fp32, the same weights: only kernel order differs (a wrong temperature or token shift gives ~0.1-1)
    assert 0 <= diff < 1e-5 and 0 <= kl < 1e-8
    assert w == pytest.approx(1.0, abs=1e-4)


def _streamed(rank, world, wrap, mp):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines.fsdp import FSDPEngine
    from grpo_dist.trainer import GRPOTrainer
    extra = [f"distributed.fsdp_wrap={wrap}", "output_dir=/tmp/unused_stream", "beta=0"]
    extra += [f"distributed.mixed_precision={mp}"] if mp else []
    tr = GRPOTrainer(load_config(None, TINY + extra), init_distributed(60))
    assert isinstance(tr.engine, FSDPEngine)
    with torch.no_grad():  # make the policy differ from the replica's initial copy
        for p in tr.engine.module.parameters():
            p.add_(0.01)
    full, _ = tr.engine.gather_full_state()
    streamed = [(n, t.dtype, t.clone()) for n, t in tr.engine.iter_full_weights(torch.bfloat16 if mp else None)]
    tr.sync_rollout_weights()
    replica = {n: p.detach().clone() for n, p in tr.gen_model.named_parameters()}
    return full, streamed, replica, tr.gen_model.lm_head.weight is tr.gen_model.model.embed_tokens.weight


@pytest.mark.parametrize("wrap,mp", [("layer", None), ("model", "bf16")])
def test_streamed_weight_sync_out_of_fsdp_units(tmp_path, wrap, mp):
    """Every parameter comes once (the tied head under the embedding's name), with its full value, in the compute
    dtype, and the replica receives exactly those values."""
    results = run_ranks(_streamed, 2, tmp_path, wrap, mp)
    full = results[0][0]
    for _, streamed, replica, tied in results:
        names = [n for n, _, _ in streamed]
        assert len(names) == len(set(names)) and set(names) == set(replica)
        assert "lm_head.weight" not in names and tied  # tied: the replica's head is its embedding
        for n, dtype, t in streamed:
            assert dtype == (torch.bfloat16 if mp else torch.float32)
            assert torch.equal(t, full[n].to(dtype)), n
            assert torch.equal(replica[n], t.to(replica[n].dtype)), n


def test_rollout_engine_key_and_the_deprecated_lean_decoder_alias():
    from grpo_dist.config import ConfigError, load_config
    base = TINY + ["output_dir=/tmp/unused"]
    assert load_config(None, base).rollout_engine == "lean"
    with pytest.warns(FutureWarning, match="rollout_engine=hf"):
        cfg = load_config(None, base + ["lean_decoder=false"])
    assert (cfg.rollout_engine, cfg.lean_decoder) == ("hf", None)
    with pytest.raises(ConfigError, match="disagree"):
        load_config(None, base + ["lean_decoder=true", "rollout_engine=hf"])
    with pytest.raises(ConfigError, match="sampler_correction_cap"):
        load_config(None, base + ["sampler_correction_cap=0.5"])
    with pytest.raises(ConfigError, match="sampler_correction"):
        load_config(None, base + ["sampler_correction=seq"])


def test_vllm_missing_is_one_line_and_exit_2_before_any_model_loads(tmp_path):
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "rollout_engine=vllm",
                        "model.name_or_path=/nonexistent/model", f"output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "rollout_engine" in lines[0] and "pip install" in lines[0], r.stderr
