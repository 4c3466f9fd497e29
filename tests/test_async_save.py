"""Asynchronous checkpoint saves (config key async_save, grpo_dist/async_save.py), in one process on the tiny model.

The background write is held back at its start (a gate on checkpoint._SaveJob.run in the saver's thread) so that
training really goes on while it waits: the checkpoint must still hold the state of its own step, nothing may look
intact before the manifest is written and the rename done, the next save waits, a failed write is raised (one line
naming the checkpoint), and a stop request waits for the save in flight. The 2-rank bitwise resume from background
saves (full and sharded) is tests/test_resume.py's.
"""

import copy
import errno
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import in_process, resume_trainer, tensors_equal


@pytest.fixture
def gate(monkeypatch):
    """An Event that the background write waits for before it starts (the training thread's writes pass)."""
    from grpo_dist import checkpoint as ckpt
    event, run = threading.Event(), ckpt._SaveJob.run

    def gated(self):
        if threading.current_thread() is not threading.main_thread():
            assert event.wait(60), "the test never opened the gate"
        run(self)
    monkeypatch.setattr(ckpt._SaveJob, "run", gated)
    return event


def _state(tr):
    model_sd, optim_sd = tr.engine.gather_full_state()
    return copy.deepcopy((model_sd, optim_sd))  # the one-process engine's dicts are its live tensors


@pytest.mark.parametrize("save_format", ["full", "sharded"])
def test_background_save_holds_its_steps_state_and_looks_intact_only_when_done(gate, tmp_path, save_format, one_thread):
    from grpo_dist import checkpoint as ckpt

    def run():
        out = tmp_path / "run"
        tr = resume_trainer([f"output_dir={out}", f"save_format={save_format}"])
        tr.train_step()
        want = _state(tr)
        path = tr.save(background=True)
        # written in the background: only the temporary copy exists, nothing that looks like a checkpoint
        assert tr.checkpointer.saver.in_flight() and not path.exists() and list(out.glob(".tmp-checkpoint-*"))
        assert ckpt.latest_checkpoint(out) is None
        tr.train_step()  # weights and moments change while the write waits
        assert not tensors_close(_state(tr)[0], want[0])
        gate.set()
        total = tr.checkpointer.saver.wait()
        assert total is not None and total > 0
        assert ckpt.verify_checkpoint(path, check_hashes=True) is None
        assert not list(out.glob(".tmp-checkpoint-*"))
        if save_format == "full":
            weights = load_file(str(path / "model.safetensors"))
            tensors_equal(weights, {k: want[0][k] for k in weights}, "weights")
            tensors_equal(torch.load(path / "optimizer.pt", weights_only=False), want[1], "optimizer")
        else:  # a fresh trainer loads the DCP shards: the state of step 1
            again = resume_trainer([f"output_dir={tmp_path / 'again'}", f"resume_from_checkpoint={path}",
                                    "save_format=sharded"])
            got = _state(again)
            tensors_equal(got[0], want[0], "weights")
            tensors_equal(got[1]["state"], want[1]["state"], "optimizer")
    in_process(run)


def tensors_close(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_next_save_waits_for_the_one_in_flight(gate, tmp_path, one_thread):
    from grpo_dist import checkpoint as ckpt

    def run():
        out = tmp_path / "run"
        tr = resume_trainer([f"output_dir={out}"])
        tr.train_step()
        first = tr.save(background=True)
        tr.train_step()
        threading.Timer(0.5, gate.set).start()
        t0 = time.perf_counter()
        second = tr.save(background=True)
        blocked = time.perf_counter() - t0
        assert blocked >= 0.5, blocked  # it waited for the first one ...
        assert ckpt.verify_checkpoint(first, check_hashes=True) is None  # ... which is in place
        times = tr.checkpointer.save_times(wait=True)
        assert ckpt.verify_checkpoint(second, check_hashes=True) is None
        # the second save's blocking time includes the wait; its own time (time_save_s) starts after it
        assert times["time_save_blocking_s"] >= 0.5 and 0 < times["time_save_s"] < times["time_save_blocking_s"]
    in_process(run)


def test_a_failed_background_write_is_raised_at_the_next_step_with_one_line(tmp_path, monkeypatch, one_thread):
    from grpo_dist import checkpoint as ckpt
    save = ckpt._save_optimizer

    def full_disk(optim_sd, tmp):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "optimizer.pt"))
        save(optim_sd, tmp)
    monkeypatch.setattr(ckpt, "_save_optimizer", full_disk)

    def run():
        out = tmp_path / "run"
        tr = resume_trainer([f"output_dir={out}", "save_steps=1"])
        with pytest.raises(ckpt.CheckpointError) as err:
            tr.train()
        return tr.step, str(err.value), out
    step, msg, out = in_process(run)
    assert step == 2, "raised by the poll after the next step, not later"
    assert "\n" not in msg
    assert msg.startswith(f"writing checkpoint-1 in {out} failed: rank 0: No space left on device "
                          f"({out}/.tmp-checkpoint-1/optimizer.pt)"), msg
    assert "the last good checkpoint is none" in msg, msg
    assert not list(out.glob("*checkpoint-*"))


def test_a_stop_request_waits_for_the_save_in_flight_then_exits_75(tmp_path, monkeypatch, one_thread):
    from grpo_dist import checkpoint as ckpt
    from grpo_dist.trainer import PREEMPTED_EXIT_CODE
    run_job = ckpt._SaveJob.run

    def slow(self):
        time.sleep(1.0)
        run_job(self)
    monkeypatch.setattr(ckpt._SaveJob, "run", slow)

    def run():
        out = tmp_path / "run"
        tr = resume_trainer([f"output_dir={out}"])
        tr.request_stop()  # as SIGTERM's handler does: the step finishes, a checkpoint is written, exit 75
        code = tr.train()
        assert code == PREEMPTED_EXIT_CODE and not tr.checkpointer.saver.in_flight()
        assert ckpt.verify_checkpoint(out / "checkpoint-1", check_hashes=True) is None
    in_process(run)


@pytest.mark.parametrize("async_save", [True, False])
def test_save_times_are_in_the_line_of_the_step_after_the_save(tmp_path, async_save, one_thread):
    def run():
        out = tmp_path / "run"
        tr = resume_trainer([f"output_dir={out}", "save_steps=1", "max_steps=2", f"async_save={async_save}"])
        assert tr.train() == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, second = in_process(run)
    assert "time_save_blocking_s" not in first and second["time_save_blocking_s"] > 0
    if not async_save:  # the whole save blocked
        assert second["time_save_s"] == second["time_save_blocking_s"]
    elif "time_save_s" in second:  # the background write was done by the poll after step 2
        assert second["time_save_s"] >= second["time_save_blocking_s"]
