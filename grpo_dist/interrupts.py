"""Ctrl-C (SIGINT) and SIGTERM while training.

During training the first Ctrl-C is a stop request, exactly like SIGTERM: the step in progress finishes, a
checkpoint is written and the process exits with PREEMPTED_EXIT_CODE (75). A second Ctrl-C aborts at once (exit
ABORT_EXIT_CODE, 130, as a shell reports a Ctrl-C'd program), without a traceback and without a checkpoint for the
step in progress. Before training starts (config, preflight, model loading) the first Ctrl-C aborts at once: there is
nothing to checkpoint. Each of these prints one line, on rank 0 only.

Under torchrun the workers run in sessions of their own: a terminal's Ctrl-C reaches torchrun, which sends SIGINT to
every worker; torchrun's answer to a second Ctrl-C is SIGTERM to every worker. So once a Ctrl-C has asked for a stop,
a SIGTERM aborts too. A SIGTERM (or SIGUSR1) stop request alone stays graceful however many times it comes (SLURM
signals torchrun and its workers, and torchrun forwards the signal again). torchrun SIGKILLs workers that are still
running TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after its first signal; raise it (or torchrun's
--shutdown_timeout) when a step plus a checkpoint takes longer.

The notices are written with os.write: a signal handler may run while the main thread is inside print().
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from collections.abc import Callable, Iterator

ABORT_EXIT_CODE = 130  # 128 + SIGINT
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on request, checkpoint written, run me again"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The real os._exit, taken at import: while an in-process reward function runs, os._exit is swapped for one that
# raises (rewards/grading.py), and an abort that lands then must still end the process.
_REAL_EXIT = os._exit


def _notice(is_main: bool, text: str) -> None:
    if is_main:
        try:
            os.write(2, f"[grpo_dist] {text}\n".encode())
        except OSError:
            pass


def _abort(is_main: bool, text: str) -> None:
    _notice(is_main, text)
    _REAL_EXIT(ABORT_EXIT_CODE)


def abort_before_training(is_main: bool) -> None:
    """Until training starts, Ctrl-C ends the process at once with one line (no KeyboardInterrupt traceback from
    each rank, nothing to checkpoint). GracefulStop replaces this while the training loop runs."""
    def handler(signum, frame):
        _abort(is_main, f"Ctrl-C outside the training loop: exiting at once with code {ABORT_EXIT_CODE} "
                        f"(no step in progress to checkpoint)")
    signal.signal(signal.SIGINT, handler)


class GracefulStop:
    """The signal handlers of the training loop. request_stop: what a stop request calls (the trainer's flag);
    step: the step in progress, for the messages."""

    def __init__(self, request_stop: Callable[[], None], is_main: bool, step: Callable[[], int]):
        self.request_stop, self.is_main, self.step = request_stop, is_main, step
        self.requested_by: int | None = None  # the signal of the first stop request

    def handle(self, signum, frame=None) -> None:
        if self.requested_by is None:
            self.requested_by = signum
            self.request_stop()
            if signum == signal.SIGINT:
                _notice(self.is_main, f"Ctrl-C: finishing step {self.step()}, then writing a checkpoint and exiting "
                                      f"with code 75; press Ctrl-C again to abort at once (no checkpoint)")
            return
        if signum == signal.SIGINT or self.requested_by == signal.SIGINT:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            _abort(self.is_main, f"second stop signal ({what}): aborting step {self.step()} at once, exiting with "
                                 f"code {ABORT_EXIT_CODE} without a checkpoint")
        # a repeated SIGTERM / SIGUSR1: the stop is already under way

    @contextmanager
    def installed(self) -> Iterator[GracefulStop]:
        """SIGINT, SIGTERM and SIGUSR1 handled while the block runs; the previous handlers are restored after."""
        sigs = (signal.SIGINT,) + STOP_SIGNALS
        previous = {s: signal.getsignal(s) for s in sigs}
        for s in sigs:
            signal.signal(s, self.handle)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
