"""Step metrics against formulas written out from the tensors the loss saw.

With skip_zero_advantage_groups the flat groups are not trained: entropy, kl, policy_loss, clip_fraction and
ratio_mean are means over the trained tokens only. With num_iterations > 1, ratio_mean and clip_fraction are means
over every iteration's tokens (iteration 0 alone always reads 1.0 and 0.0)."""

import torch

from helpers import EQUIV_BASE as BASE
from helpers import G, fixed_rollout


def _trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + ["loss_type=token_mean", "prompts_per_rank=4", "micro_batch_size=4",
                                    "output_dir=/tmp/unused_step_metrics"] + overrides)
    return GRPOTrainer(cfg, init_distributed(60))


def _record_loss_inputs(monkeypatch):
    """Every grpo_loss call's inputs (detached), in order."""
    import grpo_dist.learner as trainer_mod
    calls, real = [], trainer_mod.grpo_loss

    def recording(logp, old, adv, mask, **kwargs):
        ref = kwargs.get("ref_logp")
        calls.append(dict(logp=logp.detach().clone(), old=old.detach().clone(), adv=adv.clone(), mask=mask.clone(),
                          ref=ref.clone() if ref is not None else None))
        return real(logp, old, adv, mask, **kwargs)
    monkeypatch.setattr(trainer_mod, "grpo_loss", recording)
    return calls


def test_skipped_flat_groups_are_left_out_of_every_token_mean(monkeypatch):
    from grpo_dist.rollout import completion_logits
    batch, rewards = fixed_rollout()
    tr = _trainer(["skip_zero_advantage_groups=true", "beta=0.04"])
    with torch.no_grad():  # the policy moves away from the reference: kl is not 0
        g = torch.Generator().manual_seed(0)
        for p in tr.engine.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    flat = [i for i in range(len(batch)) if rewards[i // G * G:(i // G + 1) * G].unique().numel() == 1]
    trained = [i for i in range(len(batch)) if i not in flat]
    assert flat and trained
    with torch.no_grad():  # entropy of the sampling distribution (logits / temperature) on trained tokens
        sub = batch.rows(trained)
        logp_all = torch.log_softmax(completion_logits(tr.engine.module, sub).float() / tr.cfg.temperature, -1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    calls = _record_loss_inputs(monkeypatch)
    m = tr.learn(batch, rewards)

    tokens = sum(float(c["mask"].sum()) for c in calls)
    assert tokens == float(batch.completion_mask[trained].sum()) < float(batch.completion_mask.sum())
    kl = pg = 0.0
    for c in calls:
        d = c["ref"] - c["logp"]
        kl += float(((d.exp() - d - 1) * c["mask"]).sum())  # k3
        pg += float((-c["adv"][:, None] * c["mask"]).sum())  # ratio 1 in a single iteration: -A per token
    assert abs(m["kl"] - kl / tokens) < 1e-7 and m["kl"] > 1e-5
    assert abs(m["policy_loss"] - pg / tokens) < 1e-7
    assert abs(m["entropy"] - float((ent * sub.completion_mask).sum()) / tokens) < 1e-5
    assert m["ratio_mean"] == 1.0 and m["clip_fraction"] == 0.0


def test_ratio_and_clip_metrics_cover_every_iteration(monkeypatch):
    tr = _trainer(["num_iterations=3", "epsilon=0.02", "learning_rate=0.05", "beta=0.0"])
    batch, rewards = fixed_rollout()
    calls = _record_loss_inputs(monkeypatch)
    m = tr.learn(batch, rewards)
    eps = tr.cfg.epsilon
    ratio_sum = clipped = tokens = 0.0
    for c in calls:  # all iterations' micro-batches
        r, a = torch.exp(c["logp"] - c["old"]), c["adv"][:, None]
        ratio_sum += float((r * c["mask"]).sum())
        clipped += float(((torch.clamp(r, 1 - eps, 1 + eps) * a < r * a) * c["mask"]).sum())
        tokens += float(c["mask"].sum())
    assert tokens == 3 * float(batch.completion_mask.sum())
    assert abs(m["ratio_mean"] - ratio_sum / tokens) < 1e-7 and m["ratio_mean"] != 1.0
    assert abs(m["clip_fraction"] - clipped / tokens) < 1e-7 and m["clip_fraction"] > 0.0
