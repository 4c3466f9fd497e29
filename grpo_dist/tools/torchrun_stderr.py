"""launch/torchrun.sh's filter of torchrun's stderr: everything passes through, line by line, except torchrun's own
noise when it is stopped by a signal, so the trainer's one line ("checkpoint written at step N, exiting with code
75", or the abort's) stays the last thing on the screen:

- a traceback whose exceptions include torch.distributed.elastic's SignalException (torchrun's agent raises it on
  SIGINT/SIGTERM to stop its workers; it is how torchrun stops, not a failure: the workers' exit code says how the
  run ended);
- a "--- Logging error ---" report raised inside torch.distributed.elastic (a KeyError in its log formatting when a
  signal lands mid-record).

Worker tracebacks and every other line pass unchanged. The filter ignores the stop signals: a terminal's Ctrl-C
reaches the launcher's process group, and the filter must live until torchrun's stderr closes.

    python -m grpo_dist.tools.torchrun_stderr < torchrun-stderr > /dev/stderr
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable, Iterator

SIGNAL_EXCEPTION = "torch.distributed.elastic.multiprocessing.api.SignalException"
CHAINS = ("During handling of the above exception", "The above exception was the direct cause")
_MAX_BLOCK = 2000  # lines held at most: a longer "traceback" is passed through as it is


def _is_frame(line: str) -> bool:
    return line.startswith((" ", "\t")) or line.strip() == ""


def _traceback(first: str, it: Iterator[str]) -> tuple[list[str], list[str]]:
    """The traceback starting at `first` (chained ones included) and the lines read past its end."""
    block = [first]
    for line in it:
        block.append(line)
        if len(block) > _MAX_BLOCK:
            return block, []
        if line.startswith("Traceback (most recent call last)") or _is_frame(line):
            continue
        if line.startswith(CHAINS):
            continue
        # the exception line: a chained traceback may follow after a blank line
        after = []
        for nxt in it:
            after.append(nxt)
            if nxt.strip() and not nxt.startswith(CHAINS):
                break
            if nxt.startswith(CHAINS):
                break
        if after and after[-1].startswith(CHAINS):
            block += after
            continue
        return block, after
    return block, []


def _logging_error(first: str, it: Iterator[str]) -> list[str]:
    """A logging module error report: from "--- Logging error ---" through its "Arguments:" line."""
    block = [first]
    for line in it:
        block.append(line)
        if line.startswith("Arguments:") or len(block) > _MAX_BLOCK:
            break
    return block


def filter_lines(lines: Iterable[str]) -> Iterator[str]:
    """The lines to show, in order (each with its newline)."""
    it = iter(lines)
    pending: list[str] = []
    while True:
        line = pending.pop(0) if pending else next(it, None)
        if line is None:
            return
        if line.startswith("Traceback (most recent call last)"):
            block, pending_after = _traceback(line, it)
            pending = pending_after + pending
            if not any(ln.startswith(SIGNAL_EXCEPTION) for ln in block):
                yield from block
        elif line.startswith("--- Logging error ---"):
            block = _logging_error(line, it)
            if not any("torch/distributed/elastic" in ln for ln in block):
                yield from block
        else:
            yield line


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    stdin = open(sys.stdin.fileno(), encoding="utf-8", errors="replace", newline="")
    for line in filter_lines(stdin):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
