"""RewardComputer: worker processes, hard per-item time limit, crash and parent-death safety."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grpo_dist.rewards import RewardComputer, math_reward, resolve_reward_function

pytestmark = pytest.mark.fast  # the `make fast` tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = {"function": "grpo_dist.rewards:math_reward", "weight": 1.0}

HELPERS = '''
import os, time, math
def hang(completion, reference):
    if "HANG" in completion:
        while True:          # a runaway computation burning CPU
            pass
    return 1.0
def sleepy(completion, reference):
    if "SLEEP" in completion:
        time.sleep(60)
    return 0.5
def boom(completion, reference):
    raise RuntimeError("boom")
def nan(completion, reference):
    return float("nan")
def text(completion, reference):
    return "not a number"
def chatty(completion, reference):
    print("hello from a reward function")
    print('{"v": 99}')
    return 0.25
def crash(completion, reference):
    if "CRASH" in completion:
        os._exit(3)
    return 1.0
def pid(completion, reference):
    return float(os.getpid())
NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewardmods")
    (d / "pool_helpers.py").write_text(HELPERS)
    sys.path.insert(0, str(d))
    yield "pool_helpers"
    sys.path.remove(str(d))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_dead(pid, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_resolve_reward_function(helpers):
    assert resolve_reward_function("grpo_dist.rewards:math_reward") is math_reward
    assert resolve_reward_function("grpo_dist.rewards.math:math_reward") is math_reward
    for spec, msg in [("nosuchmodule_xyz:f", "cannot import"), ("grpo_dist.rewards:nope", "no attribute"),
                      (f"{helpers}:NOT_CALLABLE", "not callable"), ("grpo_dist.rewards", "module:function"),
                      ("a:b:c", "module:function")]:
        with pytest.raises(ValueError, match=msg) as e:
            resolve_reward_function(spec)
        assert spec in str(e.value)


def test_bad_specs_fail_at_construction():
    with pytest.raises(ValueError, match="nope"):
        RewardComputer([{"function": "grpo_dist.rewards:nope"}], num_workers=0)
    with pytest.raises(ValueError):
        RewardComputer([{"fn": "grpo_dist.rewards:math_reward"}], num_workers=0)
    with pytest.raises(ValueError):
        RewardComputer([], num_workers=0)


COMPS = ["so \\boxed{5}", "#### 6", "no answer", "\\boxed{\\frac{1}{2}}", "\\boxed{10**10**10}", "\\boxed{x=3}"]
REFS = ["5", "6", "7", "0.5", "5", "3"]


def test_in_process_matches_math_reward(helpers):
    with RewardComputer([MATH, {"function": f"{helpers}:sleepy", "weight": 2.0}], num_workers=0) as rc:
        totals, per = rc(COMPS, REFS)
    expected = [math_reward(c, r) for c, r in zip(COMPS, REFS)]
    assert per["math_reward"] == expected
    assert per["sleepy"] == [0.5] * len(COMPS)
    assert totals == [e + 1.0 for e in expected]


def test_workers_match_math_reward_and_handle_bad_functions(helpers):
    specs = [MATH, f"{helpers}:boom", f"{helpers}:nan", f"{helpers}:text",
             {"function": f"{helpers}:chatty", "weight": 4.0}]
    comps = COMPS * 5
    refs = REFS * 5
    with RewardComputer(specs, num_workers=2, timeout_s=10.0) as rc:
        totals, per = rc(comps, refs)
        assert rc.stats["timeouts"] == 0
    expected = [math_reward(c, r) for c, r in zip(comps, refs)]
    assert per["math_reward"] == expected
    assert per["boom"] == per["nan"] == per["text"] == [0.0] * len(comps)
    assert per["chatty"] == [0.25] * len(comps)
    assert totals == [e + 1.0 for e in expected]
    assert list(per) == ["math_reward", "boom", "nan", "text", "chatty"]


def test_timeout_kills_and_replaces_worker(helpers):
    with RewardComputer([f"{helpers}:hang", f"{helpers}:pid"], num_workers=1, timeout_s=1.0) as rc:
        _, per0 = rc(["warm"], ["x"])
        old_pid = int(per0["pid"][0])
        t = time.perf_counter()
        totals, per = rc(["ok 1", "HANG", "ok 2"], ["x"] * 3)
        dt = time.perf_counter() - t
        assert per["hang"] == [1.0, 0.0, 1.0]
        assert rc.stats["timeouts"] == 1
        assert dt < 30
        assert _wait_dead(old_pid, 5.0), "timed-out worker still running"
        new_pid = int(per["pid"][0])
        assert new_pid != old_pid and _alive(new_pid)
    assert _wait_dead(new_pid, 5.0), "close() left a worker behind"


def test_timeout_works_from_a_thread(helpers):
    out = {}

    def run():
        with RewardComputer([f"{helpers}:sleepy"], num_workers=1, timeout_s=1.0) as rc:
            out["res"] = rc(["SLEEP", "fine"], ["r", "r"])

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    assert not th.is_alive()
    assert out["res"][1]["sleepy"] == [0.0, 0.5]


def test_worker_crash_is_retried_then_scored_zero(helpers):
    with RewardComputer([f"{helpers}:crash"], num_workers=1, timeout_s=5.0) as rc:
        totals, per = rc(["a", "CRASH", "b"], ["r"] * 3)
        assert per["crash"] == [1.0, 0.0, 1.0]
        assert rc.stats["crashes"] >= 2
        assert rc(["c"], ["r"])[0] == [1.0]


def test_length_mismatch_raises():
    with RewardComputer([MATH], num_workers=0) as rc, pytest.raises(ValueError):
        rc(["a"], ["b", "c"])


def _run_script(tmp_path, body, *args, module=False, timeout=120):
    pkg = tmp_path / "launchpkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    cmd = [sys.executable, "-m", "launchpkg.main", *args] if module else [sys.executable, str(pkg / "main.py"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))


@pytest.mark.heavy  # a fresh interpreter importing torch: ~2 s; out of `make fast`
def test_works_under_python_m_with_torch_imported(tmp_path):
    # like `python -m grpo_dist.train` under torchrun: torch imported, no __main__ guard;
    # workers must not re-import (and so re-run) the main module.
    body = """
    import torch, os
    print("MAIN RUNS", os.getpid(), flush=True)
    from grpo_dist.rewards import RewardComputer
    rc = RewardComputer([{"function": "grpo_dist.rewards:math_reward"}], num_workers=1, timeout_s=10)
    print("RESULT", rc(["\\\\boxed{4}", "\\\\boxed{5}"], ["4", "4"])[0], flush=True)
    rc.close()
    """
    p = _run_script(tmp_path, body, module=True)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert out.count("MAIN RUNS") == 1
    assert "RESULT [1.0, 0.0]" in out


def test_workers_die_with_the_parent(tmp_path):
    body = """
    from grpo_dist.rewards import RewardComputer
    import time
    rc = RewardComputer(["operator:eq"], num_workers=2, timeout_s=10)
    rc(["1"], ["1"])
    print("PIDS", *[w.proc.pid for w in rc._pool.workers], flush=True)
    time.sleep(300)
    """
    p = _run_script(tmp_path, body)
    line = p.stdout.readline()
    assert line.startswith("PIDS"), p.stderr.read()
    pids = [int(x) for x in line.split()[1:]]
    assert all(_alive(x) for x in pids)
    p.send_signal(signal.SIGKILL)
    p.wait()
    for x in pids:
        assert _wait_dead(x, 10.0), f"worker {x} outlived its parent"


def test_workers_stop_at_normal_exit_without_close(tmp_path):
    body = """
    from grpo_dist.rewards import RewardComputer
    rc = RewardComputer(["operator:eq"], num_workers=1, timeout_s=10)
    rc(["1"], ["1"])
    print("PIDS", *[w.proc.pid for w in rc._pool.workers], flush=True)
    """
    p = _run_script(tmp_path, body)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    pids = [int(x) for x in out.split("PIDS")[1].split()]
    for x in pids:
        assert _wait_dead(x, 10.0)
