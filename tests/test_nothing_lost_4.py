"""Issue 39, cases 9-16 ("Nothing lost, fourth round"): metrics.jsonl on a full disk, the steps a resume replays,
resuming a finished run, over-long prompts, the health monitor's false alarms, the dry run's chance of a wrong
verdict, deterministic mode and an async checkpoint resumed colocated."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_dist.metrics import MetricsLogger
from helpers import fill, tmpfs

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "configs/smoke_cpu.yaml"


def _main(capsys, *args):
    from grpo_dist.train import main
    code = main(["--config", SMOKE, "reward_workers=0", "progress_bar=false", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------- 9: metrics.jsonl, full disk
@pytest.mark.fast
def test_a_failed_metrics_append_leaves_whole_lines_and_names_the_file(tmp_path, monkeypatch):
    """os.write takes 700 bytes of the third line, then the disk is full (ENOSPC): the file is cut back to its two
    whole lines and logger.failed names the file and the cause (before: a half line, a traceback)."""
    import grpo_dist.metrics as metrics
    log = MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False)
    log.log({"step": 1, "reward_mean": 0.5})
    log.log({"step": 2, "reward_mean": 0.5})
    real, calls = os.write, []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, data[:700])  # a short write, as a filling disk gives
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.os, "write", full_disk)
    log.log({"step": 3, "reward_mean": 0.5, "pad": "x" * 2000})
    monkeypatch.setattr(metrics.os, "write", real)
    path = tmp_path / "metrics.jsonl"
    assert path.read_bytes().endswith(b"\n") and _steps(path) == [1, 2]
    assert log.failed == f"appending the line of step 3 to {path} failed: No space left on device ({path})"
    log.log({"step": 4})  # after a failure nothing more is appended: the run is stopping
    log.close()
    assert _steps(path) == [1, 2]


@pytest.mark.fast
def test_a_half_line_left_by_a_crash_is_cut_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "cut sh')
    log = MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False)
    log.log({"step": 2})
    log.close()
    assert _steps(path) == [1, 2]


def test_full_disk_while_appending_metrics_exits_2_naming_the_file(tmp_path):
    """The entry point on a tmpfs with 3 pages free and no checkpoint due: config.yaml (and the lock's page) take
    some, metrics lines (~1.5 KB each) the rest until one does not fit. Before: a traceback, exit 1, that line cut
    in half."""
    with tmpfs(tmp_path / "fs", "128k") as fs:
        fill(fs, 12288)
        out = fs / "run"
        r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", SMOKE, f"output_dir={out}",
                            "reward_workers=0", "progress_bar=false", "log_completions=0", "save_steps=0",
                            "save_final=false", "max_steps=8"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("grpo_dist: ")]
        step = int(line.split("appending the line of step ")[1].split()[0])
        assert step >= 2 and line.startswith(f"grpo_dist: rank 0: MetricsWriteError: appending the line of step "
                                             f"{step} to {out / 'metrics.jsonl'} failed: No space left on device"), line
        assert "the last checkpoint is none" in line, line
        assert (out / "metrics.jsonl").read_bytes().endswith(b"\n")
        assert _steps(out / "metrics.jsonl") == list(range(1, step))


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRPO_DIST_FAULT"):
        env.pop(k, None)
    return env


# ------------------------------------------------------------- 10, 11: replayed steps; resuming a finished run
@pytest.mark.fast
def test_a_resume_keeps_the_rows_it_replaces_and_says_which_steps(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": i, "reward_mean": i / 10}) + "\n" for i in range(1, 6))
    path.write_text(rows)
    MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False, start_step=3, resuming=True).close()
    assert _steps(path) == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl.1").read_text() == rows  # before: the rows of steps 4 and 5 were deleted
    assert capsys.readouterr().out.strip() == (
        "[grpo_dist] resume: steps 4-5 (logged by the run before, after its last checkpoint at step 3) are "
        "replayed; metrics.jsonl as it was, with their rows, is kept as metrics.jsonl.1")
    # a second resume from the same checkpoint keeps the next copy; a resume with nothing to replay keeps none
    path.write_text(rows[: rows.index('{"step": 5')])
    MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False, start_step=3, resuming=True).close()
    assert "step 4 (logged" in capsys.readouterr().out and (tmp_path / "metrics.jsonl.2").is_file()
    MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False, start_step=3, resuming=True).close()
    assert capsys.readouterr().out == "" and not (tmp_path / "metrics.jsonl.3").exists()


@pytest.fixture
def restore_determinism():
    import torch
    saved = (os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    env, algorithms, warn_only, cudnn_det, cudnn_bench = saved
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys, restore_determinism):
    """3 steps, a checkpoint at step 2 only, as a run interrupted after step 3's line: the auto-resume replays
    step 3 (it says so, and keeps the old line), then a second auto-resume of the finished run trains nothing, says
    so in one line and exits 0 (before: the run table, 'resumed at step 3' and 'done', as if it had trained).
    In deterministic mode (case 15), which on a CPU must still train and resume, to the same numbers."""
    import torch
    plain = tmp_path / "plain"
    assert _main(capsys, f"output_dir={plain}", "max_steps=3", "save_steps=0", "log_completions=0")[0] == 0
    assert not torch.are_deterministic_algorithms_enabled()
    out_dir = tmp_path / "run"
    base = [f"output_dir={out_dir}", "max_steps=3", "save_steps=2", "save_final=false", "log_completions=0",
            "deterministic=true"]
    code, _ = _main(capsys, *base)
    assert code == 0 and _steps(out_dir / "metrics.jsonl") == [1, 2, 3]
    code, out = _main(capsys, *base, "save_final=true", "resume_from_checkpoint=auto")
    assert code == 0, out
    assert "[grpo_dist] resume: step 3 (logged by the run before, after its last checkpoint at step 2) is " \
           "replayed; metrics.jsonl as it was, with their rows, is kept as metrics.jsonl.1" in out
    assert _steps(out_dir / "metrics.jsonl") == [1, 2, 3] and _steps(out_dir / "metrics.jsonl.1") == [1, 2, 3]
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark

    def numbers(path):  # the trained numbers of each step (not its timings)
        return [(m["step"], m["loss"], m["grad_norm"], m["kl"], m["reward_mean"]) for m in
                map(json.loads, path.read_text().splitlines())]
    # the interrupted-and-resumed deterministic run trained the same numbers as the plain uninterrupted one
    assert numbers(out_dir / "metrics.jsonl") == numbers(plain / "metrics.jsonl")
    code, out = _main(capsys, *base, "save_final=true", "resume_from_checkpoint=auto")
    assert code == 0, out
    lines = [x for x in out.splitlines() if x.startswith("[grpo_dist] ") and "loading" not in x]
    assert lines[-1] == (f"[grpo_dist] nothing to do: {out_dir / 'checkpoint-3'} is at step 3 and max_steps is 3, "
                         f"so the run is finished; raise max_steps to train further"), out
    assert "done:" not in out and "run table" not in out and "step=" not in out
    assert _steps(out_dir / "metrics.jsonl") == [1, 2, 3] and not (out_dir / "metrics.jsonl.2").exists()


# ------------------------------------------------------------------- 16: an async checkpoint resumed colocated
@pytest.mark.fast
def test_a_change_between_async_and_colocated_is_said_on_resume():
    from grpo_dist.checkpoint import rollout_mode_change
    line = rollout_mode_change({"rollout_ranks": 1, "max_staleness": 1}, 0, 2, "checkpoint-4")
    assert line == ("[grpo_dist] resume: checkpoint-4 was written by an asynchronous run (rollout_ranks=1, "
                    "max_staleness=1); this run has no rollout ranks, so it goes on colocated: each of its 2 rank(s) "
                    "samples its own batch with the current policy (set rollout_ranks=1 to go on asynchronously)")
    assert "goes on asynchronously (rollout_ranks=2): 1 rank(s) train" in \
        rollout_mode_change({"rollout_ranks": 0}, 2, 1, "checkpoint-4")
    assert rollout_mode_change({"rollout_ranks": 1}, 3, 1, "c") is None and rollout_mode_change({}, 0, 1, "c") is None


# ------------------------------------------------------------------------------------ 15: deterministic mode
@pytest.mark.fast
def test_deterministic_sets_the_cuda_settings_and_off_sets_nothing(restore_determinism, monkeypatch):
    import torch

    from grpo_dist import determinism
    from grpo_dist.config import load_config
    assert load_config(None, []).deterministic is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    assert determinism.apply(False) == {} and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert determinism.apply(True) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "deterministic_algorithms": True,
                                       "cudnn.deterministic": True, "cudnn.benchmark": False}
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own valid choice is kept
    assert determinism.apply(True)["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


# ----------------------------------------------------------------------------- 12: prompts cut from the left
def test_prompts_longer_than_max_prompt_length_are_counted_warned_once_and_refused_above_a_fraction(tmp_path,
                                                                                                    capsys):
    """The smoke data rendered by the char tokenizer: 82 prompts of 4 tokens, 159 of 5, 79 of 6 (320). At
    max_prompt_length=5, 79 / 320 = 24.7 % lose their first token: above the default 0.05 the run is refused
    before any model loads (exit 2, one line); at max_truncated_prompt_fraction=0.3 it warns once at start. At
    max_prompt_length=3 every prompt is cut: prompts_truncated = prompts_per_rank x ranks = 2 at every step.
    Before: no word, no count, exit 0."""
    out_dir = tmp_path / "run"
    code, out = _main(capsys, f"output_dir={out_dir}", "max_steps=1", "data.max_prompt_length=5")
    assert code == 2, out
    [line] = [x for x in out.splitlines() if x.startswith("grpo_dist: ")]
    assert line == ("grpo_dist: rank 0: DataError: 79 of 320 training prompts (24.7%) are longer than "
                    "data.max_prompt_length=5 tokens once rendered (the longest 6): they lose their beginning, cut "
                    "from the left, while their reference answer stays; that is more than "
                    "data.max_truncated_prompt_fraction=0.05: raise data.max_prompt_length (to 6 to keep every prompt "
                    "whole), shorten the prompt template, or raise data.max_truncated_prompt_fraction"), line
    assert "loading" not in out  # refused before any model loads
    code, out = _main(capsys, f"output_dir={out_dir}", "max_steps=2", "data.max_prompt_length=3",
                      "data.max_truncated_prompt_fraction=1", "save_final=false", "overwrite_output_dir=true")
    assert code == 0, out
    assert out.count("[grpo_dist] warning: 320 of 320 training prompts (100.0%) are longer than "
                     "data.max_prompt_length=3 tokens") == 1, out
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["prompts_truncated"] for m in rows] == [2, 2]
    assert [m["prompt_length_mean"] for m in rows] == [3.0, 3.0]


@pytest.mark.fast
def test_max_truncated_prompt_fraction_is_checked_for_its_range():
    from grpo_dist.config import load_config
    assert load_config(None, []).data.max_truncated_prompt_fraction == 0.05
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ValueError, match=r"'data.max_truncated_prompt_fraction' must be in \[0, 1\], got"):
            load_config(None, [f"data.max_truncated_prompt_fraction={bad}"])
    load_config(None, ["data.max_truncated_prompt_fraction=0"])


# ------------------------------------------------------------------ 14: the dry run's chance of a wrong verdict
class _Rehearsed:
    """What DryRun.verdict reads of a trainer: its config, world size and the monitor's history."""

    def __init__(self, history, **overrides):
        from types import SimpleNamespace

        from grpo_dist.config import load_config
        from grpo_dist.dry_run import prepare
        self.cfg = prepare(load_config(SMOKE, [f"{k}={v}" for k, v in overrides.items()]), world_size=1)
        self.ctx = SimpleNamespace(world_size=1, is_main=False)
        self.health = SimpleNamespace(history=history)
        self.on_graded = None


def _dry_run(history, **overrides):
    from grpo_dist.dry_run import DryRun
    from grpo_dist.config import load_config
    run = DryRun(_Rehearsed(history, **overrides), load_config(SMOKE, ["num_generations=8"]))
    return run.verdict()[0], run.finish(0)


FLAT_ZERO = dict(reward_mean=0.0, reward_std=0.0, zero_advantage_fraction=1.0, truncated_fraction=0.0, grad_norm=0.0)


@pytest.mark.fast
def test_the_dry_run_says_cannot_tell_yet_when_every_completion_scored_0():
    """16 groups of 2 (8 prompts x 2 steps) whose 32 completions all scored 0. A config whose completions score 1
    with probability p = 5 % shows every group flat with probability (p^2 + (1-p)^2)^16 = 20.2 %, every completion 0
    with (1-p)^32 = 19.4 %: before, the verdict was 'cannot learn' (exit 5), wrong that often. Now 'cannot tell yet'
    (exit 6), with the bound the 32 zeros do give: p < 1 - 0.05^(1/32) = 8.9 % at 95 % confidence."""
    p = 0.05
    assert round((p ** 2 + (1 - p) ** 2) ** 16, 3) == 0.202 and round((1 - p) ** 32, 3) == 0.194
    bound = 1 - 0.05 ** (1 / 32)
    assert round(bound, 3) == 0.089 and abs((1 - bound) ** 32 - 0.05) < 1e-12
    reason, code = _dry_run([FLAT_ZERO, FLAT_ZERO])
    assert code == 6, reason
    assert reason == ("cannot tell yet: all 32 completions scored 0; if a completion could succeed with probability "
                      "p, all 32 would score 0 with probability (1-p)^32 (19% at p = 5%), so this only shows that "
                      "the success rate is below 8.9% (95% confidence). A full run with num_generations=8 may still "
                      "learn; the health monitor says so if it does not. Check the reward function and the prompt "
                      "format on the completions above")
    # every completion 1: the mirror image; rewards that differ between groups but never inside one: cannot learn
    reason, code = _dry_run([{**FLAT_ZERO, "reward_mean": 1.0}] * 2)
    assert code == 6 and "success rate is above 91.1% (95% confidence)" in reason and "too easy" in reason
    reason, code = _dry_run([{**FLAT_ZERO, "reward_mean": 0.25, "reward_std": 0.43}] * 2)
    assert code == 5 and reason == "every group had one reward: groups are near-identical: raise temperature"
    # a signal: can learn, exit 0
    reason, code = _dry_run([{**FLAT_ZERO, "reward_mean": 0.25, "reward_std": 0.43, "zero_advantage_fraction": 0.5,
                              "grad_norm": 0.7}] * 2)
    assert (reason, code) == (None, 0)


# ------------------------------------------------------------------------- 13: the health monitor's false alarms
def _series(kind: str, seed: int, steps: int = 60) -> list[dict]:
    """Step metrics shaped like the runs they are named after, with seeded multiplicative noise (lognormal, 15 %;
    grad norm 30 %; the fraction of groups with a signal drawn as a binomial count of 256 groups, 32 on the demos).
    Learning runs: 'gsm8k' (a base model on GSM8K-style data taking off around step 15: accuracy
    0.6 % -> 10 %, groups of 8 flat 95 % -> 43 % of the time, the grad norm rising with them 0.03 -> 0.34, length
    950 -> 170 tokens as it stops rambling, entropy 1.25 -> 0.95), 'demo' (tests/data/golden/demo.json's reward and
    grad norm for 20 steps, then
    docs/demo.md's trend: reward -> 0.84, entropy 0.39 -> 0.20, length 2.86), 'real' (docs/demo.md's real-model
    demo: length 12 -> 8 in ~4 steps, entropy 0.7 -> 0.06, reward 0.15 -> 0.55). No-learning runs: 'zero' (an
    always-0 reward), 'eos' (the length collapses to EOS while the reward falls), 'entropy' (the entropy collapses
    with the reward flat), 'explode' (the grad norm jumps 30x at step 40, the groups unchanged), 'short' (the
    length falls 8x in a few steps with the reward flat)."""
    import math

    import numpy as np
    rng = np.random.default_rng(seed)

    def noisy(x, sd=0.15):
        return float(x * math.exp(rng.normal(0.0, sd)))

    def signal(flat, groups=256):  # the fraction of groups whose rewards differ, drawn as a count of groups
        return float(rng.binomial(groups, 1 - flat)) / groups

    def ramp(a, b, t, tau):  # from a towards b, exponentially, time constant tau steps
        return b + (a - b) * math.exp(-t / tau)
    golden = json.loads((ROOT / "tests/data/golden/demo.json").read_text())["trajectory"]
    out = []
    for t in range(steps):
        m = dict(reward_std=0.3, truncated_fraction=0.0, kl=0.0, loss=0.01, skipped_steps=0, trained_tokens=100.0)
        if kind == "gsm8k":  # the run takes off around step 15 (a logistic of width 2 steps)
            s = 1 / (1 + math.exp(-(t - 15) / 2))
            acc = 0.006 + (0.10 - 0.006) * s
            sig = signal((1 - acc) ** 8 + acc ** 8)  # groups flat 0.953 -> 0.43
            m.update(reward_mean=noisy(acc), zero_advantage_fraction=1 - sig,
                     grad_norm=noisy(0.6 * sig, 0.3),  # 0.028 -> 0.34
                     entropy=noisy(1.25 - 0.3 * s, 0.05), completion_length_mean=noisy(950 - 780 * s, 0.1),
                     truncated_fraction=min(1.0, noisy(0.2 * (1 - s))))
        if kind in ("short", "explode", "entropy", "eos"):
            acc = 0.3
            sig = signal((1 - acc) ** 8 + acc ** 8)
            m.update(reward_mean=noisy(acc), zero_advantage_fraction=1 - sig,
                     grad_norm=noisy(0.6 * sig, 0.3), entropy=noisy(2.0, 0.05),
                     completion_length_mean=noisy(300.0, 0.1))
            if kind == "short":  # 300 -> 38 tokens in a few steps, the reward as flat as before
                m["completion_length_mean"] = noisy(ramp(300, 38, max(0, t - 20), 1.5))
            if kind == "explode" and t >= 40:
                m["grad_norm"] *= 30
            if kind == "entropy":  # 2.0 -> 0.15 while the reward stays where it was
                m["entropy"] = noisy(ramp(2.0, 0.15, max(0, t - 20), 4))
            if kind == "eos" and t >= 20:  # only EOS within a few steps, the reward going to 0 with it
                m["completion_length_mean"] = noisy(ramp(300, 1.5, t - 20, 2))
                m["reward_mean"] = noisy(ramp(0.3, 0.0, t - 20, 2))
        elif kind == "demo":
            reward = golden["reward_mean"][t] if t < 20 else noisy(ramp(0.6, 0.84, t - 20, 15), 0.05)
            sig = signal((1 - reward) ** 8 + reward ** 8, groups=32)
            m.update(reward_mean=reward, zero_advantage_fraction=1 - sig, completion_length_mean=noisy(2.86, 0.02),
                     grad_norm=golden["grad_norm"][t] if t < 20 else noisy(2.4 * sig, 0.3),
                     entropy=noisy(ramp(0.39, 0.20, t, 20)))
        elif kind == "real":
            reward = ramp(0.15, 0.55, t, 12)
            sig = signal((1 - reward) ** 8 + reward ** 8, groups=32)
            m.update(reward_mean=noisy(reward), zero_advantage_fraction=1 - sig,
                     completion_length_mean=noisy(ramp(12, 8, t, 2), 0.05), grad_norm=noisy(1.5 * sig, 0.3),
                     entropy=noisy(ramp(0.7, 0.06, t, 12)), truncated_fraction=min(1.0, noisy(ramp(0.3, 0, t, 2))))
        elif kind == "zero":
            m.update(reward_mean=0.0, reward_std=0.0, zero_advantage_fraction=1.0, grad_norm=0.0,
                     completion_length_mean=noisy(200.0), entropy=noisy(2.0), loss=0.0)
        out.append(m)
    return out


def _alarms(steps: list[dict], max_completion_length: int = 1024) -> dict[str, int]:
    """condition -> the first step it held (HealthConfig defaults)."""
    from grpo_dist.config import HealthConfig
    from grpo_dist.health import HealthMonitor
    mon, first = HealthMonitor(HealthConfig(), max_completion_length, beta=0.0), {}
    for i, m in enumerate(steps, start=1):
        for k, v in mon.update(m, i).flags.items():
            if v:
                first.setdefault(k.split("/")[1], i)
    return first


@pytest.mark.fast
def test_the_health_monitor_raises_no_alarm_on_learning_runs_and_still_does_on_no_learning_ones():
    """Before, on the same series: gsm8k raised grad_norm_jump (0.03 -> 0.32 as groups stop being flat),
    length_collapse (950 -> 170) and entropy_collapse (1.25 -> under 1.0) on every seed."""
    for seed in range(20):
        assert _alarms(_series("gsm8k", seed)) == {}, seed
        assert _alarms(_series("demo", seed), max_completion_length=4) == {}, seed
        assert _alarms(_series("real", seed, steps=40), max_completion_length=16) == {}, seed
        assert set(_alarms(_series("zero", seed))) == {"reward_constant", "zero_advantage"}, seed
        assert _alarms(_series("zero", seed))["reward_constant"] == 3
        assert "length_collapse" in _alarms(_series("eos", seed)), seed
        assert "entropy_collapse" in _alarms(_series("entropy", seed)), seed
        assert _alarms(_series("explode", seed)).get("grad_norm_jump") == 41, seed
        assert "length_collapse" in _alarms(_series("short", seed)), seed


@pytest.mark.fast
def test_stop_on_defaults_to_reward_constant_once_enough_completions_agree():
    """health.stop_on defaults to [reward_constant], the one condition that cannot false-alarm once enough
    completions in a row scored the same: a config whose completions succeed with probability p = 1 % gives 459
    failures in a row with probability 0.99^459 = 0.99 % < 1 %. So the stop waits for 459 completions, the line does
    not: 8 completions a step stop at step 58 (58 x 8 = 464), 256 a step at step 3 (patience)."""
    from grpo_dist.config import HealthConfig
    from grpo_dist.health import HealthMonitor
    assert HealthConfig().stop_on == ["reward_constant"] and HealthConfig().reward_constant_min_completions == 459
    assert 0.99 ** 459 < 0.01 < 0.99 ** 458
    for per_step, stop_at in ((8, 58), (256, 3)):
        mon = HealthMonitor(HealthConfig(), 256, 0.0, completions_per_step=per_step)
        stops = [mon.update(m, i).stop for i, m in enumerate(_series("zero", 0, steps=60), start=1)]
        assert stops.index("reward_constant") + 1 == stop_at


@pytest.mark.fast
def test_a_failed_completions_append_leaves_whole_rows(tmp_path, monkeypatch):
    """completions.jsonl as metrics.jsonl: a step's rows in one write, cut back when the disk is full."""
    import grpo_dist.metrics as metrics
    from grpo_dist.completions import CompletionLog
    log = CompletionLog(str(tmp_path), 2, True)
    args = (["p", "q"], ["a", "b"], ["1", "2"], [1.0, 0.0], {"f": [1.0, 0.0]}, [0.5, -0.5], [3, 4])
    log.write(1, *args)
    real = os.write

    def full_disk(fd, data):
        real(fd, data[:30])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.os, "write", full_disk)
    log.write(2, *args)
    monkeypatch.setattr(metrics.os, "write", real)
    log.close()
    path = tmp_path / "completions.jsonl"
    assert _steps(path) == [1, 1] and path.read_bytes().endswith(b"\n")
    assert log.failed == f"appending the completions of step 2 to {path} failed: No space left on device ({path})"
