"""One optimizer step on 2 ranks (each half the prompts) equals 1 process on all prompts, on the same fixed
rollouts, for every loss_type; and micro_batch_size=1 equals the whole batch at once."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import G, PROMPTS, fixed_rollout

VARIANTS = {
    "token_mean": ["loss_type=token_mean"],
    "seq_mean_token_mean": ["loss_type=seq_mean_token_mean"],
    "seq_mean_token_sum": ["loss_type=seq_mean_token_sum"],
    "dr_grpo": ["loss_type=dr_grpo", "scale_rewards=none"],
    "batch_std_two_iterations": ["scale_rewards=batch", "num_iterations=2", "epsilon=0.1"],
    "skip_zero_groups_beta0": ["skip_zero_advantage_groups=true", "beta=0.0"],
}
# Options that must not change the result (compared with the plain token_mean step), or only within bf16 noise.
EXTRA_2RANK = {
    "activation_checkpointing": (["distributed.activation_checkpointing=true"], 1e-5),
    # the tiny model is one FSDP unit under fsdp_wrap=auto; per-layer units (what big models get) must agree
    "per_layer_units": (["distributed.fsdp_wrap=layer"], 1e-5),
    "bf16_mixed_precision": (["distributed.mixed_precision=bf16"], None),  # compared by update direction
}


def _step_variants(rank, world_size, micro_batch_size, names):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    results = {}
    for name in names:
        overrides = VARIANTS[name] if name in VARIANTS else ["loss_type=token_mean"] + EXTRA_2RANK[name][0]
        cfg = load_config(None, BASE + overrides + [f"prompts_per_rank={per_rank}",
                                                          f"micro_batch_size={micro_batch_size}",
                                                          "output_dir=/tmp/unused"])
        trainer = GRPOTrainer(cfg, ctx)
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        sd, _ = trainer.engine.gather_full_state()
        if rank == 0:
            results[name] = ({k: v.clone() for k, v in sd.items()}, metrics)
    return results


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    whole = run_ranks(_step_variants, 1, tmp, 64, list(VARIANTS))[0]
    mb1 = run_ranks(_step_variants, 1, tmp, 1, ["token_mean", "seq_mean_token_mean"])[0]
    return whole, mb1


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_ranks_equal_one_process_for_every_loss_type(single_process, tmp_path):
    whole, _ = single_process
    two = run_ranks(_step_variants, 2, tmp_path, 3, list(VARIANTS) + list(EXTRA_2RANK))[0]
    for name in VARIANTS:
        single_sd, single_m = whole[name]
        dist_sd, dist_m = two[name]
        assert _max_diff(single_sd, dist_sd) < 1e-5, name
        assert abs(single_m["loss"] - dist_m["loss"]) < 1e-5, name
        assert abs(single_m["kl"] - dist_m["kl"]) < 1e-6, name
        assert single_m["zero_advantage_fraction"] == dist_m["zero_advantage_fraction"] == 0.25
    moved = _max_diff(whole["token_mean"][0], whole["dr_grpo"][0])
    assert moved > 1e-4, "different loss types should give different updates"
    assert _max_diff(whole["token_mean"][0], two["activation_checkpointing"][0]) < 1e-5
    assert _max_diff(whole["token_mean"][0], two["per_layer_units"][0]) < 1e-5
    assert abs(whole["token_mean"][1]["loss"] - two["per_layer_units"][1]["loss"]) < 1e-5
    # bf16 compute: the update points the same way as the fp32 one (cosine of the weight deltas)
    base = _initial_weights()
    d32 = torch.cat([(whole["token_mean"][0][k] - base[k]).flatten() for k in base])
    d16 = torch.cat([(two["bf16_mixed_precision"][0][k] - base[k]).flatten() for k in base])
    assert torch.nn.functional.cosine_similarity(d32, d16, dim=0) > 0.9


def _initial_weights():
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE)
    return load_model(cfg.model, load_tokenizer(cfg.model)).state_dict()


def test_micro_batch_size_one_equals_whole_batch(single_process):
    whole, mb1 = single_process
    for name in mb1:
        assert _max_diff(whole[name][0], mb1[name][0]) < 1e-5, name
