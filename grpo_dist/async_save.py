"""Checkpoint writes off the critical path (config key async_save, docs/fault-tolerance.md#asynchronous-saves).

A save has two parts. The foreground part, on the training thread, takes a copy of everything the checkpoint holds
(checkpoint.save_checkpoint with a BackgroundSaver): the gathered full state or the sharded state staged into host
memory, this rank's RNG, the trainer state as JSON. Training then goes on while a background thread writes the
files, fsyncs and hashes them, writes manifest.json and renames `.tmp-checkpoint-N` into place: exactly the steps
of a synchronous save, in the same order, so what counts as intact (manifest.py) is unchanged and a crash at any
moment leaves no final-named directory without its complete manifest.

Collectives: the background thread runs the save's own collectives (DCP's plan and metadata, the manifest's hash
gather, the agreement on write errors) in a gloo group of the same ranks, created once when the saver is built
(distributed.thread_group), so they never interleave with the training thread's in the training group. Every
rank starts, polls and waits for a save at the same points of the loop, and `poll` decides by an all-reduce, so
every rank runs the same collectives in the same order whichever rank's thread finishes first.

Rules: one save at a time (the next save waits for the previous one: `wait`); an error of the background write
(CheckpointError, agreed on every rank inside the thread) is raised by the next poll, the next save, or the end of
training, never dropped; the end of training and a stop request (SIGTERM, the first Ctrl-C) wait for the save in
flight before the process exits with its code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo_dist import distributed as gdist


class BackgroundSaver:
    """At most one checkpoint write running in a background thread (see the module docstring)."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        """Collective: the saver's gloo group is made here, at start, while the rendezvous store is sure to be up.
        Made at the first save instead, it could not be made by a run whose launcher had died (the store lives in
        torchrun's agent), so the checkpoint that stop is meant to write would fail."""
        self.timeout_s = timeout_s  # of the saver's collectives: distributed.timeout_s, as the training group's
        self._group = gdist.new_gloo_group_of_current(timeout_s)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._started = 0.0  # perf_counter at the start of the save (its foreground part)
        self._finished = 0.0
        self.path: Path | None = None  # the checkpoint being written

    def in_flight(self) -> bool:
        """A save was started and not yet waited for. The same on every rank: start and wait run at the same
        points of the loop everywhere."""
        return self._thread is not None

    def start(self, write: Callable[[], None], path: Path, started: float) -> None:
        """Run write() in the background (its collectives in the saver's gloo group, made at construction)."""
        assert self._thread is None, "a save is already in flight: wait() first"
        self._error, self.path, self._started = None, Path(path), started
        self._thread = threading.Thread(target=self._run, args=(write,), name="grpo_dist-save")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            with gdist.thread_group(self._group):  # None: no process group, no collectives
                write()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there by wait()
            self._error = e
        finally:
            self._finished = time.perf_counter()

    def wait(self) -> float | None:
        """Block until the save in flight is done; its total seconds (None when there was none). Raises its error
        (CheckpointError naming the checkpoint and the last good one, the same on every rank)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._finished - self._started

    def poll(self, device: torch.device) -> float | None:
        """Collective (when a save is in flight): whether every rank's write is done, and whether any failed,
        agreed by one all-reduce. Done everywhere: reaps it and returns its total seconds; failed anywhere: every
        rank waits for its own thread and raises its error (agreed inside the write); else None."""
        if self._thread is None:
            return None
        running, failed = gdist.all_reduce_max([float(self._thread.is_alive()),
                                                float(not self._thread.is_alive() and self._error is not None)],
                                               device).tolist()
        if failed or not running:
            return self.wait()
        return None

