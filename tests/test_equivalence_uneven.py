"""One optimizer step on 2 ranks equals 1 process on the same rows when the ranks are NOT alike: rank 0 holds only
flat groups (every reward equal) with short completions, rank 1 only groups whose rewards differ, with long ones;
under the dynamic-sampling split rank 0 holds no row at all. test_equivalence's fixture gives each rank the same
token and row counts, so a normaliser computed per rank instead of over the step would pass it; here the token,
row and group counts differ between ranks, the weights, loss, kl, clip_fraction and the (pre-clip) gradient norm
are compared (Adam's first step is nearly blind to a gradient's scale: the norm is not)."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import VOCAB_HI, VOCAB_LO

G = 4
VARIANTS = {
    "token_mean": ["loss_type=token_mean"],
    "seq_mean_token_mean": ["loss_type=seq_mean_token_mean"],
    "seq_mean_token_sum": ["loss_type=seq_mean_token_sum"],
    "dr_grpo": ["loss_type=dr_grpo", "scale_rewards=none"],
    "skip_zero_groups": ["skip_zero_advantage_groups=true"],  # rank 0 then trains no row
    "sampler_correction": ["sampler_correction=token", "sampler_correction_cap=1.5"],
    "gspo_paper": ["importance_sampling_level=sequence", "loss_type=seq_mean_token_mean", "epsilon=3e-4",
                   "epsilon_high=4e-4", "num_iterations=2"],
    "dynamic_sampling": ["dynamic_sampling=true"],  # the update after dynamic sampling: groups that differ only
}
FLAT, VARIED = [0], [1, 2, 3]  # groups: rank 0 takes the flat one (4 rows), rank 1 the others (12 rows)


def _rows(groups):
    return [g * G + j for g in groups for j in range(G)]


# rank 0's rows, rank 1's rows (the single process trains rank 0's then rank 1's)
SPLIT = {name: (_rows(FLAT), _rows(VARIED)) for name in VARIANTS}
SPLIT["dynamic_sampling"] = ([], _rows(VARIED))


def uneven_rollout(pad_id=0, eos_id=1):
    """4 groups of 4: group 0 flat (rewards all 1) with 1-3 token completions, groups 1 to 3 with rewards that
    differ and 6-10 token completions (one cut off at 10); sampler log-probs that differ from any policy's, for the
    sampler correction."""
    from grpo_dist.rollout import RolloutBatch
    g = torch.Generator().manual_seed(7)
    n, P, C = 4 * G, 6, 10
    prompt_ids, prompt_mask = torch.full((n, P), pad_id), torch.zeros(n, P, dtype=torch.long)
    completion_ids, completion_mask = torch.full((n, C), pad_id), torch.zeros(n, C, dtype=torch.long)
    for grp in range(4):
        plen = int(torch.randint(2, P + 1, (1,), generator=g))
        prompt = torch.randint(VOCAB_LO, VOCAB_HI, (plen,), generator=g)
        for j in range(G):
            i = grp * G + j
            prompt_ids[i, P - plen:], prompt_mask[i, P - plen:] = prompt, 1
            lo, hi = (1, 3) if grp in FLAT else (6, C)
            clen = int(torch.randint(lo, hi + 1, (1,), generator=g))
            completion_ids[i, :clen] = torch.randint(VOCAB_LO, VOCAB_HI, (clen,), generator=g)
            if not (grp == 3 and j == 0 and clen == C):
                completion_ids[i, clen - 1] = eos_id
            completion_mask[i, :clen] = 1
    rewards = torch.tensor([1., 1, 1, 1,   0, 0, 1, 0,   1, 0, 0.5, 0,   0, 1, 1, 0.25])
    sampler = -4.0 + torch.rand(n, C, generator=g)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, G,
                        sampler_logprobs=sampler), rewards


def _perturb_reference(trainer, scale=0.05):
    """Move the reference by seeded noise (the same on every rank, whatever the sharding) so that the KL term acts
    on rank 0's flat groups too (as in test_variants)."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from grpo_dist.engines import clean_name
    ref = trainer.ref_model
    full = FSDP.summon_full_params(ref, writeback=True) if isinstance(ref, FSDP) else contextlib.nullcontext()
    with full, torch.no_grad():
        for name, p in ref.named_parameters():
            gen = torch.Generator().manual_seed(sum(map(ord, clean_name(name))))
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def _steps(rank, world_size, names):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = uneven_rollout()
    results = {}
    for name in names:
        rows = SPLIT[name][rank] if world_size == 2 else SPLIT[name][0] + SPLIT[name][1]
        cfg = load_config(None, BASE + VARIANTS[name] + ["prompts_per_rank=2", "micro_batch_size=3",
                                                         "output_dir=/tmp/unused"])
        trainer = GRPOTrainer(cfg, ctx)
        _perturb_reference(trainer)
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        sd, _ = trainer.engine.gather_full_state()
        if rank == 0:
            results[name] = ({k: v.clone() for k, v in sd.items()}, metrics)
    return results


@pytest.mark.slow
def test_uneven_ranks_equal_one_process_weights_loss_and_grad_norm(tmp_path):
    names = list(VARIANTS)
    one = run_ranks(_steps, 1, tmp_path, names)[0]
    two = run_ranks(_steps, 2, tmp_path, names)[0]
    differ = []  # every mismatch, not only the first
    for name in names:
        (sd1, m1), (sd2, m2) = one[name], two[name]
        weights = max((sd1[k] - sd2[k]).abs().max().item() for k in sd1)
        if weights >= 1e-5:
            differ.append(f"{name}: weights differ by {weights:.3g}")
        for key in ("loss", "kl", "clip_fraction", "grad_norm", "policy_loss"):
            if abs(m1[key] - m2[key]) > 1e-5 * max(1.0, abs(m1[key])):
                differ.append(f"{name}: {key} {m1[key]:.6g} (1 process) != {m2[key]:.6g} (2 ranks)")
        assert m1["grad_norm"] > 1e-3, name  # something was trained
    assert not differ, "\n".join(differ)
    # the fixture is uneven where it matters: trained tokens and rows per rank differ
    batch, _ = uneven_rollout()
    lens = batch.completion_lengths
    assert int(lens[SPLIT["token_mean"][0]].sum()) < int(lens[SPLIT["token_mean"][1]].sum()) / 2
    assert one["token_mean"][1]["zero_advantage_fraction"] == 0.25
    for name in names[1:]:  # every option changes the step (else its equality above would prove nothing)
        assert abs(one[name][1]["grad_norm"] - one["token_mean"][1]["grad_norm"]) > 1e-6, name
    assert one["gspo_paper"][1]["clip_fraction"] > 0  # the paper's narrow clip range acts at iteration 2
