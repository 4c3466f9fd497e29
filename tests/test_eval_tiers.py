"""Two-tier evaluation (config keys eval_steps / data.eval_limit, full_eval_steps, eval_num_samples,
full_eval_num_samples; grpo_dist.evaluation.eval_tiers / run_tier).

In-process trainers of the tiny model with learning_rate=0: the weights never move, so every evaluation of a run
must equal one evaluation of the same engine computed here, problem by problem, on the tier's own problems.
"""

import json

import pytest

from helpers import in_process

from grpo_dist.config import ConfigError, load_config

TINY = ("model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}")
NUM_EVAL = 7  # odd: two ranks split it 4 + 3


def base(tmp_path, *extra):
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a + 2}=", "answer": str(2 * a + 2)}) + "\n"
                            for a in range(NUM_EVAL)))
    return [TINY, "data.limit=8", f"data.eval_path={data}", "data.eval_limit=3", "prompts_per_rank=2",
            "num_generations=4", "max_completion_length=5", "rewards=[{function: 'reward_fns:odd_length', weight: 1}]",
            "reward_workers=0", "learning_rate=0", "beta=0", "micro_batch_size=8", "max_steps=3", "save_final=false",
            "progress_bar=false", "report_to=[jsonl]", "log_completions=0", "eval_steps=1", "full_eval_steps=2",
            f"output_dir={tmp_path / 'run'}", "distributed.timeout_s=60", *extra]


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.fast
@pytest.mark.parametrize("overrides, key", [
    (["eval_num_samples=4"], "eval_num_samples"),                                      # no light tier
    (["eval_steps=5", "full_eval_num_samples=4"], "full_eval_num_samples"),             # no full tier
    (["eval_steps=5", "full_eval_steps=10", "data.eval_limit=null"], "full_eval_steps"),  # both the whole set
    (["data.eval_limit=0"], "data.eval_limit"),  # 0 used to mean "all" silently
    (["full_eval_steps=-1"], "full_eval_steps"),
    (["eval_steps=5", "eval_num_samples=-2"], "eval_num_samples"),
    (["eval_steps=5", "save_best=eval_full_accuracy"], "save_best"),  # the full tier never runs
])
def test_tier_settings_that_cannot_apply_are_refused_with_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)
    assert len(e.value.problems) == 1, e.value.problems


@pytest.mark.fast
def test_due_tiers_follow_their_own_steps_and_the_last_step():
    from grpo_dist.evaluation import due_tiers
    cfg = load_config(None, ["eval_steps=2", "full_eval_steps=3", "max_steps=7", "data.eval_limit=5",
                             "full_eval_num_samples=4"])
    due = {s: [t.name for t in due_tiers(cfg, s)] for s in range(1, 8)}
    assert due == {1: [], 2: ["light"], 3: ["full"], 4: ["light"], 5: [], 6: ["light", "full"],
                   7: ["light", "full"]}
    light, full = due_tiers(cfg, 6)
    assert (light.prefix, light.limit, light.num_samples) == ("eval_", 5, 0)
    assert (full.prefix, full.limit, full.num_samples) == ("eval_full_", None, 4)


def _trainer(overrides):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _greedy_flags(tr, examples):
    """Per problem, whether this engine's greedy completion gets full marks from the first reward function."""
    from grpo_dist.evaluation import _score_examples
    return [c == 1 for c in _score_examples(tr.rollout_engine, tr.tokenizer, examples, tr.cfg, tr.rewards, 1,
                                            False)]


def test_each_tier_logs_its_own_names_on_its_own_problems_and_pass_at_k_leaves_training_alone(tmp_path, one_thread):
    """eval_steps=1 on the first 3 problems, full_eval_steps=2 on all 7, max_steps=3 (the last step runs both).
    The accuracies equal the mean of the greedy flags of the tier's problems computed here (light: flags[:3],
    full: all 7); sampled pass@k is ordered pass@1 <= pass@2 <= ... <= 1 (the estimator's bounds). With pass@k on,
    training samples exactly what it samples without it (the evaluation draws from a stream of its own)."""
    def go(extra, out):
        tr = _trainer(base(tmp_path, f"output_dir={out}", *extra))
        assert tr.train() == 0
        tr = _trainer(base(tmp_path, f"output_dir={out}_check", "max_steps=1", "eval_steps=0", "full_eval_steps=0"))
        tr.sync_rollout_weights()  # lr = 0: the same weights as every step of the run above
        from grpo_dist.data import load_examples
        return _greedy_flags(tr, load_examples(tr.cfg.data, "eval"))

    flags = in_process(lambda: go(["eval_num_samples=2", "full_eval_num_samples=4"], tmp_path / "a"))
    rows = metrics_of(tmp_path / "a")
    assert 0 < sum(flags) < NUM_EVAL, flags  # a real mix: a wrong subset or reduction would show
    light, full = sum(flags[:3]) / 3, sum(flags) / NUM_EVAL
    for row in rows:
        assert row["eval_accuracy"] == pytest.approx(light) and row["eval_num_examples"] == 3
        assert 0 <= row["eval_pass@1"] <= row["eval_pass@2"] <= 1
        assert not any(k.startswith("eval_pass@4") for k in row)
    assert ["eval_full_accuracy" in r for r in rows] == [False, True, True]  # every 2 steps, and the last
    for row in rows[1:]:
        assert row["eval_full_accuracy"] == pytest.approx(full) and row["eval_full_num_examples"] == NUM_EVAL
        assert 0 <= row["eval_full_pass@1"] <= row["eval_full_pass@2"] <= row["eval_full_pass@4"] <= 1
        assert "eval_full_truncated_fraction" in row

    in_process(lambda: go([], tmp_path / "b"))  # greedy tiers only
    plain = metrics_of(tmp_path / "b")
    assert not any(k.startswith(("eval_pass@", "eval_full_pass@")) for r in plain for k in r)
    for with_k, without in zip(rows, plain):  # the training rollouts of steps 2, 3 follow an evaluation
        for k in ("reward_mean", "reward_std", "completion_length_mean", "prompt_length_mean"):
            assert with_k[k] == without[k], (k, with_k["step"])


def test_empty_eval_split_is_refused_before_the_model_loads(tmp_path):
    from grpo_dist.data import DataError
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises((ConfigError, DataError)) as e:
        in_process(lambda: _trainer(base(tmp_path, f"data.eval_path={empty}", "eval_steps=0")))
    assert "full_eval_steps" in str(e.value) or str(empty) in str(e.value)


def _tiers_on_ranks(rank, world, tmp_path):
    tr = _trainer(base(tmp_path, f"output_dir={tmp_path / f'run{world}'}", f"prompts_per_rank={4 // world}",
                       "max_steps=2"))
    assert tr.train() == 0
    return metrics_of(tmp_path / f"run{world}") if rank == 0 else None


@pytest.mark.slow  # 2 spawned gloo ranks, then 1: ~30 s
def test_two_ranks_evaluate_the_same_as_one_process(tmp_path):
    """The tiers are sharded (rank r takes every 2nd problem: 4 + 3 of the 7, 2 + 1 of the light 3) and summed:
    the same accuracy, truncated fraction and count as one process."""
    from dist_utils import run_ranks
    two = run_ranks(_tiers_on_ranks, 2, tmp_path, tmp_path)[0]
    one = run_ranks(_tiers_on_ranks, 1, tmp_path, tmp_path)[0]
    for a, b in zip(two, one):
        for k in ("eval_accuracy", "eval_truncated_fraction", "eval_num_examples", "eval_full_accuracy",
                  "eval_full_truncated_fraction", "eval_full_num_examples"):
            if k in b:
                assert a[k] == pytest.approx(b[k]), (k, a["step"])
    assert "eval_full_accuracy" in two[-1] and two[-1]["eval_full_num_examples"] == NUM_EVAL
    assert 0 < two[-1]["eval_full_accuracy"] < 1  # a mix: a rank's share lost or counted twice would show
