"""A start that failed before step 1 leaves an empty metrics.jsonl (and maybe a tensorboard folder): that is not
another run's outputs, and must not block the rerun after the fix."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_dist.config import ConfigError
from grpo_dist.preflight import check_previous_run

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--config", "configs/smoke_cpu.yaml", "max_steps=1", "save_steps=0", "reward_workers=0",
          "progress_bar=false", "data.limit=8"]


def _cfg(out):
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=None, overwrite_output_dir=False)


@pytest.mark.fast
def test_leftovers_of_a_failed_start_are_removed_with_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "completions.jsonl").write_text("")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\0" * 88)  # the header, no step
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    check_previous_run(_cfg(tmp_path))  # no ConfigError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # rewritten by the new start anyway
    assert capsys.readouterr().out.strip().splitlines() == [
        f"[grpo_dist] output_dir {tmp_path}: removed what a start that failed before step 1 left (metrics.jsonl, "
        f"completions.jsonl, tensorboard: no step, no checkpoint)"]


@pytest.mark.fast
@pytest.mark.parametrize("case", ["step_logged", "checkpoint", "partial_checkpoint", "tensorboard_only"])
def test_a_completed_step_or_any_checkpoint_still_needs_consent(tmp_path, case):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' if case == "step_logged" else "")
    if case == "checkpoint":
        (tmp_path / "checkpoint-2").mkdir()
    if case == "partial_checkpoint":  # a step finished, its save was cut short
        (tmp_path / ".tmp-checkpoint-1").mkdir()
    if case == "tensorboard_only":  # report_to=[tensorboard]: no jsonl to tell whether a step was logged
        (tmp_path / "metrics.jsonl").unlink()
        (tmp_path / "tensorboard").mkdir()
    with pytest.raises(ConfigError, match="already holds a run"):
        check_previous_run(_cfg(tmp_path))
    assert (tmp_path / "metrics.jsonl").exists() or case == "tensorboard_only"


def test_rerun_after_a_start_that_failed_before_step_1_trains(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])

    def train(*extra):
        return subprocess.run([sys.executable, "-m", "grpo_dist.train", *COMMON, f"output_dir={tmp_path}", *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    r = train("rewards=[{function: 'reward_fns:broken', weight: 1.0}]")  # fails on every completion of step 1
    assert r.returncode == 2 and "failed on all" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # what the failed start left
    r = train("rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]")  # the fix
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed what a start that failed before step 1 left (metrics.jsonl" in r.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
