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
exit.  Nor do processes that a reward function forks: each worker leads a
session (process group) of its own, every kill (close, time limit, crash
replacement) is a SIGKILL of the whole group, and a tiny reaper process forked
by the worker before any user code runs kills the group when the worker dies
by any other means (e.g. SIGKILLed when the parent died).  A grandchild that
starts a session of its own (setsid) escapes this.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque

from grpo_dist.rewards.workers import (check_score, kill_worker_group, resolve_reward_function, serve, start_worker,
                                       worker_preamble)

__all__ = ["resolve_reward_function", "RewardComputer"]

_START_TIMEOUT_S = 180.0   # a fresh worker must report ready within this time
_MAX_ATTEMPTS = 2          # an item whose worker crashed is retried once
_MAX_CHUNK = 32            # items per request to a worker
_MAX_CHUNK_BYTES = 4 << 20
_MAX_ERROR_CHARS = 4000    # of an error message / traceback sent back by a worker


LENGTH_KWARGS = ("completion_length", "max_completion_length")


def length_kwargs_of(fn) -> tuple[str, ...]:
    """Which of LENGTH_KWARGS the reward function names as parameters (grpo_dist.rewards.length)."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(k for k in LENGTH_KWARGS if k in params)


def _call_safely(fn, completion, reference, **kwargs) -> tuple[float, str | None]:
    """(score, error): a function that raises or returns a non-number scores 0.0, with the reason (a traceback for
    an exception). SystemExit counts as a failure like any exception: a reward function must not end the run
    (only KeyboardInterrupt passes through)."""
    try:
        return check_score(fn(completion, reference, **kwargs))
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a failing reward scores 0.0; the caller counts and reports it
        return 0.0, "raised " + traceback.format_exc(limit=8)[-_MAX_ERROR_CHARS:]


class ProcessExitCalled(Exception):
    """Raised instead of ending the process when an in-process reward function calls os._exit (or another way out
    of the process: _EXITS)."""


def _own_target(name: str, args: tuple) -> bool:
    """Whether a call of `name` with `args` would end or signal this process (kill of another process is a reward
    function's own business: a sandbox it started)."""
    if name == "kill":
        return args[0] in (0, os.getpid(), -os.getpgrp())
    if name == "killpg":
        return args[0] in (0, os.getpgrp())
    return True


# (module, attribute): every way a reward function can end or signal its own process without an exception.
# posix._exit is os._exit's C function under the posix module's name; raise_signal / pthread_kill / kill / killpg
# send a signal (SIGKILL, SIGABRT, SIGTERM: exit 75 without a cause) to this very process.
_EXITS = (("os", "_exit"), ("posix", "_exit"), ("os", "abort"), ("posix", "abort"), ("signal", "raise_signal"),
          ("signal", "pthread_kill"), ("os", "kill"), ("posix", "kill"), ("os", "killpg"), ("posix", "killpg"))


@contextlib.contextmanager
def _process_exit_blocked():
    """While in-process reward functions run, the calls of _EXITS made on this (the grading) thread raise
    ProcessExitCalled (a reward error) instead of ending the trainer with no message, no checkpoint and the code
    the function chose (os._exit(0) looks like success to a scheduler). Other threads (the parent-death watch's
    SIGTERM, interrupts' abort through its own reference) keep the real functions. Restored afterwards. Not used in
    worker processes: there an exit only ends the worker, which is counted as a crash, and the worker's own
    watchdog needs the real one."""
    import posix
    modules = {"os": os, "posix": posix, "signal": signal}
    grader = threading.get_ident()
    saved = [(modules[m], a, getattr(modules[m], a)) for m, a in _EXITS if hasattr(modules[m], a)]

    def refusing(module: str, name: str, real):
        def refuse(*args, **kwargs):
            if threading.get_ident() != grader or not _own_target(name, args):
                return real(*args, **kwargs)
            shown = ", ".join(str(int(a)) if isinstance(a, int) else repr(a) for a in args)
            raise ProcessExitCalled(f"{module}.{name}({shown}) called by a reward function (refused in the trainer "
                                    f"process)")
        return refuse

    for mod, attr, real in saved:
        setattr(mod, attr, refusing(mod.__name__, attr, real))
    try:
        yield
    finally:
        for mod, attr, real in saved:
            setattr(mod, attr, real)


# --------------------------------------------------------------------------- worker side
def _worker_main() -> None:  # pragma: no cover - runs in the child process
    proto_in, proto_out = worker_preamble()
    funcs: dict = {}

    def answer(req: dict):  # {"items": [[spec, completion, reference], ...]}: one line per item, at once
        for spec, completion, reference in req["items"]:
            try:
                fn = funcs.get(spec) or funcs.setdefault(spec, resolve_reward_function(spec))
                score, err = _call_safely(fn, completion, reference)
            except Exception as e:  # noqa: BLE001 - resolving the spec failed
                score, err = 0.0, f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
            out: dict[str, float | str] = {"v": score}
            if err:
                out["e"] = err
            yield out  # written at once: the parent's clock restarts at each answer
    serve(proto_in, proto_out, answer)


class _Worker:
    def __init__(self):
        self.proc = start_worker("from grpo_dist.rewards.grading import _worker_main; _worker_main()")
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
        kill_worker_group(self.proc)

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

    Entries in TRL's batch form (``fn(prompts, completions, completion_ids, **kwargs)``,
    :mod:`grpo_dist.rewards.batch`), reward models (``{"model": DIR}``,
    :mod:`grpo_dist.rewards.reward_model`, loaded here on ``device`` in ``dtype``) and
    remote scorers (``{"url": ...}``, :mod:`grpo_dist.rewards.remote`) are scored once
    per call on the whole batch; for them None means "does not apply" (not an error):
    NaN in their scores, left out of the total. ``conversational``: batch scorers get
    prompts and completions as chat messages (data.use_chat_template).
    """

    def __init__(self, specs: list, num_workers: int = 1, timeout_s: float = 5.0, device=None, dtype=None,
                 conversational: bool = False):
        if isinstance(specs, (str, dict)):
            specs = [specs]
        if not specs:
            raise ValueError("RewardComputer needs at least one reward function spec")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        from grpo_dist.rewards.specs import KIND_KEYS, default_name, reward_kind
        self.specs, self.weights, self.names, self.functions = [], [], [], []
        kinds, dicts = [], []
        for s in specs:
            if isinstance(s, str):
                s = {"function": s}
            if not isinstance(s, dict) or not any(k in s for k in KIND_KEYS):
                raise ValueError(f"reward spec {s!r} needs a 'function' key (or 'model', 'url')")
            kind = reward_kind(s)
            unknown = set(s) - set(KIND_KEYS[kind])
            if unknown:
                raise ValueError(f"reward spec {s!r}: unknown keys {sorted(unknown)}")
            try:
                weight = float(s.get("weight", 1.0))
            except (TypeError, ValueError):
                raise ValueError(f"reward spec {s!r}: weight must be a number") from None
            self.functions.append(resolve_reward_function(s["function"]) if kind == "function" else None)
            self.specs.append(s[kind])
            self.weights.append(weight)
            self.names.append(default_name(s))
            kinds.append(kind)
            dicts.append(s)
        if len(set(self.names)) != len(self.names):
            self.names = [s.get("name") or sp for s, sp in zip(dicts, self.specs)]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate reward function names: {self.names}")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.conversational = bool(conversational)
        self._lock = threading.Lock()
        self.last_errors: dict = {name: 0 for name in self.names}
        self._reported: set = set()
        # batch scorers (grpo_dist.rewards.batch): TRL-form functions, reward models, remote scorers
        self._batch = self._batch_scorers(kinds, dicts, device, dtype)
        self._pool = _Pool(self.num_workers, self.timeout_s) if self.num_workers > 0 else None
        # length-aware functions read numbers only: graded here, with the token counts (never sent to workers)
        self._length_kwargs = {name: () if name in self._batch else length_kwargs_of(fn)
                               for name, fn in zip(self.names, self.functions)}

    def _batch_scorers(self, kinds, dicts, device, dtype) -> dict:
        from grpo_dist.rewards.batch import BatchFunctionScorer, is_batch_function
        out: dict = {}
        for k, (kind, s) in enumerate(zip(kinds, dicts)):
            name = self.names[k]
            if kind == "function":
                batch = s.get("batch")
                if batch is None and not is_batch_function(self.functions[k]):
                    continue
                if batch is False:
                    continue
                out[name] = BatchFunctionScorer(self.specs[k], self.functions[k], self.num_workers > 0,
                                                self.timeout_s)
            elif kind == "model":
                from grpo_dist.rewards.reward_model import RewardModelScorer
                out[name] = RewardModelScorer(self.specs[k], f"rewards[{k}].model", device, dtype,
                                              s.get("batch_size", 8), s.get("max_length"))
            else:
                from grpo_dist.rewards.remote import RemoteScorer
                out[name] = RemoteScorer(self.specs[k], self.timeout_s, s.get("timeout_s"), s.get("max_retries", 2))
        return out

    @property
    def stats(self) -> dict:
        return dict(self._pool.stats) if self._pool else {}

    def __call__(self, completions: list, references: list, completion_lengths: list | None = None,
                 max_completion_length: int | None = None, *, prompts: list | None = None,
                 completion_ids: list | None = None, columns: dict | None = None):
        """(totals, {name: scores}); what failed is in self.last_errors ({name: count}) and the first failure of
        each function is printed once. Functions that take completion_length / max_completion_length (length
        shaping) are graded in this process with the token counts; the others in the worker pool. Batch scorers
        (grpo_dist.rewards.batch) also get prompts, completion_ids and the dataset columns (lists, one entry per
        completion); a score of theirs that does not apply is NaN in {name: scores} and left out of the total
        (total_i = sum of weight * score over the entries that apply, 0.0 if none does)."""
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        completions = [c if isinstance(c, str) else "" for c in completions]
        references = [r if isinstance(r, str) else str(r) for r in references]
        n = len(completions)
        per_fn: dict = {}
        errors: dict = {}
        with self._lock:
            if self._pool is not None:
                pooled = [k for k, name in enumerate(self.names)
                          if not self._length_kwargs[name] and name not in self._batch]
                tasks = [(self.specs[k], c, r) for k in pooled for c, r in zip(completions, references)]
                try:
                    flat, errs = self._pool.grade(tasks)
                except RuntimeError:  # workers cannot start: grade in-process rather than stall
                    flat, errs = self._grade_pairs(pooled, completions, references)
                for j, kk in enumerate(pooled):
                    per_fn[self.names[kk]] = flat[j * n:(j + 1) * n]
                    errors[self.names[kk]] = errs[j * n:(j + 1) * n]
            if self._batch:
                from grpo_dist.rewards.batch import RewardBatch
                rb = RewardBatch(prompts if prompts is not None else [""] * n, completions, references,
                                 completion_ids if completion_ids is not None else [[] for _ in range(n)],
                                 columns or {}, self.conversational)
                for name, scorer in self._batch.items():
                    try:
                        with _process_exit_blocked():
                            scores, errors[name] = scorer.score(rb)
                    except Exception:  # noqa: BLE001 - a scorer's own failure: every item an error, counted
                        scores = [0.0] * n
                        errors[name] = ["raised " + traceback.format_exc(limit=8)[-_MAX_ERROR_CHARS:]] * n
                    per_fn[name] = [math.nan if v is None else v for v in scores]
            for name, fn in zip(self.names, self.functions):
                if name not in per_fn:
                    per_fn[name], errors[name] = self._grade_here(fn, name, completions, references,
                                                                  completion_lengths, max_completion_length)
            per_fn = {name: per_fn[name] for name in self.names}  # spec order: the first is the verifier
        self._count_errors(errors, n)
        totals = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights)
                      if not math.isnan(per_fn[name][i])) for i in range(n)]  # TRL's nansum
        return totals, per_fn

    def _grade_pairs(self, indices, completions, references):
        """In-process grading of the functions at `indices`: (flat scores, flat errors), function-major."""
        with _process_exit_blocked():
            pairs = [_call_safely(self.functions[k], c, r) for k in indices
                     for c, r in zip(completions, references)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _grade_here(self, fn, name, completions, references, lengths, max_len) -> tuple[list, list]:
        wanted = self._length_kwargs[name]
        if wanted and (lengths is None or ("max_completion_length" in wanted and max_len is None)):
            raise ValueError(f"reward function {name!r} needs {', '.join(wanted)}, which this call did not pass")
        values = {"max_completion_length": max_len}
        with _process_exit_blocked():
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
        for scorer in getattr(self, "_batch", {}).values():
            scorer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
