"""GRPO variants (issue 19) against formulas written out here, element by element, on random inputs:
GSPO's sequence-level ratio, dual-clip, the entropy bonus (values and gradient), the k1/k2/k3 KL estimators,
KL in the reward, truncated-completion masking, DAPO's soft overlong punishment, dynamic sampling's split."""

import math

import pytest
import torch

from grpo_dist.logprobs import selective_log_probs_and_entropy
from grpo_dist.losses import LossSpec, grpo_loss, kl_estimate


def _inputs(seed=3):
    torch.manual_seed(seed)
    B, T = 4, 6
    logp = torch.randn(B, T, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.4  # ratios in and out of the clip range, some > 3
    old[1, :3] -= 1.5
    ref = logp + torch.randn(B, T, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.2, -0.7, 0.0, -0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
                        dtype=torch.float64)
    return logp, old, ref, adv, mask


def _kl(lp, rf, est):
    if est == "k1":
        return lp - rf
    if est == "k2":
        return 0.5 * (lp - rf) ** 2
    return math.exp(rf - lp) - (rf - lp) - 1


def _expected(logp, old, ref, adv, mask, beta, lo, hi, level="token", c=None, est="k3", ent=None, h=0.0):
    """Sum over masked tokens of the per-token loss, written out with Python floats."""
    B, T = logp.shape
    total = 0.0
    for i in range(B):
        n = sum(mask[i, t] for t in range(T))
        seq_log_ratio = sum((logp[i, t] - old[i, t]) * mask[i, t] for t in range(T)) / max(n, 1)
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp(seq_log_ratio) if level == "sequence" else math.exp(logp[i, t] - old[i, t])
            a = adv[i]
            pg = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if c is not None and a < 0:
                pg = min(pg, -c * a)
            total += pg + beta * _kl(logp[i, t], ref[i, t], est) - (h * ent[i, t] if h else 0.0)
    return total


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_formula(est):
    logp, _, ref, _, _ = _inputs()
    got = kl_estimate(logp, ref, est)
    for i in range(4):
        for t in range(6):
            assert abs(got[i, t].item() - _kl(logp[i, t].item(), ref[i, t].item(), est)) < 1e-12


@pytest.mark.parametrize("case", [dict(level="sequence"), dict(c=3.0), dict(est="k2"),
                                  dict(level="sequence", c=2.0, est="k2")])  # k1 in the loss: refused
def test_grpo_loss_variants_match_formula(case):
    logp, old, ref, adv, mask = _inputs()
    norm, beta, lo, hi = 9.0, 0.04, 0.2, 0.28
    expected = _expected(logp.numpy(), old.numpy(), ref.numpy(), adv.numpy(), mask.numpy(), beta, lo, hi,
                         **case) / norm
    spec = LossSpec(beta=beta, epsilon=lo, epsilon_high=hi, importance_sampling_level=case.get("level", "token"),
                    dual_clip_c=case.get("c"), kl_estimator=case.get("est", "k3"))
    terms = grpo_loss(logp, old, adv, mask, normaliser=norm, spec=spec, ref_logp=ref)
    assert abs(terms.loss.item() - expected) < 1e-12
    plain = grpo_loss(logp, old, adv, mask, normaliser=norm, spec=LossSpec(beta=beta, epsilon=lo, epsilon_high=hi),
                      ref_logp=ref)
    assert abs(plain.loss.item() - expected) > 1e-6, "the option must change this loss (inputs too tame?)"


def test_sequence_ratio_gradient_is_the_sequence_mean():
    """GSPO: d ratio_i / d logp_it = ratio_i / |y_i| for every token of the sequence."""
    logp, old, _, _, mask = _inputs()
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    t = grpo_loss(logp, old, adv, mask, normaliser=1.0,
                  spec=LossSpec(epsilon=10.0, importance_sampling_level="sequence"))
    t.loss.backward()
    n = mask.sum(-1, keepdim=True)
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / n).detach()
    # loss = -sum_i n_i * ratio_i (every token carries the same ratio) -> d/dlogp_it = -ratio_i on masked tokens
    assert torch.allclose(logp.grad, -seq_ratio * mask, atol=1e-12)


def test_entropy_bonus_value_and_gradient():
    torch.manual_seed(0)
    B, T, V = 3, 5, 40
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, -1.0, 0.3], dtype=torch.float64)
    temp, h, norm = 0.8, 0.01, float(mask.sum())
    logp, ent = selective_log_probs_and_entropy(logits, labels, chunk_size=4, temperature=temp)
    terms = grpo_loss(logp, logp.detach(), adv, mask, normaliser=norm, spec=LossSpec(entropy_coef=h), entropy=ent)
    # written out: log-softmax and entropy of logits / temp, the policy term at ratio 1, the bonus subtracted
    z = logits / temp
    lsm = z - torch.logsumexp(z, -1, keepdim=True)
    ref_logp = lsm.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    ref_loss = ((-torch.exp(ref_logp - ref_logp.detach()) * adv[:, None] - h * ref_ent) * mask).sum() / norm
    assert abs(terms.loss.item() - ref_loss.item()) < 1e-6
    g1, = torch.autograd.grad(terms.loss, logits)
    g2, = torch.autograd.grad(ref_loss, logits)
    assert torch.allclose(g1, g2, atol=1e-7)
    plain_logp, _ = selective_log_probs_and_entropy(logits, labels, 4, temp)
    plain = grpo_loss(plain_logp, plain_logp.detach(), adv, mask, normaliser=norm, spec=LossSpec())
    g0, = torch.autograd.grad(plain.loss, logits)
    assert (g1 - g0).abs().max() > 1e-6, "the bonus must change the gradient"


# ------------------------------------------------------------------------------------------- through the trainer
from dist_utils import run_ranks  # noqa: E402
from helpers import EQUIV_BASE as BASE  # noqa: E402
from helpers import G, PROMPTS, fixed_rollout  # noqa: E402

TRAINER_VARIANTS = {
    "plain": [],
    "mask_truncated": ["mask_truncated_completions=true"],
    "gspo": ["importance_sampling_level=sequence"],
    "dual_clip": ["dual_clip_c=1.0005", "epsilon=0.3"],
    "entropy_bonus": ["entropy_coef=0.05"],
    "kl_k1_in_reward": ["kl_estimator=k1", "kl_in_reward=true", "beta=0.5"],  # k1 as a loss term is refused
    "kl_k2": ["kl_estimator=k2"],
    "kl_in_reward": ["kl_in_reward=true", "beta=0.5"],
}


def _perturb_reference(trainer, scale=0.05):
    """The reference starts equal to the policy (KL 0); move it by seeded noise, the same on every rank and
    whatever the sharding, so that the KL options have something to act on."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from grpo_dist.engines import clean_name
    ref = trainer.ref_model
    full = FSDP.summon_full_params(ref, writeback=True) if isinstance(ref, FSDP) else contextlib.nullcontext()
    with full, torch.no_grad():
        for name, p in ref.named_parameters():
            g = torch.Generator().manual_seed(sum(map(ord, clean_name(name))))
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _trainer(world_size, overrides, micro_batch_size=64):
    from grpo_dist.config import load_config
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + overrides + [f"prompts_per_rank={PROMPTS // world_size}",
                                                f"micro_batch_size={micro_batch_size}", "output_dir=/tmp/unused"])
    from grpo_dist.distributed import init_distributed
    trainer = GRPOTrainer(cfg, init_distributed(120))
    if trainer.ref_model is not None:
        _perturb_reference(trainer)
    return trainer


def _variant_steps(rank, world_size, names, micro_batch_size):
    from grpo_dist.distributed import init_distributed
    init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    results = {}
    for name in names:
        trainer = _trainer(world_size, ["num_iterations=2"] + TRAINER_VARIANTS[name], micro_batch_size)
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        sd, _ = trainer.engine.gather_full_state()
        if rank == 0:
            results[name] = ({k: v.clone() for k, v in sd.items()}, metrics)
    return results


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_variants_two_ranks_equal_one_process(tmp_path):
    """Each option that changes the update: 2 ranks (3 rows per micro-batch) == 1 process (one micro-batch), and
    the option does change the update."""
    names = list(TRAINER_VARIANTS)
    one = run_ranks(_variant_steps, 1, tmp_path, names, 64)[0]
    two = run_ranks(_variant_steps, 2, tmp_path, names, 3)[0]
    for name in names:
        assert _max_diff(one[name][0], two[name][0]) < 1e-5, name
        for key in ("loss", "kl", "entropy", "clip_fraction"):
            assert abs(one[name][1][key] - two[name][1][key]) < 1e-5, (name, key)
        if name != "plain":
            assert _max_diff(one[name][0], one["plain"][0]) > 1e-5, f"{name} did not change the update"


def _masked_truncated_loss(rank, world_size):
    """beta 0, one iteration: every ratio is 1, so the loss is -sum_i A_i * len_i / sum_i len_i over the rows that
    take part, with A from all rows of each group."""
    from grpo_dist.advantages import group_advantages
    batch, rewards = fixed_rollout()
    trainer = _trainer(1, ["beta=0.0", "mask_truncated_completions=true"])
    metrics = trainer.learn(batch, rewards)
    adv = group_advantages(rewards, G)
    lens = batch.completion_lengths.double()
    has_eos = (batch.completion_ids == 1).any(-1)  # eos id 1 (char tokenizer); truncated rows have none
    keep = has_eos
    expected = float(-(adv.double() * lens)[keep].sum() / lens[keep].sum())
    return metrics["loss"], expected, int((~keep).sum())


def test_mask_truncated_completions_loss_matches_formula(tmp_path):
    got, expected, n_truncated = run_ranks(_masked_truncated_loss, 1, tmp_path)[0]
    assert n_truncated > 0
    assert abs(got - expected) < 1e-6


def _kl_in_reward_loss(rank, world_size, estimator):
    """kl_in_reward: A from reward_i - beta * sum_t kl(policy, ref); the loss then is -sum A_i len_i / sum len_i
    (ratio 1, no KL term), and the kl metric is the token mean of the estimator. Log-probs computed here with a
    plain forward of each model on each row."""
    from grpo_dist.advantages import group_advantages
    batch, rewards = fixed_rollout()
    beta = 0.5
    trainer = _trainer(1, ["kl_in_reward=true", f"beta={beta}", f"kl_estimator={estimator}"])

    def logps(model, i):
        P = int(batch.prompt_mask[i].sum())
        n = int(batch.completion_mask[i].sum())
        ids = torch.cat([batch.prompt_ids[i, -P:], batch.completion_ids[i, :n]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, P - 1:P - 1 + n].double() / 0.9  # temperature 0.9 (BASE)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, P:, None]).squeeze(-1)

    seq_kl, tokens = [], 0
    for i in range(len(batch)):
        lp, rf = logps(trainer.engine.module, i), logps(trainer.ref_model, i)
        seq_kl.append(sum(_kl(a, b, estimator) for a, b in zip(lp.tolist(), rf.tolist())))
        tokens += len(lp)
    seq_kl = torch.tensor(seq_kl, dtype=torch.float64)
    adv = group_advantages(rewards.double() - beta * seq_kl, G).double()
    lens = batch.completion_lengths.double()
    expected = float(-(adv * lens).sum() / lens.sum())
    metrics = trainer.learn(batch, rewards)
    return metrics["loss"], expected, metrics["kl"], float(seq_kl.sum() / tokens), metrics["reward_mean"]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_in_reward_matches_formula(tmp_path, estimator):
    loss, expected, kl, expected_kl, reward_mean = run_ranks(_kl_in_reward_loss, 1, tmp_path, estimator)[0]
    assert abs(expected_kl) > 1e-4
    assert abs(kl - expected_kl) < 1e-5
    assert abs(loss - expected) < 1e-4
    _, rewards = fixed_rollout()
    assert abs(reward_mean - float(rewards.mean())) < 1e-6  # the metric shows the verifier's rewards


# ------------------------------------------------------------------------------- DAPO soft overlong punishment
def test_soft_overlong_punishment_matches_formula():
    from grpo_dist.rewards.length import soft_overlong_punishment
    L_max, buf = 100, 20
    for L in range(0, 121):
        if L <= L_max - buf:
            expected = 0.0
        elif L <= L_max:
            expected = ((L_max - buf) - L) / buf
        else:
            expected = -1.0
        got = soft_overlong_punishment("", "", completion_length=L, max_completion_length=L_max,
                                       overlong_buffer_length=buf)
        assert abs(got - expected) < 1e-12, L
    assert soft_overlong_punishment("", "", completion_length=100, max_completion_length=100) == -1.0
    assert soft_overlong_punishment("", "", completion_length=90, max_completion_length=100) == -0.5  # buffer 20


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_computer_passes_token_lengths_to_length_aware_functions(workers):
    """The verifier stays first; the length-aware function gets the token counts (not the text length) and runs
    in this process even when the others go to workers."""
    from grpo_dist.rewards import RewardComputer
    specs = [{"function": "grpo_dist.rewards:math_reward"},
             {"function": "grpo_dist.rewards.length:soft_overlong_punishment", "weight": 0.5}]
    with RewardComputer(specs, num_workers=workers) as rc:
        totals, per_fn = rc(["\\boxed{3}", "\\boxed{4}", "x"], ["3", "3", "3"], [10, 95, 100], 100)
        assert list(per_fn) == ["math_reward", "soft_overlong_punishment"]
        assert per_fn["soft_overlong_punishment"] == [0.0, -0.75, -1.0]
        assert per_fn["math_reward"][0] == 1.0
        assert totals == [per_fn["math_reward"][i] + 0.5 * per_fn["soft_overlong_punishment"][i] for i in range(3)]
        with pytest.raises(ValueError, match="completion_length"):
            rc(["a"], ["b"])  # a length-aware reward without lengths: refused, not scored 0


# ---------------------------------------------------------------------------------------- DAPO dynamic sampling
def test_dynamic_sampling_quota():
    from grpo_dist.advantages import dynamic_sampling_quota
    assert dynamic_sampling_quota([3, 5], 4) == [2, 2]
    assert dynamic_sampling_quota([0, 5], 4) == [0, 4]
    assert dynamic_sampling_quota([1, 5, 2], 6) == [1, 3, 2]
    assert dynamic_sampling_quota([1, 1], 4) == [1, 1]  # fewer than the target: all of them
    for counts in ([4, 0, 9, 2], [7, 7, 7, 7], [0, 0, 1, 0]):
        keep = dynamic_sampling_quota(counts, 8)
        assert sum(keep) == min(8, sum(counts)) and all(0 <= k <= c for k, c in zip(keep, counts))
        short = [k for k, c in zip(keep, counts) if k < c]  # ranks that had more than they keep
        assert not short or max(keep) - min(short) <= 1  # are within one of the fullest


# per rank, per round: group rewards (G = 4); 'x' marks a flat group. Rank 0 finds its groups late, rank 1 early.
SCRIPT = {0: [[[1, 1, 1, 1], [0, 0, 0, 0]], [[0, 1, 0, 1], [1, 1, 1, 1]], [[1, 0, 0, 0], [0, 0, 1, 1]]],
          1: [[[0, 1, 1, 1], [0, 0, 0.5, 0]], [[0, 1, 0, 0], [1, 0, 1, 1]], [[0, 0, 0, 0], [0, 0, 0, 0]]]}


def _dynamic_steps(rank, world_size, max_rounds):
    """Scripted rounds instead of generation (fixed_rollout's first 2 prompts, the rewards above): which groups
    each rank keeps, how many rounds every rank ran, and the step's metrics."""
    from grpo_dist.distributed import init_distributed
    init_distributed(120)
    trainer = _trainer(world_size, ["dynamic_sampling=true", f"dynamic_sampling_max_rounds={max_rounds}",
                                    "beta=0.0"])
    batch, _ = fixed_rollout()
    rounds = iter(SCRIPT[rank])
    seen = []

    def scripted_round(step, timer, first=True):
        from grpo_dist.graded import Graded
        rewards = [float(x) for group in next(rounds) for x in group]
        seen.append(first)
        with timer("rollout"):
            pass
        b = batch.rows(list(range(2 * G)))
        return Graded(b, rewards, {"verifier": rewards})

    trainer.source._round = scripted_round
    trainer.sampler.next_batch = None  # never called: the script stands in for rollout and reward
    metrics = trainer.train_step()
    return metrics, seen


@pytest.mark.slow
def test_dynamic_sampling_two_ranks_agree_on_rounds_and_keep_the_target(tmp_path):
    # target 4 groups (2 prompts x 2 ranks): round 1 gives 0 + 2, round 2 gives 1 + 2 -> stop after 2 rounds;
    # 5 found, rank 0 keeps its 1, rank 1 keeps 3
    r0, r1 = run_ranks(_dynamic_steps, 2, tmp_path, 4)
    for metrics, seen in (r0, r1):
        assert metrics["dynamic_sampling_rounds"] == 2 and len(seen) == 2
        assert seen == [True, False]  # the generation copy is refreshed once per step
        assert metrics["dynamic_sampling_prompts"] == 8 and metrics["dynamic_sampling_groups"] == 4
        assert metrics["zero_advantage_fraction"] == 0.0
    kept = [0, 1, 0, 1, 0, 1, 1, 1, 0, 0, 0.5, 0, 0, 1, 0, 0]  # kept groups' rewards (rank 0's, then rank 1's 3)
    assert abs(r0[0]["reward_mean"] - sum(kept) / len(kept)) < 1e-6
    # with a cap of one round: 2 groups only (both on rank 1), the step trains on those
    c0, c1 = run_ranks(_dynamic_steps, 2, tmp_path, 1)
    assert c0[0]["dynamic_sampling_rounds"] == c1[0]["dynamic_sampling_rounds"] == 1
    assert c0[0]["dynamic_sampling_groups"] == 2
    assert abs(c0[0]["reward_mean"] - (3 + 0.5) / 8) < 1e-6


# ------------------------------------------------------------------------------------------------- CPU offload
def _offload_on_cpu(rank, world_size):
    from grpo_dist.config import ConfigError
    with pytest.raises(ConfigError, match="distributed.cpu_offload"):
        _trainer(world_size, ["distributed.cpu_offload=true"])
    # the FSDP wrapper itself gets CPUOffload (built directly: the trainer refuses it on CPU)
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines.fsdp import FSDPEngine
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE + ["distributed.cpu_offload=true"])
    engine = FSDPEngine(cfg, load_model(cfg.model, load_tokenizer(cfg.model)), init_distributed(120))
    return engine.module.cpu_offload.offload_params


def test_cpu_offload_refused_on_cpu_and_wired_into_fsdp(tmp_path):
    assert run_ranks(_offload_on_cpu, 1, tmp_path)[0] is True


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_deepspeed_config(stage):
    from grpo_dist.config import load_config
    from grpo_dist.engines.deepspeed import build_deepspeed_config
    cfg = load_config(None, BASE + ["distributed.backend=deepspeed", f"distributed.zero_stage={stage}",
                                    "distributed.cpu_offload=true"])
    with pytest.warns(UserWarning, match="offload"):
        zero = build_deepspeed_config(cfg, 2)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert ("offload_param" in zero) == (stage == 3)
    off = build_deepspeed_config(load_config(None, BASE + ["distributed.backend=deepspeed"]), 2)["zero_optimization"]
    assert "offload_optimizer" not in off and "offload_param" not in off


def test_concat_rollouts_keeps_every_row_and_pads_on_the_right_sides():
    from grpo_dist.rollout import concat_rollouts
    batch, _ = fixed_rollout()
    parts = [batch.rows([0, 1]), batch.rows([5]), batch.rows([9, 15])]  # trimmed to different widths
    assert len({p.prompt_ids.shape[1] for p in parts}) > 1 or len({p.completion_ids.shape[1] for p in parts}) > 1
    out = concat_rollouts(parts, pad_id=0)
    for j, i in enumerate([0, 1, 5, 9, 15]):
        P, n = int(batch.prompt_mask[i].sum()), int(batch.completion_mask[i].sum())
        assert torch.equal(out.prompt_ids[j, out.prompt_ids.shape[1] - P:], batch.prompt_ids[i, -P:])
        assert int(out.prompt_mask[j].sum()) == P and out.prompt_mask[j, -P:].all()  # left-padded
        assert torch.equal(out.completion_ids[j, :n], batch.completion_ids[i, :n])
        assert int(out.completion_mask[j].sum()) == n and out.completion_mask[j, :n].all()  # right-padded
