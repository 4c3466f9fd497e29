"""Issue 26, "a run that cannot learn says so, at once": the run table, the health monitor (grpo_dist/health.py,
config section health.*) and --dry-run (grpo_dist/dry_run.py), on metric sequences and on the tiny smoke model."""

import json
import math

import pytest

from grpo_dist.config import HEALTH_CONDITIONS, HealthConfig, load_config
from grpo_dist.health import CANNOT_LEARN_EXIT_CODE, CONDITIONS, HealthMonitor

SMOKE = "configs/smoke_cpu.yaml"
ZERO_REWARD = "rewards=[{function: 'grpo_dist.rewards:math_reward', weight: 1.0}]"  # a random model: always 0
PARITY_REWARD = "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]"  # 0 or 1: parity of the characters

# a healthy step: rewards vary, nothing cut off, long answers, entropy 2, grad norm 1, small KL
OK = dict(reward_mean=0.4, reward_std=0.3, zero_advantage_fraction=0.2, truncated_fraction=0.1,
          completion_length_mean=200.0, entropy=2.0, grad_norm=1.0, kl=0.01, loss=0.01, skipped_steps=0)


def _drive(steps, max_completion_length=256, beta=0.04, **health):
    """Feed the monitor one metrics dict per step; returns (monitor, [flags per step], all printed lines)."""
    mon = HealthMonitor(HealthConfig(**health), max_completion_length, beta)
    flags, lines = [], []
    for i, m in enumerate(steps, start=1):
        v = mon.update({**OK, **m}, i)
        flags.append(v.flags)
        lines += v.lines
    return mon, flags, lines


def _held(flags, name):
    return [f[f"health/{name}"] for f in flags]


@pytest.mark.fast
def test_every_condition_is_documented_and_healthy_steps_raise_nothing():
    assert set(CONDITIONS) == set(HEALTH_CONDITIONS)
    _, flags, lines = _drive([{}] * 30)
    assert lines == [] and all(v == 0 for f in flags for v in f.values())
    assert set(flags[0]) == {f"health/{n}" for n in HEALTH_CONDITIONS}


@pytest.mark.fast
def test_reward_constant_and_zero_advantage_need_patience_steps_and_say_when_they_end():
    # patience 3: reward 0 (std 0) and zero_advantage_fraction 1.0 > 0.9 on steps 1-4, then a signal on step 5
    flat = dict(reward_mean=0.0, reward_std=0.0, zero_advantage_fraction=1.0, grad_norm=0.0, loss=0.0)
    _, flags, lines = _drive([flat] * 4 + [{}])
    assert _held(flags, "reward_constant") == [0, 0, 1, 1, 0]
    assert _held(flags, "zero_advantage") == [0, 0, 1, 1, 0]
    starts = [x for x in lines if " ended at step " not in x]
    assert [x.split(":")[1].split()[0] for x in starts] == ["reward_constant", "zero_advantage"]
    assert "from step 3 (reward_mean=0, reward_std=0 for 3 steps)" in starts[0]
    assert "raise max_completion_length" in starts[0]  # docs/troubleshooting.md's words
    assert "[grpo_dist] health: zero_advantage ended at step 5 (held 2 step(s) from step 3)" in lines
    # reward 1 everywhere counts too; 0.9 exactly is not above the threshold
    _, flags, _ = _drive([dict(reward_mean=1.0, reward_std=0.0, zero_advantage_fraction=0.9)] * 3)
    assert _held(flags, "reward_constant") == [0, 0, 1] and _held(flags, "zero_advantage") == [0, 0, 0]


@pytest.mark.fast
def test_truncated_length_entropy_grad_norm_kl_and_nonfinite():
    # truncated_fraction > 0.5 at once
    _, flags, lines = _drive([dict(truncated_fraction=0.5), dict(truncated_fraction=0.51)])
    assert _held(flags, "truncated") == [0, 1]
    assert "truncated_fraction=0.51 > 0.5 at max_completion_length=256" in lines[0]
    # length: below 10 tokens (cap 256 >= 4 x 10, the first 3 steps' median 200 >= 10), or 5x under the running
    # median of the steps before (200)
    _, flags, _ = _drive([{}] * 3 + [dict(completion_length_mean=39.0), dict(completion_length_mean=41.0),
                                     dict(completion_length_mean=9.0)])
    assert _held(flags, "length_collapse") == [0, 0, 0, 1, 0, 1]
    # a task whose answers are 9 tokens from the start has not collapsed
    _, flags, _ = _drive([dict(completion_length_mean=9.0)] * 5)
    assert _held(flags, "length_collapse") == [0] * 5
    # a cap of 8 tokens keeps answers short: the 10-token floor does not apply (8 < 4 x 10), the 5x fall does
    _, flags, _ = _drive([dict(completion_length_mean=7.0)] * 4, max_completion_length=8)
    assert _held(flags, "length_collapse") == [0, 0, 0, 0]
    # entropy: below 1.0 after starting above it (the first 3 steps' median 2.0), or 5x under its median: 0.39 < 2 / 5
    _, flags, _ = _drive([{}, {}, {}, dict(entropy=0.99), dict(entropy=1.5)])
    assert _held(flags, "entropy_collapse") == [0, 0, 0, 1, 0]
    # an instruct model at temperature 0.7 may start at 0.5: that is its level, not a collapse
    _, flags, _ = _drive([dict(entropy=0.5)] * 5)
    assert _held(flags, "entropy_collapse") == [0] * 5
    _, flags, _ = _drive([{}] * 3 + [dict(entropy=0.39)], entropy_min=0.0)
    assert _held(flags, "entropy_collapse") == [0, 0, 0, 1]
    # no token trained (skip_zero_advantage_groups with every group flat): the entropy metric reads 0, meaning nothing
    _, flags, _ = _drive([dict(entropy=0.0, trained_tokens=0.0)])
    assert _held(flags, "entropy_collapse") == [0]
    # grad norm: above 10x the median of earlier non-zero norms (1.0), after min_history=3 steps
    _, flags, lines = _drive([dict(grad_norm=50.0)] + [{}] * 3 + [dict(grad_norm=10.0), dict(grad_norm=10.5)])
    assert _held(flags, "grad_norm_jump") == [0, 0, 0, 0, 0, 1]
    # compared per fraction of groups with a signal (1 - zero_advantage_fraction 0.2 = 0.8): 10.5 / 0.8 = 13.1
    assert "grad_norm=10.5, per fraction of groups with a signal 13.12 > 10x its running median 1.25" in lines[0]
    # KL above 1.0 per token, only with a reference (beta > 0)
    assert _held(_drive([dict(kl=1.01)])[1], "kl_high") == [1]
    assert _held(_drive([dict(kl=1.01)], beta=0.0)[1], "kl_high") == [0]
    # non-finite: skipped_steps rose, or a NaN loss
    _, flags, _ = _drive([{}, dict(skipped_steps=1), dict(skipped_steps=1), dict(loss=math.nan, skipped_steps=1)])
    assert _held(flags, "nonfinite") == [0, 1, 0, 1]


@pytest.mark.fast
def test_stop_on_names_the_condition_and_enabled_false_is_silent():
    mon, _, _ = _drive([dict(truncated_fraction=0.9)], stop_on=["truncated"])
    assert mon.update({**OK, "truncated_fraction": 0.9}, 2).stop == "truncated"
    _, flags, lines = _drive([dict(truncated_fraction=0.9)] * 3, enabled=False)
    assert lines == [] and flags == [{}, {}, {}]
    with pytest.raises(ValueError, match="health.stop_on"):
        load_config(None, ["health.stop_on=[truncation]"])


@pytest.mark.fast
def test_run_table_numbers_are_the_config_arithmetic():
    from grpo_dist.run_table import run_numbers, run_table
    cfg = load_config(SMOKE, ["num_iterations=2", "micro_batch_size=3", "data.max_prompt_length=100"])
    n = run_numbers(cfg, 2)
    # smoke: prompts_per_rank 2, num_generations 4, max_completion_length 8
    assert n["prompts_per_step"] == 2 * 2
    assert n["completions_per_step"] == 2 * 2 * 4
    assert n["rows_per_micro_batch"] == 3 and n["micro_batches_per_rank"] == math.ceil(2 * 4 / 3) == 3
    assert n["updates_per_rollout_batch"] == 2
    assert n["tokens_per_step_at_cap"] == 16 * (100 + 8) == 1728
    text = "\n".join(run_table(cfg, 2, has_reference=True))
    for want in ("prompts per step        4 (2 rank(s) x prompts_per_rank 2)", "completions per step    16",
                 "3 per rank of 3 rows", "updates per rollout     2 (num_iterations)", "1728 (16 x",
                 "rollout engine          lean", "fsdp FULL_SHARD, full precision (weights float32)",
                 "yes: beta 0.04, KL in the loss (kl_in_reward=false)"):
        assert want in text, text
    cfg = load_config(SMOKE, ["beta=0", "distributed.backend=deepspeed", "distributed.mixed_precision=bf16"])
    text = "\n".join(run_table(cfg, 1, has_reference=False))
    assert "deepspeed ZeRO-2, mixed precision bf16" in text and "no (beta 0: not built, not run)" in text


@pytest.mark.fast
def test_dry_run_config_never_touches_output_dir():
    from grpo_dist.dry_run import prepare
    # save_best too: the demo's config keeps its best evaluation, and the dry run evaluates nothing (it was refused
    # with "save_best is never logged" before the dry run started)
    cfg = prepare(load_config(SMOKE, ["output_dir=/tmp/users_run", "save_steps=1", "eval_steps=2",
                                      "save_best=eval_accuracy", "health.stop_on=[truncated]"]), world_size=3)
    assert (cfg.num_generations, cfg.prompts_per_rank, cfg.max_steps) == (2, 3, 2)  # ceil(8 / 3) = 3
    assert (cfg.save_steps, cfg.save_final, cfg.eval_steps, cfg.resume_from_checkpoint) == (0, False, 0, None)
    assert cfg.save_best is None
    assert "users_run" not in cfg.output_dir and "grpo_dist_dry_run" in cfg.output_dir
    assert cfg.health.stop_on == [] and cfg.dry_run


def _main(capsys, *args):
    from grpo_dist.train import main
    code = main(["--config", SMOKE, "reward_workers=0", "progress_bar=false", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_dry_run_verdicts_on_the_smoke_model(tmp_path, capsys):
    """The smoke model with a reward that differs between its random completions (the parity of their characters)
    can learn (exit 0); with math_reward alone every reward of the random model is 0 and 97% of its completions are cut
    off at 8 tokens: 'cannot tell yet' (exit 6: 32 completions scoring 0 bound the success rate, they do not prove
    it 0; tests/test_nothing_lost_4.py has the formula). The user's output_dir is never made. (The smoke config's own
    rewards,
    math_reward + digit_overlap, depend on whether a random completion happens to hold a digit: with 2 completions
    per prompt every group can be flat, as it is under the per-prompt sampling noise.)"""
    user = tmp_path / "mine"
    code, out = _main(capsys, f"output_dir={user}", "--dry-run", PARITY_REWARD)
    assert code == 0, out
    assert "[grpo_dist] run table (the run as configured; this dry run: 8 prompts, num_generations=2" in out
    assert "completions per step    8 (x num_generations 4)" in out  # smoke: 1 rank x 2 prompts x 4
    assert out.count("[grpo_dist]   prompt ") == 8  # one completion per prompt, 8 prompts
    assert "gradient non-zero: yes" in out and "peak memory (RSS, rank 0)" in out
    assert out.splitlines()[-1].startswith("[grpo_dist] dry run verdict: can learn: ")
    assert out.splitlines()[-1].endswith("of the groups had rewards that differ, so the gradient is not zero: the run "
                                         "gets a learning signal (exit 0)")
    code, out = _main(capsys, f"output_dir={user}", "--dry-run", ZERO_REWARD)
    assert code == 6, out
    assert "groups with one reward: 100%; gradient non-zero: no" in out
    last = out.splitlines()[-1]
    assert last.startswith("[grpo_dist] dry run verdict: cannot tell yet: all 32 completions scored 0; ")
    assert "of completions were cut off at max_completion_length=8 tokens: raise max_completion_length (exit 6)" \
        in last
    assert not user.exists()


def test_stop_on_zero_advantage_writes_a_checkpoint_and_exits_5(tmp_path, capsys):
    """A run that cannot learn (every reward 0: zero_advantage_fraction 1.0 > 0.99 for patience=2 steps) says so at
    step 2 and, with health.stop_on=[zero_advantage], stops there with exit 5 after a checkpoint; before the
    monitor it ran all 6 steps in silence and exited 0."""
    out_dir = tmp_path / "run"
    code, out = _main(capsys, f"output_dir={out_dir}", ZERO_REWARD, "max_steps=6", "save_steps=0",
                      "health.patience=2", "health.stop_on=[zero_advantage]", "max_completion_length=2",
                      "skip_zero_advantage_groups=true")
    assert code == CANNOT_LEARN_EXIT_CODE, out
    assert "[grpo_dist] health: truncated from step 1 (truncated_fraction=1 > 0.5 at max_completion_length=2)" in out
    assert "[grpo_dist] health: zero_advantage from step 2 (zero_advantage_fraction=1 > 0.99 for 2 steps)" in out
    assert "[grpo_dist] health: stopping on zero_advantage (health.stop_on): checkpoint written at step 2, exiting " \
           "with code 5" in out
    assert (out_dir / "checkpoint-2").is_dir()
    metrics = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["health/zero_advantage"] for m in metrics] == [0, 1]
    assert [m["health/truncated"] for m in metrics] == [1, 1]
    # every group flat and skipped: no token trained, the entropy metric reads 0 and raises no entropy_collapse
    assert [(m["trained_tokens"], m["entropy"], m["health/entropy_collapse"]) for m in metrics] == [(0, 0, 0)] * 2


@pytest.mark.slow
def test_two_ranks_stop_together_with_exit_5(tmp_path):
    """2 ranks see the same all-reduced metrics, so both decide to stop at the same step (no hang, no new
    collective): each rank's exit code is 5, the table counts both ranks, rank 0 alone prints the health lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    codes, out_dir = tmp_path / "codes", tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GRPO_DIST_EXIT_CODE_DIR=str(codes))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    r = subprocess.run(launch + ["-m", "grpo_dist.train", "--config", SMOKE, f"output_dir={out_dir}", ZERO_REWARD,
                                 "max_steps=6", "save_steps=0", "progress_bar=false", "health.patience=2",
                                 "health.stop_on=[zero_advantage]", "max_completion_length=2",
                                 "distributed.timeout_s=60"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert sorted(p.read_text().strip() for p in codes.iterdir()) == ["5", "5"], r.stderr[-3000:]
    assert "prompts per step        4 (2 rank(s) x prompts_per_rank 2)" in r.stdout
    assert r.stdout.count("[grpo_dist] health: zero_advantage from step 2") == 1
    assert (out_dir / "checkpoint-2").is_dir() and not (out_dir / "checkpoint-3").exists()


def test_a_nan_step_starts_and_ends_nonfinite_on_the_smoke_model(tmp_path, capsys, monkeypatch):
    """The loss of step 2 is made NaN (grpo_dist/faults.py): the step is skipped (skipped_steps 0 -> 1), so
    health/nonfinite is 1 at step 2 only, with one line when it starts and one when it ends."""
    monkeypatch.setenv("GRPO_DIST_FAULT", "nan@step2")
    out_dir = tmp_path / "run"
    code, out = _main(capsys, f"output_dir={out_dir}", "max_steps=3", "save_steps=0", "save_final=false")
    assert code == 0, out
    metrics = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1]
    assert [m["health/nonfinite"] for m in metrics] == [0, 1, 0]
    assert "[grpo_dist] health: nonfinite from step 2 (skipped_steps=1" in out
    assert "[grpo_dist] health: nonfinite ended at step 3 (held 1 step(s) from step 2)" in out


@pytest.mark.fast
def test_the_monitor_keeps_bounded_state_over_a_long_run():
    mon, flags, lines = _drive([{}] * 500, window=20)
    assert lines == [] and len(mon.history) == 100 and all(len(h) <= 20 for h in mon._hist.values())
