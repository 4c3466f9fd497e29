"""Token-budget micro-batches (max_tokens_per_micro_batch, grpo_dist/micro_batches.py): the plan's invariants
written out (every row once, budget and row cap kept, as few micro-batches as the budget allows, balanced), the
rank balance, and one step on 2 ranks with rows moved between them == 1 process on all rows."""

import itertools
import random

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import VOCAB_HI, VOCAB_LO

from grpo_dist.micro_batches import assign_to_ranks, padded_cost, plan_token_budget


def _lengths(n, seed):
    rnd = random.Random(seed)
    return {i: (rnd.randint(1, 30), min(200, int(rnd.lognormvariate(3.0, 1.0)) + 1)) for i in range(n)}


def _cost(lengths, mb, padding_free):
    ls = [lengths[r] for r in mb]
    return sum(p + c for p, c in ls) if padding_free else padded_cost(ls)


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_plan_keeps_budget_and_cap_and_holds_every_row_once(padding_free, seed):
    lengths = _lengths(40, seed)
    for budget, cap in ((240, 8), (500, 64), (1000, 4)):
        plan = plan_token_budget(lengths, budget, cap, padding_free)
        assert sorted(r for mb in plan for r in mb) == list(lengths)
        for mb in plan:
            assert len(mb) <= cap and (_cost(lengths, mb, padding_free) <= budget or len(mb) == 1)
        total = sum(p + c for p, c in lengths.values())
        assert len(plan) >= max(-(-total // budget), -(-len(lengths) // cap))  # no plan can do with fewer
        for at_least in (len(plan) + 3, 100):  # more micro-batches asked (another rank has more): smaller ones
            more = plan_token_budget(lengths, budget, cap, padding_free, at_least)
            assert len(more) == min(at_least, len(lengths)) and sorted(r for mb in more for r in mb) == list(lengths)


def test_packed_plan_is_the_fewest_micro_batches_and_balanced():
    """Small rows against the budget: LPT fills ceil(total / budget) micro-batches whose token counts differ by at
    most the longest row."""
    lengths = {i: (3, 2 + (i * 7) % 13) for i in range(60)}
    total = sum(p + c for p, c in lengths.values())
    plan = plan_token_budget(lengths, 200, 64, True)
    assert len(plan) == -(-total // 200)
    loads = [_cost(lengths, mb, True) for mb in plan]
    assert max(loads) - min(loads) <= max(p + c for p, c in lengths.values())


def test_padded_plan_is_contiguous_runs_with_the_smallest_largest_cost():
    """Padded: runs of the length order; among all contiguous cuts into that many runs, none has a smaller
    largest cost (brute force)."""
    lengths = _lengths(10, 11)
    budget, cap = 150, 64
    plan = plan_token_budget(lengths, budget, cap, False)
    order = sorted(lengths, key=lambda r: (sum(lengths[r]), r))
    assert [r for mb in plan for r in mb] == order
    k = len(plan)
    best = min(max(padded_cost([lengths[r] for r in order[a:b]]) for a, b in zip((0,) + cut, cut + (len(order),)))
               for cut in itertools.combinations(range(1, len(order)), k - 1))
    assert max(_cost(lengths, mb, False) for mb in plan) == best


def test_assign_to_ranks_balances_tokens():
    tokens = [[50, 40, 3, 2], [1, 1], [90, 5, 5, 5, 5, 5]]
    out = assign_to_ranks(tokens, 3)
    assert sorted(x for rank in out for x in rank) == sorted((r, i) for r, ts in enumerate(tokens)
                                                              for i in range(len(ts)))
    loads = [sum(tokens[r][i] for r, i in rank) for rank in out]
    assert max(loads) == 90  # the longest row alone; the rest share the other two ranks
    assert assign_to_ranks(tokens, 3) == out  # the same answer wherever it is computed


def test_budget_below_the_longest_sequence_is_refused():
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(None, BASE + ["data.max_prompt_length=8", "max_tokens_per_micro_batch=17"])
    assert load_config(None, BASE + ["data.max_prompt_length=8", "max_tokens_per_micro_batch=18"])


# ---------------------------------------------------------------------------- 2 ranks with rows moved == 1 process
G = 4


def long_short_rollout(pad_id=0, eos_id=1):
    """4 groups of 4: groups 0-1 (rank 0's) with 1-3 token completions, groups 2-3 (rank 1's) with 7-10, so that the
    rank balance moves rows; group 0 flat (skip_zero_advantage_groups then leaves rank 0 with 4 rows)."""
    from grpo_dist.rollout import RolloutBatch
    g = torch.Generator().manual_seed(17)
    n, P, C = 4 * G, 7, 10
    prompt_ids, prompt_mask = torch.full((n, P), pad_id), torch.zeros(n, P, dtype=torch.long)
    completion_ids, completion_mask = torch.full((n, C), pad_id), torch.zeros(n, C, dtype=torch.long)
    for grp in range(4):
        plen = int(torch.randint(2, P + 1, (1,), generator=g))
        prompt = torch.randint(VOCAB_LO, VOCAB_HI, (plen,), generator=g)
        for j in range(G):
            i = grp * G + j
            prompt_ids[i, P - plen:], prompt_mask[i, P - plen:] = prompt, 1
            lo, hi = (1, 3) if grp < 2 else (7, C)
            clen = int(torch.randint(lo, hi + 1, (1,), generator=g))
            completion_ids[i, :clen] = torch.randint(VOCAB_LO, VOCAB_HI, (clen,), generator=g)
            if clen < C:
                completion_ids[i, clen - 1] = eos_id
            completion_mask[i, :clen] = 1
    rewards = torch.tensor([1., 1, 1, 1,   0, 1, 0, 0.5,   1, 0, 0.5, 0,   0, 1, 1, 0.25])
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, G), rewards


VARIANTS = {
    "token_mean": ["loss_type=token_mean"],
    "seq_mean_token_mean": ["loss_type=seq_mean_token_mean"],
    "dr_grpo": ["loss_type=dr_grpo", "scale_rewards=none"],
    "gspo_two_iterations": ["importance_sampling_level=sequence", "num_iterations=2"],
    "skip_zero_groups": ["skip_zero_advantage_groups=true"],
    "padded": ["padding_free=false"],  # the padded planner (contiguous runs) with the rank balance
    "rows_alone": ["share_prompts=false"],  # packed, each row with its own prompt (rows move one by one)
}


def _computed(lengths, mb, batch, share):
    """Tokens a packed micro-batch computes: its rows' tokens, a shared prompt once (share_prompts)."""
    tokens = sum(sum(lengths[i]) for i in mb)
    if share:
        prompts = [tuple(batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()) for i in mb]
        tokens -= sum(len(p) for p in prompts) - sum(len(p) for p in set(prompts))
    return tokens
BUDGET = ["data.max_prompt_length=8", "max_tokens_per_micro_batch=24"]


def _steps(rank, world_size, budget):
    from grpo_dist import learner as trainer_mod
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = long_short_rollout()
    rows = list(range(rank * 2 * G, (rank + 1) * 2 * G)) if world_size == 2 else list(range(len(batch)))
    seen: list = []
    balance = trainer_mod.mbatch.balance_ranks

    def spy(*a, **kw):
        out = balance(*a, **kw)
        seen.append(int(out[0].completion_mask.sum() + out[0].prompt_mask.sum()))
        return out
    trainer_mod.mbatch.balance_ranks = spy
    plans: list = []
    results = {}
    for name, overrides in VARIANTS.items():
        extra = (BUDGET + ["micro_batch_size=3"]) if budget else ["micro_batch_size=64"]
        cfg = load_config(None, BASE + overrides + extra + [f"prompts_per_rank={len(rows) // G}",
                                                          "output_dir=/tmp/unused"])
        trainer = GRPOTrainer(cfg, ctx)
        def planned(b, r, plan=trainer.learner.micro_batches, pf=trainer.padding_free, share=trainer.share_prompts):
            micro = plan(b, r)
            lengths = trainer_mod.mbatch.row_lengths(b, r)
            plans.append([(len(mb), _computed(lengths, mb, b, share) if pf else
                           trainer_mod.mbatch.padded_cost([lengths[i] for i in mb])) for mb in micro])
            return micro
        trainer.learner.micro_batches = planned
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        sd, _ = trainer.engine.gather_full_state()
        results[name] = ({k: v.clone() for k, v in sd.items()} if sd is not None else None, metrics)  # rank 0
    own = int(batch.rows(rows).completion_mask.sum() + batch.rows(rows).prompt_mask.sum())
    return results, seen, plans, own


@pytest.mark.slow
def test_two_ranks_with_rows_moved_equal_one_process(tmp_path):
    one, _, _, _ = run_ranks(_steps, 1, tmp_path, False)[0]
    (two, seen0, plans0, own0), (_, seen1, plans1, own1) = run_ranks(_steps, 2, tmp_path, True)
    for name in VARIANTS:
        sd1, m1 = one[name]
        sd2, m2 = two[name]
        assert max((sd1[k] - sd2[k]).abs().max().item() for k in sd1) <= 1e-5, name
        for key in ("loss", "kl", "entropy", "clip_fraction", "trained_tokens"):
            assert abs(m1[key] - m2[key]) <= 1e-5, (name, key)
        assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5 * max(1.0, m1["grad_norm"]), name
        assert m1["tokens/useful_train"] == m2["tokens/useful_train"]  # the same tokens, wherever they train
    # the balance moved tokens from the long rank to the short one (plain variant: every row trains)
    assert own0 < own1 and abs(seen0[0] - seen1[0]) < own1 - own0
    # both ranks ran the same number of passes, each within the budget (24 tokens computed) and row cap (3)
    assert len(plans0) == len(plans1) == len(VARIANTS)
    for p0, p1 in zip(plans0, plans1):
        assert len(p0) == len(p1) and all(rows <= 3 and cost <= 24 for rows, cost in p0 + p1)
