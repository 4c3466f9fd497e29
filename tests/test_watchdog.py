"""When a rank stops (a real SIGSTOP), dies (a real SIGKILL) or calls os._exit from a reward function, the other
rank is not left with the backend's anonymous error: rank 0 prints one line naming the rank and the phase it was
last in, and exits with PEER_FAILURE_EXIT_CODE (grpo_dist/watchdog.py). Two ranks under torchrun, smoke config,
distributed.timeout_s=10; faults from GRPO_DIST_FAULT (grpo_dist/faults.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
            "reward_workers=0", "progress_bar=false", "save_steps=0", "save_final=false", "max_steps=4",
            "distributed.timeout_s=10", "rewards=[{function: 'reward_fns:odd_length'}]"]
pytestmark = [pytest.mark.slow,  # torchrun, 2 ranks
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")]


def _start(tmp_path, *extra, **env):
    codes = tmp_path / "codes"
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GRPO_DIST_EXIT_CODE_DIR=str(codes),
             PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]), **env)
    proc = subprocess.Popen(TORCHRUN + [f"output_dir={tmp_path / 'run'}", *extra], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, codes


def _children(pid):
    return [int(x) for t in Path(f"/proc/{pid}/task").iterdir() for x in (t / "children").read_text().split()]


def _lines(err):
    return [x for x in err.splitlines() if x.startswith("grpo_dist: rank") and ": warning: " not in x]


def test_stopped_rank_is_named_with_its_phase(tmp_path):
    proc, codes = _start(tmp_path, GRPO_DIST_FAULT="stop@step2@rank1")
    workers = []
    try:
        deadline = time.time() + 180
        while not (codes / "rank0").is_file():  # rank 0 gave up on the stopped rank 1
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            workers = workers or _children(proc.pid)
            time.sleep(0.2)
    finally:
        for w in workers:  # the stopped rank: torchrun's SIGTERM waits for a SIGCONT
            try:
                if Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    os.kill(w, signal.SIGKILL)
            except (OSError, IndexError):
                pass
        out, err = proc.communicate(timeout=120)
    assert (codes / "rank0").read_text().strip() == "4", err[-3000:]
    assert "rank 1 stops itself (SIGSTOP at step 2)" in err
    lines = _lines(err)
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("grpo_dist: rank 0: the collective in phase 'update' at step 2 failed: rank 1 last "
                               "reported 'update' at step 2"), lines[0]
    assert "its process is stopped (SIGSTOP)" in lines[0] and "Timed out" in lines[0], lines[0]
    # before that, while rank 0 still waited: a live warning (after half of distributed.timeout_s=10: 6 s)
    assert "grpo_dist: rank 0: warning: rank 1's heartbeat has not moved for " in err, err[-3000:]
    assert "it last reported 'update' at step 2 (stopped, hung or dead?)" in err


def test_dead_rank_is_named(tmp_path):
    proc, codes = _start(tmp_path, GRPO_DIST_FAULT="kill@step2@rank1")
    out, err = proc.communicate(timeout=180)
    assert (codes / "rank0").is_file(), err[-3000:]
    assert (codes / "rank0").read_text().strip() == "4", err[-3000:]
    lines = _lines(err)
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("grpo_dist: rank 0: the collective in phase 'update' at step 2 failed: rank 1 is "
                               "dead (pid "), lines[0]
    assert "it last reported '" in lines[0], lines[0]  # the phase published before the kill (4 beats/s at most)


def test_os_exit_in_a_reward_on_one_rank_does_not_end_that_rank(tmp_path):
    proc, codes = _start(tmp_path, "max_steps=2", "report_to=[jsonl]",
                         "rewards=[{function: 'reward_fns:calls_os_exit'}, {function: 'reward_fns:odd_length'}]",
                         EXIT_RANK="1")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert sorted(p.read_text().strip() for p in codes.iterdir()) == ["0", "0"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_errors/calls_os_exit"] for m in rows] == [8, 8]  # rank 1's 2 prompts x 4, each step
    assert err.count("reward function 'calls_os_exit'") == 1 and "os._exit(0) called by a reward function" in err
