"""Ctrl-C: the first one during training stops like SIGTERM (finish the step, checkpoint, exit 75, one line), the
second aborts at once (exit 130, one line, no traceback). The runs get their Ctrl-C from GRPO_DIST_FAULT=sigint@stepN
(faults.py): SIGINT to the process group a terminal's Ctrl-C reaches, i.e. torchrun's under torchrun, in the middle
of step N. Every run sits in a session of its own, so the signal never reaches pytest."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_dist import interrupts

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml"]
COMMON = ["rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "data.limit=8", "max_steps=50",
          "save_steps=0", "progress_bar=false", "distributed.timeout_s=30"]
LINE_75 = "Ctrl-C: finishing step 2, then writing a checkpoint and exiting with code 75; press Ctrl-C again to " \
          "abort at once (no checkpoint)"


def _run(cmd, out, fault, extra=(), **env):
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GRPO_DIST_FAULT=fault, **env)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), e.get("PYTHONPATH", "")])
    return subprocess.run(cmd + TRAIN + COMMON + [f"output_dir={out}"] + list(extra), cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=300, start_new_session=True)


# ------------------------------------------------------------------------------------------- the handler itself
@pytest.fixture
def handler(monkeypatch):
    calls, notices = [], []
    monkeypatch.setattr(interrupts, "_notice", lambda is_main, text: notices.append(text))

    def fake_exit(code):
        raise SystemExit(code)
    monkeypatch.setattr(interrupts, "_REAL_EXIT", fake_exit)  # the abort's exit (the real os._exit, see interrupts)
    return interrupts.GracefulStop(lambda: calls.append("stop"), True, lambda: 22), calls, notices


@pytest.mark.fast
def test_first_ctrl_c_requests_a_stop_and_the_second_aborts_with_130(handler):
    h, calls, notices = handler
    h.handle(signal.SIGINT)
    assert calls == ["stop"] and notices == ["Ctrl-C: finishing step 22, then writing a checkpoint and exiting with "
                                             "code 75; press Ctrl-C again to abort at once (no checkpoint)"]
    with pytest.raises(SystemExit) as e:
        h.handle(signal.SIGINT)
    assert e.value.code == 130 and calls == ["stop"]
    assert notices[1] == "second stop signal (Ctrl-C): aborting step 22 at once, exiting with code 130 without a " \
                         "checkpoint"


@pytest.mark.fast
def test_sigterm_after_ctrl_c_aborts_but_repeated_sigterms_stay_graceful(handler):
    h, calls, notices = handler
    h.handle(signal.SIGTERM)
    h.handle(signal.SIGTERM)  # SLURM signals the workers, torchrun forwards it again: still one graceful stop
    h.handle(signal.SIGUSR1)
    assert calls == ["stop"] and notices == []  # SIGTERM stops quietly, as before
    h2 = interrupts.GracefulStop(lambda: calls.append("stop2"), True, lambda: 5)
    h2.handle(signal.SIGINT)
    with pytest.raises(SystemExit) as e:  # torchrun's answer to a second Ctrl-C is SIGTERM to every worker
        h2.handle(signal.SIGTERM)
    assert e.value.code == 130 and "second stop signal (SIGTERM)" in notices[-1]


@pytest.mark.fast
def test_handlers_are_restored_after_the_loop(handler):
    h, _, _ = handler
    before = signal.getsignal(signal.SIGINT)
    with h.installed():
        assert signal.getsignal(signal.SIGINT) == h.handle
        assert signal.getsignal(signal.SIGTERM) == h.handle
    assert signal.getsignal(signal.SIGINT) == before


@pytest.mark.fast
def test_ctrl_c_before_training_exits_130_with_one_line(handler, monkeypatch):
    _, _, notices = handler
    before = signal.getsignal(signal.SIGINT)
    try:
        interrupts.abort_before_training(is_main=True)
        with pytest.raises(SystemExit) as e:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, before)
    assert e.value.code == 130 and notices == [
        "Ctrl-C outside the training loop: exiting at once with code 130 (no step in progress to checkpoint)"]


# ------------------------------------------------------------------------------------------------------- runs
def _no_tracebacks(text):
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_ctrl_c_in_one_process_checkpoints_the_step_and_exits_75(tmp_path):
    """reward_workers=1: the Ctrl-C reaches the grading child too (same process group); it must not die of it."""
    out = tmp_path / "run"
    r = _run([sys.executable], out, "sigint@step2", ["reward_workers=1"])
    assert r.returncode == 75, r.stderr[-3000:]
    assert r.stderr.count(LINE_75) == 1
    assert "checkpoint written at step 2, exiting with code 75" in r.stdout
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    _no_tracebacks(r.stderr)


def test_second_ctrl_c_aborts_at_once_with_130_and_one_line(tmp_path):
    out = tmp_path / "run"
    r = _run([sys.executable], out, "sigint@step2,sigint@step2", ["reward_workers=0"])
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.count(LINE_75) == 1
    assert r.stderr.count("[grpo_dist] second stop signal (Ctrl-C): aborting step 2 at once, exiting with code 130 "
                          "without a checkpoint") == 1
    assert not list(out.glob("checkpoint-*")) and "checkpoint written" not in r.stdout
    _no_tracebacks(r.stderr)


def test_ctrl_c_through_torchrun_two_ranks_checkpoints_and_both_exit_75(tmp_path):
    """The SIGINT goes to torchrun's process group (as from a terminal); torchrun sends it on to both workers."""
    out, codes = tmp_path / "run", tmp_path / "codes"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "localhost:0"]
    r = _run(torchrun, out, "sigint@step2@rank0", ["reward_workers=0"], GRPO_DIST_EXIT_CODE_DIR=str(codes))
    assert sorted(p.read_text().strip() for p in codes.iterdir()) == ["75", "75"], r.stderr[-3000:]
    assert r.stderr.count(LINE_75) == 1  # rank 0 only
    assert r.stdout.count("checkpoint written at step 2, exiting with code 75") == 1
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    # torchrun's own exit (1) and its SignalException are torchrun's; the workers print no traceback
    worker_lines = [ln for ln in r.stderr.splitlines() if "torch/distributed/elastic" not in ln]
    assert not any("KeyboardInterrupt" in ln or "gloo" in ln.lower() for ln in worker_lines), r.stderr[-3000:]
