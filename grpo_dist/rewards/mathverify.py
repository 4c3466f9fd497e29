"""``math_verify_reward``: grade with Hugging Face's math-verify package, as TRL's ``accuracy_reward`` does.

For users who migrate from TRL and want the same grades: ``rewards: [{function: "grpo_dist.rewards:
math_verify_reward"}]``. Needs the optional extra (``pip install 'grpo_dist[math-verify]'``); without it the reward
is refused at start with one line saying so, before any model loads. docs/grading.md compares it with
``math_reward`` (and says when to pick which).

The gold side is the reference wrapped in ``$...$`` when it has no math delimiters of its own (a dataset answer
such as ``\\frac{1}{2}``), as math-verify's own examples and most GRPO trainers call it; the completion is parsed
with math-verify's default extraction (its last ``\\boxed{}``, else LaTeX, else a plain expression).

Isolation, time limit and errors are those of every per-completion reward (grpo_dist.rewards.grading): with
reward_workers > 0 it runs in a worker process killed after reward_timeout_s (counted in reward_errors/<name>).
math-verify's own time limit is signal.alarm, which only works in the main thread and reports a timeout as a plain
"not equal"; it is turned off here, and replaced, where a signal can be used (the main thread: a worker, or the
trainer with reward_workers=0), by an alarm of TIMEOUT_S that *raises*, so an overlong grading is an error that
is counted, never a silent 0.
"""

from __future__ import annotations

import signal
import threading

try:
    import math_verify as _mv
except ImportError:  # the one line check_rewards prints at start (resolve_reward_function turns it into a ValueError)
    raise ImportError("grpo_dist.rewards:math_verify_reward needs the math-verify package: "
                      "pip install 'grpo_dist[math-verify]' (or pip install math-verify)") from None

__all__ = ["math_verify_reward", "TIMEOUT_S"]

# math-verify logs "you must provide the logic for timeout interruption yourself" once per process when its alarms
# are off: they are off on purpose here (the alarm below, or the worker pool's kill, is that logic).
_mv.parser.TIMEOUT_WARNING_SHOWN = True
_mv.grader.TIMEOUT_WARNING_SHOWN = True

TIMEOUT_S = 5.0   # per completion, in-process; math-verify's own default for each of parse and verify
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


class GradingTimeout(BaseException):
    """Raised by the alarm. A BaseException: math-verify catches Exception and would turn it into "not equal"."""


def _raise_timeout(signum, frame):
    raise GradingTimeout(f"math-verify took over {TIMEOUT_S:g} s on one completion")


def _grade(completion: str, reference: str) -> float:
    gold_text = reference if any(d in reference for d in _DELIMITERS) else f"${reference}$"
    gold = _mv.parse(gold_text, parsing_timeout=None)  # None: no signal of its own
    if not gold:
        return 0.0
    pred = _mv.parse(completion, parsing_timeout=None)
    return 1.0 if pred and _mv.verify(gold, pred, timeout_seconds=None) else 0.0


def math_verify_reward(completion: str, reference: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference, else 0.0. Raises (a counted
    reward error) when grading takes over TIMEOUT_S seconds in the main thread."""
    if not isinstance(completion, str) or not isinstance(reference, str) or not reference.strip():
        return 0.0
    if threading.current_thread() is not threading.main_thread():
        return _grade(completion, reference)  # no signals here: the worker pool's kill is the time limit
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        return _grade(completion, reference)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
