"""Reward functions in TRL's batch form, and what every batch scorer (function, reward model, remote) is given.

The batch form (TRL's reward-function contract)::

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]: ...

is called once per batch of completions, with keyword arguments, each a list with one entry per completion in
order:

* ``prompts``: the problem text of the row (the dataset's prompt field, before data.prompt_template), or, in
  conversational mode (data.use_chat_template: true), the messages ``[{"role": "user", "content": ...}]``;
* ``completions``: the completion text, or, in conversational mode, ``[{"role": "assistant", "content": ...}]``;
* ``completion_ids``: the completion's token ids (EOS included, no padding);
* ``references``: the reference answer the per-completion functions get (after data.answer_format);
* every other column of the dataset row, by its name (``solution``, ``answer`` as written in the file, ...).

A function with ``**kwargs`` gets them all; one without gets only the names it declares. The function is detected
as batch-form when its first parameter is named ``prompts`` or ``completions`` or it takes ``**kwargs``; the config
entry ``{function: ..., batch: true}`` (or ``false``) overrides the detection.

It returns one score per completion, in order. ``None`` means "this function does not apply to that completion":
it is not an error, and the function is left out of that completion's total. The total of a completion is TRL's
nansum::

    total_i = sum over the reward entries k whose score s_ki is not None of weight_k * s_ki

(0.0 when no entry applies). The reward/<name> metric is the mean over the completions it applied to.

Failures are counted per function in ``reward_errors/<name>`` and the first one is printed once, as for the
per-completion functions: a call that raises, times out, or returns something other than a list (tuple, array) of
as many entries as completions makes every item an error (scored 0.0); an entry that is not None and not a finite
number is an error for that item alone.

Isolation and time limit: with reward_workers > 0 each batch function runs in its own worker process (a fresh
interpreter, as the grading pool's), which gets ``reward_timeout_s x (number of completions)`` seconds per call; past
that it is SIGKILLed, every item of the call is an error, and a new worker starts with the next call. The batch is
sent to it as JSON, so dataset columns must be JSON values (anything a .jsonl row holds). With reward_workers=0 the
function runs in the trainer process, without a hard time limit.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import select
import time
import traceback
import weakref
from dataclasses import dataclass, field

from grpo_dist.rewards.workers import (check_score, kill_worker_group, resolve_reward_function, serve, short_repr,
                                       start_worker, worker_preamble)

__all__ = ["RewardBatch", "is_batch_function", "check_batch_result", "BatchFunctionScorer", "rollout_context"]

_START_TIMEOUT_S = 180.0
_MAX_ERROR_CHARS = 4000
_CORE = ("prompts", "completions", "completion_ids", "references")


@dataclass
class RewardBatch:
    """What a batch scorer is given: one entry per completion in every list."""
    prompts: list
    completions: list[str]
    references: list[str]
    completion_ids: list[list[int]] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    conversational: bool = False

    def __len__(self) -> int:
        return len(self.completions)

    def arguments(self) -> dict:
        """Every keyword argument of a batch call: prompts, completions, completion_ids, references, the columns
        (a column named like one of the first four is left out: those names are taken)."""
        prompts: list = self.prompts
        completions: list = list(self.completions)
        if self.conversational:
            prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        out = {"prompts": prompts, "completions": completions, "completion_ids": self.completion_ids,
               "references": list(self.references)}
        out.update({k: v for k, v in self.columns.items() if k not in _CORE})
        return out


def arguments_for(fn, arguments: dict) -> dict:
    """The arguments `fn` takes: all of them with **kwargs, else the names it declares."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return arguments
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return arguments
    return {k: v for k, v in arguments.items() if k in params}


def argument_problems(rewards, examples: list) -> list[str]:
    """What the batch functions of a RewardComputer need and the data cannot give: a parameter without a default
    that is neither a core argument (prompts, completions, completion_ids, references) nor a column of any row of
    `examples`. Checked at start, before any model loads."""
    available = set(_CORE)
    for e in examples:
        available.update(getattr(e, "columns", {}) or {})
    bad = []
    for k, name in enumerate(rewards.names):
        scorer = rewards._batch.get(name)
        if not isinstance(scorer, BatchFunctionScorer):
            continue
        try:
            params = inspect.signature(scorer.fn).parameters.values()
        except (TypeError, ValueError):
            continue
        missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in available
                   and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
        if missing:
            columns = sorted(available - set(_CORE))
            bad.append(f"config key 'rewards[{k}].function' = {scorer.spec} takes {', '.join(missing)}, which the "
                       f"training data does not have (its columns: {', '.join(columns) or 'none'}; always given: "
                       f"{', '.join(_CORE)})")
    return bad


def is_batch_function(fn) -> bool:
    """TRL's batch form: first parameter named prompts or completions, or **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    return bool(params) and params[0].name in ("prompts", "completions")


def check_batch_result(value, n: int, what: str = "returned") -> tuple[list, list]:
    """(scores, errors) of a batch result for n completions: scores hold floats, or None (not applicable); errors
    hold None or what is wrong. Anything but a sequence of n entries makes every item an error."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # numpy array, torch tensor
    if not isinstance(value, (list, tuple)):
        msg = (f"{what} {type(value).__name__} {short_repr(value)}, not a list of {n} scores (a batch reward function "
               f"returns one float or None per completion)")
        return [0.0] * n, [msg] * n
    if len(value) != n:
        msg = f"{what} {len(value)} scores for {n} completions (expected {n}: one per completion, in order)"
        return [0.0] * n, [msg] * n
    scores: list = []
    errors: list = []
    for v in value:
        if v is None:
            scores.append(None)
            errors.append(None)
            continue
        s, e = check_score(v)
        scores.append(s)
        errors.append(None if e is None else f"{what} {e[len('returned '):] if e.startswith('returned ') else e}")
    return scores, errors


def _call_batch(fn, arguments: dict, n: int) -> tuple[list, list]:
    """A batch function's (scores, errors); SystemExit (and os._exit in the trainer process, see
    RewardComputer) is a failure like any exception: a reward function must not end the run."""
    try:
        out = fn(**arguments_for(fn, arguments))
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a failing batch call scores 0 on every item; the caller counts them
        msg = "raised " + traceback.format_exc(limit=8)[-_MAX_ERROR_CHARS:]
        return [0.0] * n, [msg] * n
    return check_batch_result(out, n)


# --------------------------------------------------------------------------------------------------- worker side
def _batch_worker_main() -> None:  # pragma: no cover - runs in the child process
    proto_in, proto_out = worker_preamble()  # dies with the trainer; its process group dies with it
    funcs: dict = {}

    def answer(req: dict):  # {"spec": "module:fn", "n": N, "arguments": {...}}: one line per call
        n = req["n"]
        try:
            fn = funcs.get(req["spec"]) or funcs.setdefault(req["spec"], resolve_reward_function(req["spec"]))
            scores, errors = _call_batch(fn, req["arguments"], n)
        except Exception as e:  # noqa: BLE001 - resolving the spec failed
            scores, errors = [0.0] * n, [f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]] * n
        if errors and all(x == errors[0] for x in errors) and errors[0]:
            yield {"v": scores, "all": errors[0]}  # one copy of a whole-call error
        else:
            yield {"v": scores, "e": errors}
    serve(proto_in, proto_out, answer)


# --------------------------------------------------------------------------------------------------- parent side
class _BatchWorker:
    def __init__(self):
        self.proc = start_worker("from grpo_dist.rewards.batch import _batch_worker_main; _batch_worker_main()")
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False

    def _line(self, deadline: float) -> bytes | None:
        """The next line, or None at the deadline; EOFError when the worker died."""
        while b"\n" not in self.buf:
            wait = deadline - time.monotonic()
            if wait <= 0:
                return None
            readable, _, _ = select.select([self.fd], [], [], wait)
            if not readable:
                continue
            data = os.read(self.fd, 1 << 16)
            if not data:
                raise EOFError
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def call(self, payload: bytes, timeout_s: float) -> dict | None:
        """The worker's answer, or None after timeout_s. EOFError / OSError when it died."""
        if not self.ready:
            line = self._line(time.monotonic() + _START_TIMEOUT_S)
            if line is None:
                raise EOFError("did not start in time")
            self.ready = True
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()
        line = self._line(time.monotonic() + timeout_s)
        return None if line is None else json.loads(line)

    def kill(self):
        kill_worker_group(self.proc)


def _kill_all(holder: list) -> None:
    while holder:
        holder.pop().kill()


class BatchFunctionScorer:
    """A batch-form reward function (module docstring): in its own worker process (use_worker) with a time limit of
    timeout_s per completion of the call, or in this process."""

    def __init__(self, spec: str, fn, use_worker: bool, timeout_s: float):
        self.spec, self.fn, self.use_worker, self.timeout_s = spec, fn, use_worker, float(timeout_s)
        self._workers: list = []  # at most one; a list so that the finalizer can empty it
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self.stats = {"timeouts": 0, "crashes": 0}

    def score(self, batch: RewardBatch) -> tuple[list, list]:
        n = len(batch)
        if n == 0:
            return [], []
        if not self.use_worker:
            return _call_batch(self.fn, batch.arguments(), n)
        try:
            payload = json.dumps({"spec": self.spec, "n": n, "arguments": arguments_for(self.fn, batch.arguments())},
                                 allow_nan=False).encode() + b"\n"
        except (TypeError, ValueError) as e:
            return [0.0] * n, [f"its arguments cannot be sent to the grading worker as JSON ({e}): dataset columns "
                               f"must be JSON values, or set reward_workers=0"] * n
        limit = self.timeout_s * n
        if not self._workers:
            self._workers.append(_BatchWorker())
        w = self._workers[0]
        try:
            msg = w.call(payload, limit)
        except (EOFError, OSError, ValueError):
            self.stats["crashes"] += 1
            self._finalizer.detach()
            _kill_all(self._workers)
            self._finalizer = weakref.finalize(self, _kill_all, self._workers)
            return [0.0] * n, ["the grading worker process died during this batch call"] * n
        if msg is None:
            self.stats["timeouts"] += 1
            _kill_all(self._workers)  # hard limit: SIGKILL, a fresh worker with the next call
            return [0.0] * n, [f"timed out after {limit:g} s (reward_timeout_s {self.timeout_s:g} x {n} "
                               f"completions)"] * n
        scores = msg["v"]
        errors = [msg["all"]] * n if "all" in msg else msg["e"]
        return scores, errors

    def close(self) -> None:
        self._finalizer()


def rollout_context(examples: list, batch) -> dict:
    """RewardComputer's keyword arguments prompts, completion_ids and columns for a rollout batch of `examples`, whose
    rows are each example's completions in turn (the same number per example)."""
    n = len(batch)
    per = n // max(1, len(examples)) if examples else 0
    rows = [examples[i // per] for i in range(n)] if per else []
    ids = [batch.completion_ids[i][batch.completion_mask[i].bool()].tolist() for i in range(n)]
    names: list = []
    for e in rows:
        for k in getattr(e, "columns", {}) or {}:
            if k not in names:
                names.append(k)
    columns = {k: [(getattr(e, "columns", {}) or {}).get(k) for e in rows] for k in names}
    return {"prompts": [e.prompt for e in rows], "completion_ids": ids, "columns": columns}


def nan_to_none(v):
    """NaN (a score that did not apply) as None, for JSON logs."""
    return None if isinstance(v, float) and math.isnan(v) else v
