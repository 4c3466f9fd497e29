"""Batch reward grading in worker processes with a hard per-item time limit.

``RewardComputer`` grades (completion, reference) pairs with one or more
reward functions named by ``"module:function"`` specs.  With ``num_workers > 0``
each function call runs in a separate worker *process*; the parent waits for
each item (items go out in chunks, answered one line each) at most ``timeout_s`` seconds and otherwise kills that worker
(SIGKILL, so no runaway computation survives), scores the item 0.0 and starts
a replacement.  Timing is done in the parent with ``select`` on the worker's
pipe, so it works from any thread and needs no signals.

Why plain subprocesses and not ``multiprocessing``: workers are started with
``subprocess.Popen([sys.executable, "-c", ...])``, i.e. a fresh interpreter, as
with the ``spawn`` start method (no ``fork`` of a parent that has torch, CUDA or
NCCL threads), but without re-importing the parent's ``__main__``: under
``python -m grpo_dist.train`` / torchrun, ``spawn`` and ``forkserver`` would
re-import the training script (and torch) in every worker.  A worker only
imports this package, resolves the specs by name, and talks JSON lines over its
own stdin/stdout (the protocol uses private file descriptors, so user functions
that print cannot corrupt it).

Workers never outlive the parent: they exit on EOF of their request pipe, ask
the kernel to SIGKILL them when the parent dies (``PR_SET_PDEATHSIG`` on
Linux), poll the parent pid from a watchdog thread, and are killed by
``close()``, by the context manager, by garbage collection and at interpreter
exit.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable

__all__ = ["resolve_reward_function", "RewardComputer"]

_START_TIMEOUT_S = 180.0   # a fresh worker must report ready within this time
_MAX_ATTEMPTS = 2          # an item whose worker crashed is retried once
_MAX_CHUNK = 32            # items per request to a worker
_MAX_CHUNK_BYTES = 4 << 20
_MAX_ERROR_CHARS = 4000    # of an error message / traceback sent back by a worker


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
        if not hasattr(obj, part):
            raise ValueError(f"reward function {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {spec!r}: {attr!r} is not callable")
    return obj


def _check_score(v) -> tuple[float, str | None]:
    """(score, None) for a finite number; (0.0, what is wrong) for anything else."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
        hint = " (a reward function scores one completion: fn(completion, reference) -> float)" \
            if isinstance(v, (list, tuple)) else ""
        return 0.0, f"returned {type(v).__name__} {_short(v)}, not a number{hint}"
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError) as e:
        return 0.0, f"returned {type(v).__name__} {_short(v)}: {e}"
    if not math.isfinite(f):
        return 0.0, f"returned {f}"
    return f, None


LENGTH_KWARGS = ("completion_length", "max_completion_length")


def length_kwargs_of(fn) -> tuple[str, ...]:
    """Which of LENGTH_KWARGS the reward function names as parameters (grpo_dist.rewards.length)."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(k for k in LENGTH_KWARGS if k in params)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _call_safely(fn, completion, reference, **kwargs) -> tuple[float, str | None]:
    """(score, error): a function that raises or returns a non-number scores 0.0, with the reason (a traceback for
    an exception)."""
    try:
        return _check_score(fn(completion, reference, **kwargs))
    except Exception:  # noqa: BLE001 - a failing reward scores 0.0; the caller counts and reports it
        return 0.0, "raised " + traceback.format_exc(limit=8)[-_MAX_ERROR_CHARS:]


# --------------------------------------------------------------------------- worker side
def _worker_main() -> None:  # pragma: no cover - runs in the child process
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    try:  # SIGKILL this process when the parent dies (Linux)
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass

    def watchdog():
        while True:
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.5)

    threading.Thread(target=watchdog, daemon=True).start()
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches this child too: the trainer decides
    if os.getppid() != parent:
        os._exit(0)

    # private protocol descriptors; user code sees /dev/null as stdin and stderr as stdout
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    funcs: dict = {}
    proto_out.write(b'{"ready": 1}\n')
    buf = b""
    while True:
        chunk = proto_in.read(1 << 20)
        if not chunk:
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)  # {"items": [[spec, completion, reference], ...]}
            for spec, completion, reference in req["items"]:
                try:
                    fn = funcs.get(spec) or funcs.setdefault(spec, resolve_reward_function(spec))
                    score, err = _call_safely(fn, completion, reference)
                except Exception as e:  # noqa: BLE001 - resolving the spec failed
                    score, err = 0.0, f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
                out: dict[str, float | str] = {"v": score}
                if err:
                    out["e"] = err
                proto_out.write(json.dumps(out).encode() + b"\n")  # at once: the parent's clock


# --------------------------------------------------------------------------- parent side
def _worker_env() -> dict:
    env = dict(os.environ)
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    return env


class _Worker:
    def __init__(self):
        cmd = [sys.executable, "-c",
               "from grpo_dist.rewards.grading import _worker_main; _worker_main()",
               str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=_worker_env(), close_fds=True)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.chunk = deque()      # indices of the items sent and not yet answered
        self.deadline = time.monotonic() + _START_TIMEOUT_S

    def send(self, payload: bytes, deadline: float) -> bool:
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        self.deadline = deadline
        return True

    def read_lines(self):
        """New complete lines, or None on EOF (worker died)."""
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        lines = self.buf.split(b"\n")
        self.buf = lines.pop()
        return lines

    def kill(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def close(self):
        try:
            self.proc.stdin.close()  # EOF: the worker exits by itself
        except OSError:
            pass
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _shutdown(workers: list, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child must not kill its parent's workers
        return
    while workers:
        workers.pop().close()


class _Pool:
    def __init__(self, num_workers: int, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.n = num_workers
        self.workers: list = []
        self.stats = {"timeouts": 0, "crashes": 0, "restarts": 0}
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, os.getpid())
        for _ in range(num_workers):
            self.workers.append(_Worker())

    def _replace(self, w):
        w.kill()
        self.workers.remove(w)
        self.stats["restarts"] += 1
        self.workers.append(_Worker())

    def grade(self, tasks: list) -> tuple[list, list]:
        """tasks: [(spec, completion, reference)] -> (scores, errors: None or what went wrong, per item).

        Each ready worker gets a chunk of items; it answers one line per item, and
        the parent allows ``timeout_s`` per item (the clock restarts at each
        answer).  Raises RuntimeError if no worker can be started.
        """
        results = [0.0] * len(tasks)
        self._errors = errors = [None] * len(tasks)  # type: list[str | None]
        attempts = [0] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.chunk for w in self.workers):
            for w in list(self.workers):
                if w.ready and not w.chunk and pending:
                    self._assign(w, tasks, pending, attempts)
            waiting = [w for w in self.workers if w.chunk or not w.ready]
            if not waiting:
                continue
            wait = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            readable, _, _ = select.select([w.fd for w in waiting], [], [], wait)
            for w in waiting:
                if w.fd in readable:
                    lines = w.read_lines()
                    if lines is None:
                        self._crashed(w, pending, attempts)
                        continue
                    for line in lines:
                        msg = json.loads(line)
                        if "ready" in msg:
                            w.ready = True
                            w.deadline = math.inf
                        elif w.chunk:
                            i = w.chunk.popleft()
                            results[i], errors[i] = float(msg.get("v", 0.0)), msg.get("e")
                            w.deadline = time.monotonic() + self.timeout_s if w.chunk else math.inf
                elif time.monotonic() >= w.deadline:
                    if w.chunk:  # hard time limit: kill, score the item 0, requeue the rest
                        i = w.chunk.popleft()
                        results[i], errors[i] = 0.0, f"timed out after {self.timeout_s:g} s (reward_timeout_s)"
                        pending.extendleft(reversed(w.chunk))
                        w.chunk.clear()
                        self.stats["timeouts"] += 1
                        self._replace(w)
                    else:
                        self._replace(w)
                        raise RuntimeError("reward worker did not start in time")
        return results, errors

    def _assign(self, w, tasks, pending, attempts):
        size = max(1, min(_MAX_CHUNK, len(pending) // (2 * len(self.workers))))
        items, nbytes = [], 0
        while pending and len(items) < size and nbytes < _MAX_CHUNK_BYTES:
            idx = pending.popleft()
            spec, c, r = tasks[idx]
            w.chunk.append(idx)
            items.append([spec, c, r])
            nbytes += len(c) + len(r)
        attempts[w.chunk[0]] += 1
        payload = json.dumps({"items": items}).encode() + b"\n"
        if not w.send(payload, time.monotonic() + self.timeout_s):
            self._crashed(w, pending, attempts)

    def _crashed(self, w, pending, attempts):
        self.stats["crashes"] += 1
        if not w.ready and not w.chunk:
            self._replace(w)
            raise RuntimeError("reward worker exited during start-up")
        if w.chunk:
            first = w.chunk.popleft()
            pending.extendleft(reversed(w.chunk))
            if attempts[first] < _MAX_ATTEMPTS:
                pending.appendleft(first)  # retried once; then it keeps the 0.0 score
            else:
                self._errors[first] = "the grading worker process died on this completion (twice)"
        w.chunk.clear()
        self._replace(w)

    def close(self):
        self._finalizer()


class RewardComputer:
    """Weighted sum of reward functions, graded in bounded worker processes.

    ``specs``: ``[{"function": "grpo_dist.rewards:math_reward", "weight": 1.0}, ...]``
    (``"name"`` optional; a bare spec string is accepted too).  ``num_workers=0``
    grades in-process (no hard time limit; ``math_reward`` bounds its own work).
    Calling returns ``(totals, {name: scores})``; an item that times out, or whose
    function raises or returns a non-number (None, NaN, inf, a string, a list),
    scores 0.0 for that function and is counted in ``last_errors``.
    """

    def __init__(self, specs: list, num_workers: int = 1, timeout_s: float = 5.0):
        if isinstance(specs, (str, dict)):
            specs = [specs]
        if not specs:
            raise ValueError("RewardComputer needs at least one reward function spec")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.specs, self.weights, self.names, self.functions = [], [], [], []
        for s in specs:
            if isinstance(s, str):
                s = {"function": s}
            if not isinstance(s, dict) or "function" not in s:
                raise ValueError(f"reward spec {s!r} needs a 'function' key")
            unknown = set(s) - {"function", "weight", "name"}
            if unknown:
                raise ValueError(f"reward spec {s!r}: unknown keys {sorted(unknown)}")
            try:
                weight = float(s.get("weight", 1.0))
            except (TypeError, ValueError):
                raise ValueError(f"reward spec {s!r}: weight must be a number") from None
            self.functions.append(resolve_reward_function(s["function"]))
            self.specs.append(s["function"])
            self.weights.append(weight)
            self.names.append(s.get("name") or s["function"].split(":")[1].strip())
        if len(set(self.names)) != len(self.names):
            self.names = [s.get("name") or sp for s, sp in zip(
                [x if isinstance(x, dict) else {} for x in specs], self.specs)]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate reward function names: {self.names}")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self.last_errors: dict = {name: 0 for name in self.names}
        self._reported: set = set()
        self._pool = _Pool(self.num_workers, self.timeout_s) if self.num_workers > 0 else None
        # length-aware functions read numbers only: graded here, with the token counts (never sent to workers)
        self._length_kwargs = {name: length_kwargs_of(fn) for name, fn in zip(self.names, self.functions)}

    @property
    def stats(self) -> dict:
        return dict(self._pool.stats) if self._pool else {}

    def __call__(self, completions: list, references: list, completion_lengths: list | None = None,
                 max_completion_length: int | None = None):
        """(totals, {name: scores}); what failed is in self.last_errors ({name: count}) and the first failure of
        each function is printed once. Functions that take completion_length / max_completion_length (length
        shaping) are graded in this process with the token counts; the others in the worker pool."""
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        completions = [c if isinstance(c, str) else "" for c in completions]
        references = [r if isinstance(r, str) else str(r) for r in references]
        n = len(completions)
        per_fn: dict = {}
        errors: dict = {}
        with self._lock:
            if self._pool is not None:
                pooled = [k for k, name in enumerate(self.names) if not self._length_kwargs[name]]
                tasks = [(self.specs[k], c, r) for k in pooled for c, r in zip(completions, references)]
                try:
                    flat, errs = self._pool.grade(tasks)
                except RuntimeError:  # workers cannot start: grade in-process rather than stall
                    flat, errs = self._grade_pairs(pooled, completions, references)
                for j, kk in enumerate(pooled):
                    per_fn[self.names[kk]] = flat[j * n:(j + 1) * n]
                    errors[self.names[kk]] = errs[j * n:(j + 1) * n]
            for name, fn in zip(self.names, self.functions):
                if name not in per_fn:
                    per_fn[name], errors[name] = self._grade_here(fn, name, completions, references,
                                                                  completion_lengths, max_completion_length)
            per_fn = {name: per_fn[name] for name in self.names}  # spec order: the first is the verifier
        self._count_errors(errors, n)
        totals = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights))
                  for i in range(n)]
        return totals, per_fn

    def _grade_pairs(self, indices, completions, references):
        """In-process grading of the functions at `indices`: (flat scores, flat errors), function-major."""
        pairs = [_call_safely(self.functions[k], c, r) for k in indices for c, r in zip(completions, references)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _grade_here(self, fn, name, completions, references, lengths, max_len) -> tuple[list, list]:
        wanted = self._length_kwargs[name]
        if wanted and (lengths is None or ("max_completion_length" in wanted and max_len is None)):
            raise ValueError(f"reward function {name!r} needs {', '.join(wanted)}, which this call did not pass")
        values = {"max_completion_length": max_len}
        pairs = [_call_safely(fn, c, r, **{k: (int(lengths[i]) if k == "completion_length" else values[k])
                                           for k in wanted})
                 for i, (c, r) in enumerate(zip(completions, references))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _count_errors(self, errors: dict, n: int) -> None:
        """last_errors = failures per function in this call; the first failure of each function is printed once."""
        self.last_errors = {}
        for k, name in enumerate(self.names):
            mine = [e for e in errors[name] if e]
            self.last_errors[name] = len(mine)
            if mine and name not in self._reported:
                self._reported.add(name)
                print(f"[grpo_dist] reward function '{name}' ({self.specs[k]}) failed on {len(mine)} of {n} "
                      f"completions, scored 0; the first failure (printed once, all are counted in the metric "
                      f"reward_errors/{name}): {mine[0]}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
