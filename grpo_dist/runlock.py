"""One run per output_dir, and workers that stop when their launcher is gone.

Two runs writing the same output_dir destroy each other (each save clears the other's temporary checkpoints, metrics
interleave), and workers whose torchrun was SIGKILLed keep training and saving while a requeued job starts. So rank 0
holds an exclusive `flock` on output_dir/.grpo_dist.lock for the life of the process: the kernel releases it when the
process ends, however it ends, so a crashed run never blocks the next one. The file records who holds it (pid, host,
start time) for the message a second run gets, and is emptied on a clean release: a non-empty file whose lock is
free was left by a process that died, which is reported once. A filesystem without flock support (some NFS mounts)
only gets a warning.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

LOCK_NAME = ".grpo_dist.lock"


class OutputDirInUse(RuntimeError):
    """Another live process holds the output_dir lock."""


class OutputDirLock:
    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str:
        """Take the lock or raise OutputDirInUse naming the holder. Returns a note for the log ('' when none)."""
        import fcntl
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputDirInUse(
                    f"output_dir {self.path.parent} is in use by another grpo_dist run ({_who(holder)}): two runs "
                    f"would overwrite each other's checkpoints and metrics; wait for it to end (or stop it), or "
                    f"choose another output_dir") from None
            return f"warning: cannot lock {self.path} ({e.strerror}); make sure no other run uses this output_dir"
        previous = self._read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd
        if previous:
            return f"note: the previous run in this output_dir ({_who(previous)}) ended without releasing its lock " \
                   f"(crashed or killed); its lock was stale and is taken over"
        return ""

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, OSError):
            return {}

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # empty: released cleanly (a crash leaves the holder's record behind)
            os.close(self._fd)
            self._fd = None


def _who(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


def stop_when_parent_dies(poll_s: float = 1.0) -> None:
    """Under torchrun: when the launcher that started this worker dies (e.g. SIGKILLed, so it cannot stop its
    workers), send this process SIGTERM: the trainer finishes the step, checkpoints and exits 75, like on a
    preemption (before training starts, SIGTERM simply ends the process). Polls os.getppid() in a daemon thread,
    which also works where the kernel's parent-death signal would fire on the exit of the launching thread."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"[grpo_dist] rank {os.environ.get('RANK', '?')}: the launcher (pid {parent}) is gone; stopping",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="grpo_dist-parent-watch").start()
