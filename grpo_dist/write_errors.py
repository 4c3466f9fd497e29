"""Telling a failed write (full disk, quota, I/O error) from a programming error, whatever library raised it.

The writers of a checkpoint report a full disk each in their own way: Python's file calls raise OSError(ENOSPC),
safetensors raises SafetensorError("... No space left on device (os error 28)"), torch.save RuntimeError
("basic_ios::clear: iostream error" or "PytorchStreamWriter failed writing file"), torch.distributed.checkpoint a
CheckpointException (a BaseException) carrying each rank's. Those become one line for CheckpointError; anything
else is re-raised as the bug it is, unless the filesystem being written to is (almost) full: then the write most
likely failed for want of space, whatever the message says.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# errnos of a write the disk refused (not the program's fault)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}
# how the non-OSError writers spell those (lower case)
WRITE_MESSAGES = ("no space left on device", "os error 28", "iostream error", "disk quota exceeded",
                  "file too large", "input/output error", "failed writing file", "file write failed")
# below this many free bytes an unrecognised exception during a write counts as a full disk
NEARLY_FULL_BYTES = 1 << 20


class WriteFailed(Exception):
    """A write that failed for the disk's reasons, its one-line description naming the file (see `writing`)."""


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Around one writer call: a failed write becomes WriteFailed naming `path` (safetensors' and torch.save's own
    messages do not name the file); anything else passes through untouched."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, WriteFailed):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; the rest re-raised
        reason = describe_write_failure(e, path)
        if reason is None:
            raise
        raise WriteFailed(reason) from e


def _checkpoint_exception() -> type[BaseException]:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
        return CheckpointException
    except ImportError:  # pragma: no cover - torch without distributed
        return Exception


def describe_write_failure(e: BaseException, where: Path) -> str | None:
    """One line saying why writing `where` failed, or None when e is not a failed write (re-raise it)."""
    if isinstance(e, WriteFailed):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.strerror or e} ({e.filename or where})"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for line in lines:
        if any(m in line.lower() for m in WRITE_MESSAGES):
            return f"{line} (writing {where})"
    if isinstance(e, _checkpoint_exception()):  # DCP: each failed rank's own exception
        for exc, _ in getattr(e, "failures", {}).values():
            inner = describe_write_failure(exc, where)
            if inner:
                return inner
    free = free_bytes(where)
    if free is not None and free < NEARLY_FULL_BYTES:
        first = lines[-1] if lines else type(e).__name__
        return f"{type(e).__name__} while writing {where} with {free} bytes free on its filesystem: {first}"
    return None


def free_bytes(where: Path) -> int | None:
    """Free bytes on the filesystem of `where` (or of its nearest existing parent); None if unknown."""
    p = Path(where)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
