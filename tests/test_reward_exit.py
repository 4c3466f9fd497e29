"""A reward function graded in the trainer process (reward_workers=0) that calls sys.exit or os._exit cannot end
the run: the call is a reward error like an exception (scored 0, counted in reward_errors/<name>, printed once),
and a function that does it on every completion stops the run with exit 2 and one line naming it, instead of a
silent exit 0 with no checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get(
        "PYTHONPATH", "")]))
    env.pop("EXIT_RANK", None)
    return env


@pytest.mark.fast
def test_in_process_sys_exit_is_a_reward_error(capfd, monkeypatch):
    monkeypatch.delenv("EXIT_RANK", raising=False)
    _grade_and_check("calls_sys_exit")
    assert "SystemExit" in capfd.readouterr().err


@pytest.mark.fast
def test_in_process_os_exit_is_a_reward_error():
    """In a child process: on today's code os._exit(0) would end pytest itself, with code 0."""
    code = "import test_reward_exit as t; t._grade_and_check('calls_os_exit'); print('survived')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "survived", (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stderr.count("reward function 'calls_os_exit'") == 1
    assert "os._exit(0) called by a reward function" in r.stderr


@pytest.mark.fast
def test_in_process_batch_sys_exit_is_a_reward_error(capfd):
    """The same for a batch-form (TRL-contract) function graded in the trainer process."""
    _grade_and_check("batch_calls_sys_exit")
    assert "SystemExit" in capfd.readouterr().err


@pytest.mark.fast
def test_in_process_batch_os_exit_is_a_reward_error():
    code = "import test_reward_exit as t; t._grade_and_check('batch_calls_os_exit'); print('survived')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "survived", (r.returncode, r.stdout, r.stderr[-2000:])
    assert "os._exit(0) called by a reward function" in r.stderr


@pytest.mark.fast
@pytest.mark.parametrize("fn, words", [("calls_posix_exit", "posix._exit(0) called by a reward function"),
                                       ("calls_os_abort", "os.abort() called by a reward function"),
                                       ("calls_raise_signal", "signal.raise_signal(9) called by a reward function"),
                                       ("kills_itself", "os.kill(")])
def test_other_process_exits_are_reward_errors(fn, words):
    """posix._exit, os.abort, signal.raise_signal and a kill of the process itself end the trainer as surely as
    os._exit (on the code before: exit 0, -6 or -9, nothing printed): each is a reward error, the process lives."""
    code = f"import test_reward_exit as t; t._grade_and_check({fn!r}); print('survived')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "survived", (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stderr.count(f"reward function '{fn}'") == 1 and words in r.stderr, r.stderr[-2000:]


@pytest.mark.fast
def test_other_threads_keep_the_real_exits():
    """The guard refuses only the grading thread's calls: a helper thread (the parent-death watch sends the process
    SIGTERM with os.kill) still gets the real functions while a reward function runs."""
    import threading

    from grpo_dist.rewards import grading
    with grading._process_exit_blocked():
        errors = []

        def other():
            try:
                os.kill(os.getpid(), 0)  # signal 0: an existence check, harmless when allowed
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        with pytest.raises(grading.ProcessExitCalled):
            os.kill(os.getpid(), 0)
    assert errors == []
    os.kill(os.getpid(), 0)  # restored


def _grade_and_check(fn):
    from grpo_dist.rewards import RewardComputer
    real_exit = os._exit
    with RewardComputer([{"function": f"reward_fns:{fn}"}, {"function": "reward_fns:odd_length"}],
                        num_workers=0) as rc:
        totals, per_fn = rc(["a", "bb", "ccc"], ["1"] * 3)
    assert os._exit is real_exit  # restored
    assert rc.last_errors == {fn: 3, "odd_length": 0}
    assert per_fn[fn] == [0.0] * 3 and totals == [1.0, 0.0, 1.0]


def test_os_exit_on_every_completion_stops_the_run_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                        "max_steps=1", "save_steps=0", "save_final=false", "reward_workers=0", "progress_bar=false",
                        "rewards=[{function: 'reward_fns:calls_os_exit'}]", f"output_dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    final = [x for x in r.stderr.splitlines() if x.startswith("grpo_dist: rank")]
    assert len(final) == 1 and "reward function 'calls_os_exit' failed on all 8 completions" in final[0], r.stderr
    assert "os._exit(0) called by a reward function" in r.stderr


@pytest.mark.fast
def test_an_abort_during_in_process_grading_still_ends_the_process():
    """A second Ctrl-C that lands while an in-process reward function runs (os._exit swapped for one that raises)
    must still end the process with 130, not become a reward error."""
    code = ("import os, signal, threading, time\n"
            "from grpo_dist import interrupts\n"
            "from grpo_dist.rewards import grading\n"
            "with grading._process_exit_blocked():\n"
            "    interrupts._abort(True, 'abort')\n"
            "print('survived')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 130 and "survived" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
