"""Name the rank that died, stopped or hung when a collective fails on the others.

Without this, a surviving rank ends with only the backend's message ("Connection closed by peer", "Timed out
waiting ... for recv"), which names no rank and no stage. Here every rank publishes a heartbeat into the process
group's store (torch.distributed's default TCPStore, hosted by torchrun's agent or by rank 0):

    grpo_dist/heartbeat/rank<R> = {"phase", "step", "pid", "host", "t" (wall clock), "n" (beat counter)}

written by a daemon thread every HEARTBEAT_S seconds, and within MIN_GAP_S of a phase change. The trainer's stages
only set a string (set_phase: setup, rollout, reward, logprobs, advantage, update, metrics, eval, stop-vote,
save); the main thread never talks to the store. When a
collective raises on a surviving rank, train.py calls `describe_failure`: it reads every heartbeat, waits a little
over two beats and reads again. A peer whose counter did not move is stopped (SIGSTOP), hung outside Python or
dead (on this host its pid is checked: gone, or stopped); a peer that beats on but reports another phase or step
is hung (or slow) in that stage; a peer that ended publishes "exited" with its exit code. The lowest rank that
still beats prints one line, e.g.

    grpo_dist: rank 0: the collective in phase 'update' at step 3 failed: rank 1 last reported 'update' at step
    3, 12 s ago, and its heartbeat stopped: its process is stopped (SIGSTOP) (RuntimeError: ... Timed out ...)

and every survivor exits with PEER_FAILURE_EXIT_CODE. Before that, while the run still waits, rank 0's thread
reads the heartbeats every few beats and warns once per peer whose counter stood still for half of
distributed.timeout_s (at most 60 s): under NCCL a timed-out collective may abort the process without a Python
error, and that warning is then the line that names the rank. Heartbeat times are wall clock: across hosts,
"s ago" is off by the clock skew (the counter test is not). Limits: the store lives in torchrun's agent (or, without
torchrun, in rank 0): when its host dies every survivor says so instead of naming a rank; a rank that hangs in
Python keeps beating and is named by its phase and step differing from the survivor's.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

PEER_FAILURE_EXIT_CODE = 4  # a collective failed because another rank died, stopped or hung (named on stderr)
HEARTBEAT_S = 2.0
_KEY = "grpo_dist/heartbeat/rank{}"
_READ_TIMEOUT = timedelta(seconds=5)

_phase: dict = {"phase": "setup", "step": 0}  # this rank's stage: plain assignments from the trainer
_beat: _Heartbeat | None = None


_changed = threading.Event()  # wakes the heartbeat thread: a new phase is published within MIN_GAP_S
MIN_GAP_S = 0.25  # at most 4 beats a second per rank into the one store, however fast the phases change


def set_phase(phase: str, step: int | None = None) -> None:
    """Record the stage this rank is in (and the step it works on); cheap enough for every stage of every step."""
    _phase["phase"] = phase
    if step is not None:
        _phase["step"] = step
    _changed.set()


def current() -> tuple[str, int]:
    return str(_phase["phase"]), int(_phase["step"])


class _Heartbeat:
    def __init__(self, store, rank: int, world_size: int, interval: float, stale_s: float):
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self.stale_s = stale_s
        self.count = 0
        self._peers: dict = {}  # rank 0: rank -> (its beat counter, local time it last changed, warned)
        self._check_every = max(interval, stale_s / 4)
        self._next_check = time.monotonic()
        self.code: int | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one beat at a time (the thread's, and the final one)
        self.thread = threading.Thread(target=self._run, daemon=True, name="grpo_dist-heartbeat")

    def record(self) -> str:
        self.count += 1
        rec = {"phase": _phase["phase"], "step": _phase["step"], "pid": os.getpid(), "host": socket.gethostname(),
               "t": time.time(), "n": self.count}
        if self.code is not None:
            rec["exit_code"] = self.code
        return json.dumps(rec)

    def beat(self, wait_s: float = -1) -> None:
        # wait_s: the final beat does not wait long for a beat stuck on a store whose host is stopped
        if not self._lock.acquire(timeout=wait_s):
            return
        try:
            self.store.set(_KEY.format(self.rank), self.record())
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to report to
            pass
        finally:
            self._lock.release()

    def _run(self) -> None:
        while not self._stop.is_set():
            _changed.clear()
            self.beat()
            if self.rank == 0 and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + self._check_every
                self.warn_stale_peers()
            self._stop.wait(MIN_GAP_S)  # then changes of the last MIN_GAP_S are published at once
            _changed.wait(self.interval)  # a phase change, or the next regular beat

    def warn_stale_peers(self) -> None:
        """Rank 0, every few beats: one warning per peer whose heartbeat has not moved for stale_s seconds, while
        the run still waits on it (NCCL may abort the process at its timeout without a Python error: this line
        is then what names the rank)."""
        beats = _read(self.store, self.world_size, self.rank)
        now = time.monotonic()
        for r, rec in (beats or {}).items():
            if rec is None:
                continue
            n, since, warned = self._peers.get(r, (None, now, False))
            if rec["n"] != n:
                self._peers[r] = (rec["n"], now, False)
            elif not warned and now - since >= self.stale_s:
                self._peers[r] = (n, since, True)
                print(f"grpo_dist: rank {self.rank}: warning: rank {r}'s heartbeat has not moved for "
                      f"{now - since:.0f} s; it last reported '{rec['phase']}' at step {rec['step']} (stopped, hung "
                      f"or dead?)", file=sys.stderr, flush=True)

    def finish(self, code: int) -> None:
        """A last beat that says this rank ended, and with which code (a peer waiting on it then knows)."""
        self._stop.set()
        _changed.set()
        self.code = code
        _phase["phase"] = "exited"
        try:
            self.store.set_timeout(timedelta(seconds=2))  # the store's host may be gone: do not wait on it
        except Exception:  # noqa: BLE001
            pass
        self.beat(wait_s=2.0)


def start(rank: int, world_size: int, timeout_s: float = 600, interval: float = HEARTBEAT_S) -> None:
    """Start this rank's heartbeat thread (after init_process_group; nothing to do in a world of one). Rank 0
    warns when a peer's heartbeat stands still for half the collective timeout (at most 60 s)."""
    global _beat
    if world_size < 2 or _beat is not None:
        return
    import torch.distributed as dist
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to publish into: failures are reported without names
        return
    _beat = _Heartbeat(store, rank, world_size, interval, stale_s=max(3 * interval, min(60.0, timeout_s / 2)))
    _beat.beat()
    _beat.thread.start()


def finish(code: int) -> None:
    global _beat
    if _beat is not None:
        _beat.finish(code)
        _beat = None


def is_collective_failure(e: BaseException) -> bool:
    """An error of torch.distributed's collectives or store (a peer gone or too slow), not of the trainer."""
    import torch.distributed as dist
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    # gloo's errors name their source file (.../gloo/transport/tcp/...), NCCL's say NCCL
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer"))


def _read(store, world_size: int, rank: int) -> dict | None:
    """Every peer's last heartbeat (None: never published), or None when the store does not answer."""
    keys = [_KEY.format(r) for r in range(world_size) if r != rank]
    try:
        present = store.check(keys) and keys  # all there: the common case, one round trip each
        if not present:
            present = [k for k in keys if store.check([k])]
        return {r: json.loads(store.get(_KEY.format(r))) if _KEY.format(r) in present else None
                for r in range(world_size) if r != rank}
    except Exception:  # noqa: BLE001 - the store's host (rank 0, or the launcher) is gone or stopped
        return None


def _process_state(rec: dict) -> str | None:
    """'gone' / 'stopped' / None (running, or on another host: unknown) for the pid in a heartbeat."""
    if rec.get("host") != socket.gethostname():
        return None
    try:
        state = Path(f"/proc/{rec['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, KeyError):
        return "gone"
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state)


def describe_failure(e: BaseException, settle_s: float | None = None) -> tuple[str | None, int]:
    """(the one line to print, or None where a lower surviving rank prints it; the exit code) for a collective
    that raised `e` on this rank. Blocks for about two heartbeats (to see which peers still beat)."""
    phase, step = current()
    cause = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    head = f"grpo_dist: rank {_rank()}: the collective in phase '{phase}' at step {step} failed"
    beat = _beat
    if beat is None:
        return f"{head} ({cause}); no heartbeats to name the rank that failed", PEER_FAILURE_EXIT_CODE
    try:
        beat.store.set_timeout(_READ_TIMEOUT)  # the collective is lost: a dead store host must not hang us
    except Exception:  # noqa: BLE001
        pass
    first = _read(beat.store, beat.world_size, beat.rank)
    time.sleep(2 * beat.interval + 0.5 if settle_s is None else settle_s)
    second = _read(beat.store, beat.world_size, beat.rank) if first is not None else None
    if first is None or second is None:
        return (f"{head}: the heartbeat store does not answer: its host (rank 0, or the torchrun agent) is likely "
                f"the one that died or stopped ({cause})"), PEER_FAILURE_EXIT_CODE
    now = time.time()
    culprits, alive = [], [beat.rank]
    for r in sorted(second):
        a, b = first[r], second[r]
        if b is None:
            culprits.append(f"rank {r} never published a heartbeat")
            continue
        where = f"'{b['phase']}' at step {b['step']}"
        if "exit_code" in b:
            culprits.append(f"rank {r} exited with code {b['exit_code']} (in phase {where})")
            continue
        state = _process_state(b)
        if state == "gone":
            culprits.append(f"rank {r} is dead (pid {b['pid']} is gone); it last reported {where}, "
                            f"{now - b['t']:.0f} s ago")
        elif a is not None and a.get("n") == b.get("n"):
            how = "its process is stopped (SIGSTOP)" if state == "stopped" else \
                "it is stopped, hung outside Python or dead"
            culprits.append(f"rank {r} last reported {where}, {now - b['t']:.0f} s ago, and its heartbeat "
                            f"stopped: {how}")
        elif (b["phase"], b["step"]) != (phase, step):
            alive.append(r)
            culprits.append(f"rank {r} is alive but in phase {where} (hung or slow there)")
        else:
            alive.append(r)
    if min(alive) != beat.rank:
        return None, PEER_FAILURE_EXIT_CODE  # a lower rank that still beats says it
    who = "; ".join(culprits) if culprits else "every other rank still beats in the same phase and step"
    return f"{head}: {who} ({cause})", PEER_FAILURE_EXIT_CODE


def peer_report(peer: int) -> str | None:
    """What a peer's heartbeat last said, for a line about a wait on it that failed ("it last reported 'rollout'
    at step 3, 31 s ago: its process is stopped (SIGSTOP)"); None without heartbeats or a store that answers."""
    beat = _beat
    if beat is None or not 0 <= peer < beat.world_size or peer == beat.rank:
        return None
    try:
        beat.store.set_timeout(_READ_TIMEOUT)
    except Exception:  # noqa: BLE001
        pass
    rec = (_read(beat.store, beat.world_size, beat.rank) or {}).get(peer)
    if rec is None:
        return None
    if "exit_code" in rec:
        return f"it exited with code {rec['exit_code']} in phase '{rec['phase']}' at step {rec['step']}"
    state = {"gone": ": its process is gone", "stopped": ": its process is stopped (SIGSTOP)"}.get(
        _process_state(rec) or "", "")
    return f"it last reported '{rec['phase']}' at step {rec['step']}, {time.time() - rec['t']:.0f} s ago{state}"


def _rank() -> int:
    return _beat.rank if _beat is not None else int(os.environ.get("RANK", 0))


def report(e: BaseException) -> int:
    """Print describe_failure's line (on one rank) and return the exit code. The launcher's SIGTERM (torchrun
    stops the survivors once a worker died) is ignored meanwhile: the training loop's handlers are gone, and the
    default action would end this rank before it has said which peer failed or written its exit code."""
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    line, code = describe_failure(e)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
