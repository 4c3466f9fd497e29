"""Workers whose torchrun is SIGKILLed (it can no longer stop them) notice it and stop: they checkpoint, exit, and
release the output_dir lock, instead of training on and overlapping with a requeued job."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_workers_stop_when_torchrun_is_killed(tmp_path):
    from grpo_dist.runlock import OutputDirLock
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
         "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}", "max_steps=100000",
         "save_steps=0", "save_final=false", "reward_workers=0", "progress_bar=false"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        deadline = time.time() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "training did not start"
            time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 120
        while any(_alive(w) for w in workers):
            assert time.time() < deadline, "workers still training 120 s after their torchrun died"
            time.sleep(0.5)
    finally:
        proc.kill()
        for w in workers:  # ours: never leave them running, whatever failed above
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    err = proc.stderr.read()
    assert "the launcher" in err and "is gone; stopping" in err, err[-3000:]
    ckpts = list(out.glob("checkpoint-*"))
    assert ckpts, "the stop should checkpoint like a preemption"
    lock = OutputDirLock(out)
    assert lock.acquire() == ""  # released cleanly by the stopped run
    lock.release()
