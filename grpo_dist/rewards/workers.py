"""What every grading worker process shares, per-item (grading.py) and batch (batch.py) alike: resolving a
``module:function`` spec, checking a score, the worker's start (worker_preamble: die with the parent, reap its
process group, protocol pipes off stdin/stdout) and protocol loop (serve), and the parent's start and kill of a
worker. Below grading and batch, which both use it, so neither imports the other to get it."""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def resolve_reward_function(spec: str) -> Callable[[str, str], float]:
    """``"package.module:function"`` -> the function (``function`` may be dotted)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward function spec {spec!r} must look like 'package.module:function'")
    mod_name, attr = (x.strip() for x in spec.split(":"))
    if not mod_name or not attr:
        raise ValueError(f"reward function spec {spec!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {mod_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            found = hasattr(obj, part)
        except ImportError as e:  # a lazy attribute whose optional package is missing (math_verify_reward)
            raise ValueError(f"reward function {spec!r}: {e}") from e
        if not found:
            raise ValueError(f"reward function {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {spec!r}: {attr!r} is not callable")
    return obj


def check_score(v) -> tuple[float, str | None]:
    """(score, None) for a finite number; (0.0, what is wrong) for anything else."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
        hint = " (a reward function scores one completion: fn(completion, reference) -> float)" \
            if isinstance(v, (list, tuple)) else ""
        return 0.0, f"returned {type(v).__name__} {short_repr(v)}, not a number{hint}"
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError) as e:
        return 0.0, f"returned {type(v).__name__} {short_repr(v)}: {e}"
    if not math.isfinite(f):
        return 0.0, f"returned {f}"
    return f, None



def short_repr(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."



def serve(proto_in, proto_out, answer) -> None:  # pragma: no cover - runs in the child process
    """A worker's protocol loop: say ready, then for each request line (JSON) write every dict that
    answer(request) yields as a line; exit when the parent closes the pipe."""
    proto_out.write(b'{"ready": 1}\n')
    buf = b""
    while True:
        chunk = proto_in.read(1 << 20)
        if not chunk:
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            for out in answer(json.loads(line)):
                proto_out.write(json.dumps(out).encode() + b"\n")


def worker_preamble():  # pragma: no cover - runs in the child process
    """What every grading worker (per item, or batch: rewards/batch.py) does before any user code runs: die with
    its parent (PR_SET_PDEATHSIG, and a thread watching the parent pid), fork the reaper of its process group, and
    move the protocol pipes off stdin/stdout (user code sees /dev/null as stdin and stderr as stdout). Returns
    the protocol's (input, output) files. argv[1] is the parent's pid."""
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    try:  # SIGKILL this process when the parent dies (Linux)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass

    def watchdog():
        while True:
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.5)

    _start_group_reaper()
    threading.Thread(target=watchdog, daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches this child too: the trainer decides
    if os.getppid() != parent:
        os._exit(0)
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto_in, proto_out


def _start_group_reaper() -> None:  # pragma: no cover - runs in the worker process
    """Fork the reaper: it waits for this worker to end, however it ends (SIGKILL included), then SIGKILLs the
    worker's process group, i.e. whatever the reward functions forked. Forked before any user code runs and
    before any thread starts; it keeps no descriptor of the protocol pipes (the parent sees EOF at once)."""
    worker = os.getpid()
    if os.fork() != 0:
        return
    try:
        os.close(0)
        os.close(1)
        while os.getppid() == worker:
            time.sleep(0.5)
        os.killpg(worker, signal.SIGKILL)  # the worker leads the group: its pid names it
    finally:
        os._exit(0)


# --------------------------------------------------------------------------- parent side
def start_worker(code: str) -> subprocess.Popen:
    """A grading worker running `code` (which calls worker_preamble first) in a fresh interpreter, leading a
    process group of its own (a session), so kill_worker_group reaches whatever its reward functions fork."""
    return subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=_worker_env(), close_fds=True, start_new_session=True)


def kill_worker_group(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's whole process group (the worker, its reaper, anything a reward function forked), also
    when the worker itself has exited already; close its pipes and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.kill()
    except OSError:
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()  # type: ignore[union-attr]
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def _worker_env() -> dict:
    env = dict(os.environ)
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    return env
