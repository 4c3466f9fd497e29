"""Options users combine: GSPO with GRPO's loss settings (warned at start), k1 as a KL loss term (refused: zero
expected gradient), and metrics that must count the same tokens as the loss: kl under kl_in_reward,
truncated_fraction, clip_fraction with dual-clip."""

import pytest
import torch

from dist_utils import run_ranks
from grpo_dist.advice import start_warnings
from grpo_dist.config import ConfigError, load_config
from grpo_dist.losses import LossSpec, grpo_loss
from helpers import EQUIV_BASE, fixed_rollout

GSPO_LINE = ("warning: importance_sampling_level=sequence (GSPO) with loss_type=token_mean, epsilon=0.2, "
             "epsilon_high=0.2: the GSPO paper uses a sequence mean and clip ranges 3e-4 / 4e-4: "
             "loss_type=seq_mean_token_mean epsilon=3e-4 epsilon_high=4e-4")


@pytest.mark.fast
def test_gspo_with_grpo_defaults_warns_once_with_the_papers_overrides():
    assert start_warnings(load_config(None, ["importance_sampling_level=sequence"])) == [GSPO_LINE]
    paper = ["importance_sampling_level=sequence", "loss_type=seq_mean_token_mean", "epsilon=3e-4",
             "epsilon_high=4e-4"]
    assert start_warnings(load_config(None, paper)) == []
    assert start_warnings(load_config(None, paper[:2])) == [
        "warning: importance_sampling_level=sequence (GSPO) with epsilon=0.2, epsilon_high=0.2: the GSPO paper uses "
        "a sequence mean and clip ranges 3e-4 / 4e-4: loss_type=seq_mean_token_mean epsilon=3e-4 epsilon_high=4e-4"]
    assert start_warnings(load_config(None, [])) == []  # token-level GRPO: nothing to say


@pytest.mark.fast
def test_k1_as_a_loss_term_is_refused_in_one_line_and_allowed_in_the_reward():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["kl_estimator=k1", "beta=0.04"])
    assert e.value.problems == [
        "command line: config key 'kl_estimator' = k1 as a loss term (beta > 0, kl_in_reward false) has zero expected "
        "gradient (E_pi[grad log pi] = 0): use kl_estimator=k3 (or k2), or kl_in_reward=true, where k1 is the usual "
        "per-sequence reward penalty"]
    load_config(None, ["kl_estimator=k1", "kl_in_reward=true"])
    load_config(None, ["kl_estimator=k1", "beta=0"])
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="zero expected gradient"):
        grpo_loss(x, x, torch.ones(1), torch.ones(1, 2), normaliser=2.0, spec=LossSpec(beta=0.1, kl_estimator="k1"),
                  ref_logp=x)
    # why: E_{y~pi}[grad (log pi(y) - log ref(y))] = sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0, exactly
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64), -1)
    logp = torch.log_softmax(logits, -1)
    expected_k1_grad, = torch.autograd.grad((logp.exp().detach() * (logp - ref)).sum(), logits)
    assert expected_k1_grad.abs().max() < 1e-15


@pytest.mark.fast
def test_clip_fraction_counts_dual_clip_activations():
    # ratios r = exp(logp - old); eps 0.2, c = 3: token-level clipping and the dual-clip bound
    r = torch.tensor([[1.5, 0.5, 5.0, 1.0], [4.0, 1.1, 0.7, 10.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    old = torch.zeros_like(r)
    terms = grpo_loss(r.log(), old, adv, mask, normaliser=7.0, spec=LossSpec(epsilon=0.2, dual_clip_c=3.0))
    # row 0 (A = 1 > 0): clipped where r > 1.2: 1.5 and 5.0 -> 2 tokens
    # row 1 (A = -2 < 0): clipped branch where r < 0.8: 0.7 -> 1; dual bound where r * |A| > c * |A|, i.e. r > 3:
    # 4.0 -> 1 (10.0 is masked out)
    assert float(terms.clipped_sum) == 2 + 1 + 1 and float(terms.dual_clipped_sum) == 1
    # the loss: -min(r A, clip(r) A) per token, the A < 0 terms capped at c |A| = 6
    per_tok = [[-1.2, -0.5, -1.2, -1.0], [6.0, 2.2, 1.6, 0.0]]
    assert abs(float(terms.loss) - sum(map(sum, per_tok)) / 7.0) < 1e-12
    no_dual = grpo_loss(r.log(), old, adv, mask, normaliser=7.0, spec=LossSpec(epsilon=0.2))
    assert float(no_dual.clipped_sum) == 3 and float(no_dual.dual_clipped_sum) == 0


# ------------------------------------------------------------------------------------ through the trainer
def _rollout():
    """helpers.fixed_rollout with row 1 made a completion of exactly max_completion_length (10) tokens that ends
    with EOS (id 1): finished, not cut off."""
    batch, rewards = fixed_rollout()
    batch.completion_ids[1] = torch.arange(10, 20)
    batch.completion_ids[1, 9] = 1
    batch.completion_mask[1] = 1
    return batch, rewards


def _perturb_reference(trainer, scale=0.05):
    """Move the reference by seeded noise so that the KL is not 0 (as in test_variants)."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from grpo_dist.engines import clean_name
    ref = trainer.ref_model
    full = FSDP.summon_full_params(ref, writeback=True) if isinstance(ref, FSDP) else contextlib.nullcontext()
    with full, torch.no_grad():
        for name, p in ref.named_parameters():
            g = torch.Generator().manual_seed(sum(map(ord, clean_name(name))))
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _masked_kl_in_reward_metrics(rank, world_size):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    batch, rewards = _rollout()
    cfg = load_config(None, EQUIV_BASE + ["kl_in_reward=true", "beta=0.5", "mask_truncated_completions=true",
                                          "prompts_per_rank=4", "micro_batch_size=64", "output_dir=/tmp/unused"])
    trainer = GRPOTrainer(cfg, init_distributed(120))
    _perturb_reference(trainer)

    def logps(model, i):
        P, n = int(batch.prompt_mask[i].sum()), int(batch.completion_mask[i].sum())
        ids = torch.cat([batch.prompt_ids[i, -P:], batch.completion_ids[i, :n]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, P - 1:P - 1 + n].double() / 0.9  # temperature 0.9
        return torch.log_softmax(logits, -1).gather(-1, ids[0, P:, None]).squeeze(-1)

    d = [logps(trainer.engine.module, i) - logps(trainer.ref_model, i) for i in range(len(batch))]
    seq_kl = torch.stack([(torch.exp(-x) + x - 1).sum() for x in d])  # k3 = exp(ref - logp) - (ref - logp) - 1
    metrics = trainer.learn(batch, rewards)
    return metrics, seq_kl


def test_kl_and_truncated_fraction_count_the_trained_tokens(tmp_path):
    metrics, seq_kl = run_ranks(_masked_kl_in_reward_metrics, 1, tmp_path)[0]
    batch, _ = _rollout()
    lens = batch.completion_lengths.double()
    has_eos = (batch.completion_ids == 1).any(-1)  # eos id 1 (char tokenizer)
    at_limit_with_eos = (has_eos & (lens >= 10)).sum()
    assert (~has_eos).sum() > 0 and at_limit_with_eos > 0  # the fixture has both kinds
    # truncated_fraction = rows without EOS / rows (not: rows of length >= max_completion_length)
    assert metrics["truncated_fraction"] == pytest.approx(float((~has_eos).sum() / len(lens)), abs=1e-9)
    # kl = sum over trained rows of seq_kl / trained tokens; the trained rows are the ones with EOS
    expected = float(seq_kl[has_eos].sum() / lens[has_eos].sum())
    all_rows = float(seq_kl.sum() / lens[has_eos].sum())  # what was logged before: every row over trained tokens
    assert abs(all_rows - expected) > 1e-3 * expected
    assert metrics["kl"] == pytest.approx(expected, rel=1e-5)
