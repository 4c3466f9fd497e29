"""Difficulty-aware prompt sampling (config section `curriculum`; grpo_dist/curriculum.py, docs/curriculum.md).

The pacing schedule and the online weights are checked against the formulas written out here; the order must be a
function of (seed, statistics) only, the same split over 2 ranks as in 1 process, and a resumed run must continue
the statistics, the order and the weights bit for bit.
"""

import json
import math

import numpy as np
import pytest

from helpers import in_process

from grpo_dist.config import ConfigError, CurriculumConfig, load_config
from grpo_dist.curriculum import Curriculum, difficulties
from grpo_dist.data.examples import PromptExample
from grpo_dist.data.sampler import PromptSampler


def examples(n, levels=None):
    return [PromptExample(f"{i}+{i}=", str(2 * i), i, columns={} if levels is None else {"level": levels[i]})
            for i in range(n)]


@pytest.mark.fast
@pytest.mark.parametrize("overrides, key", [
    (["curriculum.mode=sometimes"], "curriculum.mode"),
    (["curriculum.start_fraction=0"], "curriculum.start_fraction"),
    (["curriculum.start_fraction=1.5"], "curriculum.start_fraction"),
    (["curriculum.pacing_steps=0"], "curriculum.pacing_steps"),
    (["curriculum.window=0"], "curriculum.window"),
    (["curriculum.retire_weight=0"], "curriculum.retire_weight"),  # no floor: a retired prompt would starve
    (["curriculum.retire_weight=2"], "curriculum.retire_weight"),
])
def test_settings_that_cannot_apply_are_refused_with_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert len(e.value.problems) == 1 and f"'{key}'" in e.value.problems[0], e.value.problems


@pytest.mark.fast
def test_difficulty_column_numbers_and_level_strings_and_refusal():
    assert difficulties(examples(3, ["Level 3", 1, "2.5"]), "level").tolist() == [3.0, 1.0, 2.5]
    with pytest.raises(ConfigError, match=r"^config key 'curriculum.difficulty_field' = 'level': training row 1 "
                                          r"has 'hard', not a number"):
        difficulties(examples(3, [1, "hard", 2]), "level")
    with pytest.raises(ConfigError, match="training row 0 has no such column"):
        difficulties(examples(2), "level")


@pytest.mark.fast
def test_static_pacing_opens_the_easiest_prompts_by_the_schedule():
    """pool(b) = max(global_batch, ceil((s + (1 - s) * min(1, b / P)) * N)), drawn from the easiest first."""
    n, gb, s, p = 20, 4, 0.25, 4
    levels = [(7 * i) % 5 + 1 for i in range(n)]  # 5 levels, interleaved in the file
    cfg = CurriculumConfig(mode="static", start_fraction=s, pacing_steps=p)
    cur = Curriculum(cfg, examples(n, levels), gb, seed=3)
    by_level = np.argsort(levels, kind="stable")
    assert [levels[i] for i in cur.order] == sorted(levels)
    for b in range(8):
        want = max(gb, math.ceil((s + (1 - s) * min(1, b / p)) * n))
        assert cur.pool_size(b) == want and cur.metrics(b) == {"curriculum/pool_fraction": want / n}
        got = cur.global_indices(b)
        assert len(set(got.tolist())) == gb
        # every prompt drawn is no harder than the pool's hardest level
        assert max(levels[i] for i in got) <= levels[by_level[want - 1]]
    assert [cur.pool_size(b) for b in range(5)] == [5, 9, 13, 17, 20]
    # the order is a function of the seed alone: a second object agrees, another seed differs
    again = Curriculum(cfg, examples(n, levels), gb, seed=3)
    other = Curriculum(cfg, examples(n, levels), gb, seed=4)
    assert all((again.global_indices(b) == cur.global_indices(b)).all() for b in range(8))
    assert any((other.global_indices(b) != cur.global_indices(b)).any() for b in range(8))


@pytest.mark.fast
def test_online_statistics_retire_flat_prompts_and_weights_follow_them():
    """flat = 0 or all G correct; window flat visits in a row retire a prompt (weight retire_weight), a mixed group
    brings it back; the running pass rate is correct / drawn completions."""
    cfg = CurriculumConfig(mode="online", window=2, retire_weight=0.25)
    cur = Curriculum(cfg, examples(6), 3, seed=0)
    cur.update([0, 1, 2], [4, 0, 2], [4, 4, 4])      # 0 all correct, 1 none, 2 mixed
    assert cur.retired().tolist() == [False] * 6      # one flat visit is not yet `window`
    cur.update([0, 1, 3], [4, 0, 4], [4, 4, 4])
    assert cur.retired().tolist() == [True, True, False, False, False, False]
    assert cur.weights().tolist() == [0.25, 0.25, 1, 1, 1, 1]
    cur.update([0, 4, 5], [3, 1, 0], [4, 4, 4])       # prompt 0 mixed again: back to weight 1
    assert cur.retired().tolist() == [False, True, False, False, False, False]
    rate = cur.pass_rate()
    assert rate[0] == (4 + 4 + 3) / 12 and rate[1] == 0 and rate[2] == 2 / 4 and rate[5] == 0
    assert cur.visits.tolist() == [3, 2, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        cur.update([0, 0], [1, 1], [4, 4])  # a global batch never repeats a prompt


@pytest.mark.fast
def test_online_draw_probability_is_weight_over_total():
    """With a global batch of 1 the weighted draw picks prompt i with probability w_i / sum(w): retired prompts
    (w = 0.2) are drawn 5x less often, never 0 (the floor)."""
    cfg = CurriculumConfig(mode="online", window=1, retire_weight=0.2)
    cur = Curriculum(cfg, examples(4), 1, seed=11)
    for i in (0, 1):
        cur.update([i], [0], [4])
    w = np.array([0.2, 0.2, 1.0, 1.0])
    draws = 20000
    counts = np.bincount([int(cur.global_indices(b)[0]) for b in range(draws)], minlength=4)
    p = w / w.sum()
    sigma = np.sqrt(draws * p * (1 - p))
    assert (np.abs(counts - draws * p) < 4 * sigma).all(), (counts, draws * p)


@pytest.mark.fast
def test_two_ranks_take_disjoint_slices_of_the_one_process_global_batch():
    cfg = CurriculumConfig(mode="online", window=1, retire_weight=0.1)
    one = PromptSampler(examples(12), 4, 0, 1, 5, Curriculum(cfg, examples(12), 4, 5))
    ranks = [PromptSampler(examples(12), 2, r, 2, 5, Curriculum(cfg, examples(12), 4, 5)) for r in range(2)]
    for step in range(5):
        whole = [e.index for e in one.next_batch()]
        halves = [[e.index for e in s.next_batch()] for s in ranks]
        assert halves[0] + halves[1] == whole
        for c in [one.curriculum] + [s.curriculum for s in ranks]:  # the same all-reduced statistics everywhere
            c.update(whole, [0, 1, 2, 0] if step % 2 else [2, 2, 2, 2], [2] * 4)
    assert one.curriculum.retired().any()


# ------------------------------------------------------------------------------------------- in the trainer

BASE = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}",
        "data.limit=8", "num_generations=4", "max_completion_length=6", "temperature=1.0",
        "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0", "learning_rate=1e-3",
        "beta=0.0", "micro_batch_size=8", "save_format=full", "progress_bar=false", "report_to=[jsonl]",
        "distributed.timeout_s=60", "curriculum.mode=online", "curriculum.window=1", "curriculum.retire_weight=0.1"]


def _trainer(overrides):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def test_a_missing_difficulty_column_is_refused_before_the_model_loads(tmp_path, capsys):
    with pytest.raises(ConfigError, match="config key 'curriculum.difficulty_field' = 'level': training row 0 has "
                                          "no such column"):
        in_process(lambda: _trainer([f"output_dir={tmp_path}", "curriculum.mode=static", "prompts_per_rank=2"]))
    assert "loading model" not in capsys.readouterr().out


def test_resume_with_curriculum_from_a_checkpoint_without_statistics_is_refused_before_the_model_loads(
        tmp_path, capsys):
    """A checkpoint written with curriculum.mode=none, resumed with mode online: refused with one line naming the
    key and the checkpoint, from its trainer_state.json, before the model (or the reward functions) load."""
    ck = tmp_path / "a" / "checkpoint-1"
    in_process(lambda: _trainer([f"output_dir={tmp_path / 'a'}", "curriculum.mode=none", "prompts_per_rank=2",
                                  "max_steps=1", "save_steps=1"]).train())
    assert "curriculum" not in json.loads((ck / "trainer_state.json").read_text())
    capsys.readouterr()
    with pytest.raises(ConfigError) as e:
        in_process(lambda: _trainer([f"output_dir={tmp_path / 'b'}", "prompts_per_rank=2",
                                      f"resume_from_checkpoint={ck}"]))
    assert str(e.value) == (f"config key 'curriculum.mode' = online: checkpoint {ck} has no curriculum statistics "
                            f"(written with curriculum.mode=none); resume with curriculum.mode=none or start a "
                            f"fresh run")
    assert "loading model" not in capsys.readouterr().out


def test_resume_continues_statistics_order_and_weights_exactly(tmp_path, one_thread):
    """6 steps straight vs 3 steps, a checkpoint, 3 more: the same statistics, prompts and weights bit for bit.
    8 prompts, 2 per step, window 1: prompts are revisited and retired within the run, so the later order depends
    on the checkpointed statistics."""
    from safetensors.torch import load_file
    run = ["max_steps=6", "save_steps=3", "prompts_per_rank=2"]

    def go():
        assert _trainer(run + [f"output_dir={tmp_path / 'a'}"]).train() == 0
        resumed = _trainer(run + [f"output_dir={tmp_path / 'b'}",
                                  f"resume_from_checkpoint={tmp_path / 'a' / 'checkpoint-3'}"])
        assert resumed.curriculum.visits.sum() == 3 * 2  # restored, not restarted
        assert resumed.train() == 0
    in_process(go)
    mid = json.loads((tmp_path / "a" / "checkpoint-3" / "trainer_state.json").read_text())["curriculum"]
    assert sum(mid["visits"]) == 6 and max(mid["flat_streak"]) >= 1  # something was retired by step 3
    end_a = json.loads((tmp_path / "a" / "checkpoint-6" / "trainer_state.json").read_text())["curriculum"]
    end_b = json.loads((tmp_path / "b" / "checkpoint-6" / "trainer_state.json").read_text())["curriculum"]
    assert end_a == end_b and sum(end_a["visits"]) == 12
    a = load_file(str(tmp_path / "a" / "checkpoint-6" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint-6" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "reward_mean", "curriculum/retired_fraction", "curriculum/seen_fraction")
    assert [[r[k] for k in keys] for r in rows_b] == [[r[k] for k in keys] for r in rows_a[3:]]


def _online_on_ranks(rank, world, tmp_path):
    tr = _trainer([f"output_dir={tmp_path / f'w{world}'}", f"prompts_per_rank={4 // world}", "max_steps=3",
                   "save_final=false"])
    order = []
    for _ in range(3):
        tr.train_step()
        order.append(list(tr.sampler.last_global_indices))
    tr.close()
    return tr.curriculum.state_dict(), order


@pytest.mark.slow  # 2 spawned gloo ranks, then 1: ~30 s
def test_two_ranks_keep_the_same_statistics_as_one_process(tmp_path):
    """The per-prompt counts are all-reduced: every rank holds the statistics of the whole global batch, equal to
    the one-process run's (per_prompt sampling noise gives the same completions whatever the split)."""
    from dist_utils import run_ranks
    two = run_ranks(_online_on_ranks, 2, tmp_path, tmp_path)
    one = run_ranks(_online_on_ranks, 1, tmp_path, tmp_path)[0]
    assert two[0] == two[1] == one
    assert sum(one[0]["visits"]) == 12 and max(one[0]["flat_streak"]) >= 1


# ------------------------------------------------------------------------------------ group size by difficulty

@pytest.mark.fast
@pytest.mark.parametrize("overrides, key", [
    (["curriculum.num_generations_min=2"], "curriculum.num_generations_min"),          # alone
    (["curriculum.num_generations_max=8"], "curriculum.num_generations_max"),
    (["curriculum.mode=online", "num_generations=4", "curriculum.num_generations_min=5",
      "curriculum.num_generations_max=8"], "curriculum.num_generations_min"),          # the average out of range
    (["curriculum.mode=online", "curriculum.num_generations_min=1", "curriculum.num_generations_max=8"],
     "curriculum.num_generations_min"),                                                # a group of 1 has no std
    (["curriculum.num_generations_min=2", "curriculum.num_generations_max=16"], "curriculum.num_generations_min"),
    (["curriculum.mode=online", "curriculum.num_generations_min=2", "curriculum.num_generations_max=16",
      "dynamic_sampling=true"], "curriculum.num_generations_min"),
    (["curriculum.mode=online", "curriculum.num_generations_min=2", "curriculum.num_generations_max=16",
      "rollout_engine=vllm"], "curriculum.num_generations_min"),
])
def test_group_size_settings_that_cannot_apply_are_refused_with_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    mine = [p for p in e.value.problems if "curriculum." in p]  # (vLLM missing here is a line of its own)
    assert len(mine) == 1 and f"'{key}'" in mine[0], e.value.problems


@pytest.mark.fast
def test_advantages_of_groups_of_different_sizes_written_out():
    import torch

    from grpo_dist.advantages import ADV_EPS, group_advantages, zero_advantage_groups
    r = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 1.0]
    sizes = [2, 3, 5]
    groups = [r[0:2], r[2:5], r[5:10]]

    def mean(x):
        return sum(x) / len(x)

    def std(x):  # unbiased, n - 1
        return math.sqrt(sum((v - mean(x)) ** 2 for v in x) / (len(x) - 1))
    want = {"group": [(v - mean(g)) / (std(g) + ADV_EPS) for g in groups for v in g],
            "none": [v - mean(g) for g in groups for v in g],
            "batch": [(v - mean(g)) / (std(r) + ADV_EPS) for g in groups for v in g]}
    for scale, w in want.items():
        got = group_advantages(torch.tensor(r), sizes, scale)
        assert got.tolist() == pytest.approx(w, abs=1e-6), scale
    assert zero_advantage_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), [2, 2, 3]).tolist() == \
        [True, False, True]
    # equal sizes give exactly the fixed-size path's numbers
    x = torch.rand(12)
    assert torch.equal(group_advantages(x, [4, 4, 4]), group_advantages(x, 4))


@pytest.mark.fast
def test_group_sizes_minimise_the_expected_flat_groups_within_the_budget():
    """allocate_group_sizes against brute force: among all sizes in [lo, hi] summing to the budget, its choice
    minimises sum_i p_i^g_i + (1 - p_i)^g_i, p_i = (correct + 1) / (completions + 2)."""
    import itertools

    from grpo_dist.curriculum import allocate_group_sizes
    correct, completions = np.array([0, 8, 4, 15, 0]), np.array([0, 8, 8, 16, 16])
    lo, hi, budget = 2, 8, 5 * 4
    p = (correct + 1) / (completions + 2)
    sizes = allocate_group_sizes(correct, completions, budget, lo, hi)
    assert sum(sizes) == budget and all(lo <= g <= hi for g in sizes)

    def flat(gs):
        return sum(q ** g + (1 - q) ** g for q, g in zip(p, gs))
    best = min(flat(gs) for gs in itertools.product(range(lo, hi + 1), repeat=5) if sum(gs) == budget)
    assert flat(sizes) == pytest.approx(best, rel=1e-12)
    # p = 0.9 and 0.89 get more than p = 1/2 (already seldom flat); p = 1/18 stays at lo: flat whatever one adds
    assert sizes == [4, 5, 4, 5, 2]
    assert allocate_group_sizes(np.zeros(3), np.zeros(3), 12, 2, 8) == [4, 4, 4]  # unseen: even split
    with pytest.raises(ValueError):
        allocate_group_sizes(np.zeros(3), np.zeros(3), 30, 2, 8)


def _sized_on_ranks(rank, world, tmp_path):
    tr = _trainer([f"output_dir={tmp_path / f's{world}'}", f"prompts_per_rank={4 // world}", "max_steps=4",
                   "save_final=false", "curriculum.num_generations_min=2", "curriculum.num_generations_max=7",
                   "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]"])  # groups seldom flat
    from grpo_dist.advantages import ADV_EPS
    # earlier statistics, the same on every rank: pass rates from ~0.05 to ~0.9, so the sizes differ from step 1
    tr.curriculum.correct[:] = [18, 1, 10, 2, 17, 10, 0, 9]
    tr.curriculum.completions[:] = 20
    graded = []
    tr.on_graded = lambda batch, rewards: graded.append(list(rewards))
    out = []
    for _ in range(4):
        m = tr.train_step()
        out.append((list(tr.last_step.graded.global_group_sizes), {k: m[k] for k in ("loss", "reward_mean", "accuracy",
                                                                      "zero_advantage_fraction", "grad_norm")}))
        # this rank's advantages, group by group of its own size: (r - mean) / (unbiased std + eps)
        want, at = [], 0
        for g in tr.last_step.group_sizes:
            grp = graded[-1][at:at + g]
            mu = sum(grp) / g
            sd = math.sqrt(sum((v - mu) ** 2 for v in grp) / (g - 1))
            want += [(v - mu) / (sd + ADV_EPS) for v in grp]
            at += g
        assert at == len(graded[-1]) and tr.last_step.advantages.tolist() == pytest.approx(want, abs=1e-5)
    sd, _ = tr.engine.gather_full_state()
    tr.close()
    return ({k: v.clone() for k, v in sd.items()} if rank == 0 else None), out, tr.curriculum.state_dict()


@pytest.mark.slow  # 2 spawned gloo ranks, then 1: ~30 s
def test_group_size_by_difficulty_two_ranks_take_the_same_steps_as_one_process(tmp_path):
    """Groups of 2..7 completions, 4 on average: the ranks hold different numbers of rows, the same sizes, metrics
    and weights as one process (whose rows are all of them)."""
    import torch
    from dist_utils import run_ranks
    two = run_ranks(_sized_on_ranks, 2, tmp_path, tmp_path)
    one = run_ranks(_sized_on_ranks, 1, tmp_path, tmp_path)[0]
    assert [s for s, _ in two[0][1]] == [s for s, _ in one[1]] == [s for s, _ in two[1][1]]
    assert any(len(set(s)) > 1 for s, _ in one[1]) and all(sum(s) == 16 for s, _ in one[1])
    for (_, m2), (_, m1) in zip(two[0][1], one[1]):
        assert m2 == pytest.approx(m1, rel=1e-5, abs=1e-6)
    assert two[0][2] == one[2]
    assert max((two[0][0][k] - one[0][k]).abs().max().item() for k in one[0]) < 1e-5
    assert not all(torch.equal(one[0][k], one[0][k] * 0) for k in one[0])


@pytest.mark.fast
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("level", ["token", "sequence"])  # sequence: GSPO's sequence-level ratio
@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_every_loss_type_with_groups_of_different_sizes_written_out(loss_type, level, scale):
    """Groups of 2, 5 and 3 completions (the first flat): the trainer's own advantage, row-selection and normaliser
    stages (no process group: one rank) and grpo_loss over two uneven micro-batches, against the formulas written
    out: advantages from each group's own rows, the normaliser counting the trained rows' tokens (token_mean) or
    rows (the others), flat groups out of both with skip_zero_advantage_groups."""
    import dataclasses

    import torch

    from grpo_dist.advantages import ADV_EPS
    from grpo_dist.losses import LOSS_TYPES, grpo_loss
    from grpo_dist.rollout import RolloutBatch
    from grpo_dist import learner
    assert loss_type in LOSS_TYPES and len(LOSS_TYPES) == 4  # every loss_type the trainer supports is here
    sizes, L, beta, eps = [2, 5, 3], 6, 0.04, 0.2
    r = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    lengths = [3, 6, 1, 4, 6, 2, 5, 3, 6, 2]
    g = torch.Generator().manual_seed(0)
    n = len(r)
    mask = torch.tensor([[1.0 if t < lengths[i] else 0.0 for t in range(L)] for i in range(n)])
    logp = -torch.rand(n, L, generator=g) * 3
    old = logp + 0.3 * torch.randn(n, L, generator=g)  # ratios on both sides of the clip range
    ref = logp + 0.2 * torch.randn(n, L, generator=g)
    batch = RolloutBatch(torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2), torch.zeros(n, L, dtype=torch.long),
                         mask, num_generations=4)
    groups, at = [], 0
    for s in sizes:
        groups.append(list(range(at, at + s)))
        at += s

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # unbiased, as GRPO and TRL
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    for skip in (False, True):
        cfg = load_config(None, BASE + [f"loss_type={loss_type}", f"importance_sampling_level={level}",
                                        f"scale_rewards={scale}", f"skip_zero_advantage_groups={skip}",
                                        f"max_completion_length={L}", "output_dir=/tmp/unused"])
        adv, flat = learner.advantages(cfg, torch.tensor(r), sizes, torch.device("cpu"))
        want_adv = []
        for rows_g in groups:
            grp = [r[i] for i in rows_g]
            for i in rows_g:
                want_adv.append({"group": (r[i] - mean(grp)) / (std(grp) + ADV_EPS),
                                 "batch": (r[i] - mean(grp)) / (std(r) + ADV_EPS),
                                 "none": r[i] - mean(grp)}[scale])
        assert adv.tolist() == pytest.approx(want_adv, abs=1e-6) and flat.tolist() == [True, False, False]
        rows = learner.select_rows(cfg, batch, flat, sizes, eos_ids=[])
        want_rows = groups[1] + groups[2] if skip else list(range(n))
        assert rows == want_rows
        normaliser = learner.step_normaliser(cfg, batch, rows, torch.device("cpu"))
        want_norm = sum(lengths[i] for i in want_rows) if loss_type == "token_mean" else len(want_rows)
        assert normaliser == want_norm
        spec = learner.loss_spec(cfg, kl_in_loss=True)
        spec = dataclasses.replace(spec, beta=beta)  # the KL term in the loss too
        got = 0.0
        for mb in (rows[:3], rows[3:]):  # uneven micro-batches: the global normaliser makes them add up
            got += float(grpo_loss(logp[mb], old[mb], adv[mb], mask[mb], normaliser=normaliser, spec=spec,
                                   ref_logp=ref[mb]).loss)
        # written out, row by row and token by token
        total = 0.0
        for i in want_rows:
            toks = range(lengths[i])
            seq = math.exp(mean([float(logp[i, t] - old[i, t]) for t in toks]))
            row = 0.0
            for t in toks:
                ratio = math.exp(float(logp[i, t] - old[i, t])) if level == "token" else seq
                a = want_adv[i]
                pg = -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
                d = float(ref[i, t] - logp[i, t])
                row += pg + beta * (math.exp(d) - d - 1)
            total += row / lengths[i] if loss_type == "seq_mean_token_mean" else row
        if loss_type == "token_mean":
            want = total / sum(lengths[i] for i in want_rows)
        elif loss_type == "dr_grpo":
            want = total / (len(want_rows) * L)
        else:
            want = total / len(want_rows)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (skip, got, want)


# ------------------------------------------------------------------------------------ a real difficulty column
MATH_DATA = {  # MATH's own `level` column, as a data config names the files of $GRPO_DIST_DATA_DIR
    # MATH-500 by data.path: level an int 1-5
    "math500_path": lambda root: [f"data.path={root}/math500/test.jsonl", "data.prompt_field=problem",
                                  "data.answer_field=answer"],
    # the `math` preset (MATH test set minus MATH-500, 4500 rows): level a string 'Level 1' .. 'Level 5'
    "math_preset": lambda root: ["data.preset=math"],
}


@pytest.mark.parametrize("data", list(MATH_DATA))
def test_static_order_on_math_levels_opens_the_easiest_first_and_reaches_every_level(data, tmp_path):
    """curriculum.mode=static on MATH's `level`, through the trainer's own loading (config -> data files ->
    Curriculum -> PromptSampler, before any model loads): batch 0 draws only from the easiest
    ceil(start_fraction x N) prompts (Level 1 alone here), the pool grows by the pacing formula and the hardest
    level drawn with it, and once the pool is whole every level is drawn."""
    import os
    root = os.environ.get("GRPO_DIST_DATA_DIR")
    if not root or not os.path.isfile(os.path.join(root, "math500", "test.jsonl")):
        pytest.skip("needs $GRPO_DIST_DATA_DIR with the MATH files (math500/, math_test5000/)")
    s, pacing, per_step = 0.05, 6, 32
    tr = in_process(lambda: _trainer(MATH_DATA[data](root) + [
        # the tiny model's character tokenizer makes 5 % of MATH's problems longer than 512 tokens: not what is tested
        f"output_dir={tmp_path}", "data.limit=null", "data.max_truncated_prompt_fraction=1",
        f"prompts_per_rank={per_step}", "curriculum.mode=static",
        "curriculum.difficulty_field=level", f"curriculum.start_fraction={s}", f"curriculum.pacing_steps={pacing}"]))
    level = difficulties(tr.train_examples, "level")  # 1..5 from 1 / 'Level 1'
    n = len(level)
    assert n == {"math500_path": 500, "math_preset": 4500}[data] and set(level.tolist()) == {1, 2, 3, 4, 5}
    assert sum(level == 1) > math.ceil(s * n)  # the first pool fits inside Level 1
    hardest_seen = []
    drawn_levels = set()
    for b in range(pacing + 6):
        want = min(n, max(per_step, math.ceil((s + (1 - s) * min(1, b / pacing)) * n)))
        assert tr.curriculum.pool_size(b) == want
        batch = tr.sampler.next_batch()
        assert tr.sampler.last_batch_number == b and len({e.index for e in batch}) == per_step
        got = [level[e.index] for e in batch]
        # the pool is the `want` easiest: nothing harder than its hardest (the want-th smallest level)
        assert max(got) <= np.sort(level)[want - 1], (b, max(got))
        if b == 0:
            assert set(got) == {1.0}
        hardest_seen.append(max(got))
        drawn_levels |= set(got)
    assert hardest_seen[0] == 1 and max(hardest_seen[:2]) < 5  # the hard end opens with the pacing, not at once
    assert drawn_levels == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert tr.curriculum.metrics(pacing) == {"curriculum/pool_fraction": 1.0}
