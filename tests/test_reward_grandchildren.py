"""Processes that a reward function forks in a grading worker do not outlive it: not after close(), nor after a
time-limit kill, nor after the worker crashed and was replaced, nor after the parent (the trainer) was SIGKILLed.
The reward function (reward_fns:forks_sleeper) forks a real grandchild that sleeps for 10 minutes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _sleepers(folder: Path) -> list[int]:
    return [int(p.name) for p in folder.iterdir()]


def _assert_all_die(pids, timeout=10.0):
    assert pids, "the reward function forked nothing"
    deadline = time.monotonic() + timeout
    try:
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"forked grandchildren still alive: {[p for p in pids if _alive(p)]}"
            time.sleep(0.05)
    finally:
        for p in pids:  # never leave one behind, whatever failed
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.fast
@pytest.mark.parametrize("then", ["return", "hang", "crash"])
def test_grandchildren_die_with_their_worker(then, tmp_path, monkeypatch):
    """return: killed at close(); hang: at the time-limit kill; crash: when the crashed worker is replaced (and
    again by close)."""
    from grpo_dist.rewards import RewardComputer
    monkeypatch.setenv("SLEEPER_DIR", str(tmp_path))
    monkeypatch.setenv("SLEEPER_THEN", then)
    with RewardComputer([{"function": "reward_fns:forks_sleeper"}], num_workers=1, timeout_s=1.0) as rc:
        totals, _ = rc(["a"], ["1"])
        assert totals == ([1.0] if then == "return" else [0.0])
        if then != "return":  # killed or replaced already, before close()
            _assert_all_die(_sleepers(tmp_path))
    _assert_all_die(_sleepers(tmp_path))


@pytest.mark.fast
@pytest.mark.parametrize("then", ["return", "hang", "crash"])
def test_grandchildren_of_a_batch_function_die_with_their_worker(then, tmp_path, monkeypatch):
    """The same for a batch-form (TRL-contract) function, which has a worker process of its own."""
    from grpo_dist.rewards import RewardComputer
    monkeypatch.setenv("SLEEPER_DIR", str(tmp_path))
    monkeypatch.setenv("SLEEPER_THEN", then)
    with RewardComputer([{"function": "reward_fns:batch_forks_sleeper"}], num_workers=1, timeout_s=1.0) as rc:
        totals, _ = rc(["a"], ["1"])
        assert totals == ([1.0] if then == "return" else [0.0])
        if then != "return":  # killed (time limit) or dead (crash) already, before close()
            _assert_all_die(_sleepers(tmp_path))
    _assert_all_die(_sleepers(tmp_path))


@pytest.mark.fast
def test_grandchildren_die_when_the_parent_is_killed(tmp_path):
    code = ("from grpo_dist.rewards import RewardComputer; import time; "
            "rc = RewardComputer([{'function': 'reward_fns:forks_sleeper'}], num_workers=1, timeout_s=30); "
            "rc(['a'], ['1']); print('graded', flush=True); time.sleep(300)")
    env = dict(os.environ, SLEEPER_DIR=str(tmp_path), SLEEPER_THEN="return",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "graded", p.stderr.read()
        pids = _sleepers(tmp_path)
        assert pids and all(_alive(x) for x in pids)
    finally:
        p.kill()
        p.wait()
    _assert_all_die(pids)


def test_no_grandchild_outlives_a_training_run(tmp_path):
    """The whole trainer, one process, reward_workers=1: after `done`, nothing the reward function forked lives."""
    sleepers = tmp_path / "sleepers"
    sleepers.mkdir()
    env = dict(os.environ, SLEEPER_DIR=str(sleepers), SLEEPER_THEN="return", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    # files, not pipes: on failure a surviving grandchild holds the trainer's stderr open
    with open(tmp_path / "out", "w") as fo, open(tmp_path / "err", "w") as fe:
        r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                            "max_steps=1", "save_steps=0", "save_final=false", "reward_workers=1", "progress_bar=false",
                            "rewards=[{function: 'reward_fns:forks_sleeper'}, {function: 'reward_fns:odd_length'}]",
                            f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, timeout=300, stdout=fo, stderr=fe)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert r.returncode == 0 and "done: step 1" in out, err[-3000:]
    pids = _sleepers(sleepers)
    assert len(pids) == 8  # one per completion
    _assert_all_die(pids, timeout=3.0)
