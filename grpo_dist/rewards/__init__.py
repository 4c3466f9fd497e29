"""Reward functions for RLVR and the bounded batch grader the trainer uses.

``math_reward`` / ``extract_answer`` grade math answers (see :mod:`grpo_dist.rewards.math`;
``evaluated_math_reward`` also refuses an answer left as arithmetic, "35+20", for tasks that ask for a sum; the
answer is found in the text by the sympy-free :mod:`grpo_dist.rewards.extract`, which the data
loader also uses for references); ``RewardComputer`` grades batches in worker processes with a
hard per-item time limit (see :mod:`grpo_dist.rewards.grading`); ``resolve_reward_function``
turns a ``"module:function"`` spec into a callable; ``digit_overlap`` is a partial-credit shaping
reward (:mod:`grpo_dist.rewards.shaping`); ``number_match`` and ``final_answer_only`` check the
form of a completion (:mod:`grpo_dist.rewards.format`, the demos' rewards). Besides per-completion functions,
the ``rewards`` entries take TRL's batch-form functions (:mod:`grpo_dist.rewards.batch`), reward models
(:mod:`grpo_dist.rewards.reward_model`) and remote scorers (:mod:`grpo_dist.rewards.remote`); the keys of each kind
are in :mod:`grpo_dist.rewards.specs`.

``math_verify_reward`` grades with the optional math-verify package, as TRL's ``accuracy_reward`` does
(:mod:`grpo_dist.rewards.mathverify`; docs/grading.md compares the two graders).

``math_reward``, ``math_verify_reward`` and ``extract_answer`` are re-exported lazily so that a reward
worker that only runs other functions does not pay for importing sympy.
"""
from grpo_dist.rewards.format import final_answer_only, number_match
from grpo_dist.rewards.grading import RewardComputer, resolve_reward_function
from grpo_dist.rewards.shaping import digit_overlap

# math_verify_reward is not in __all__: a star import would fail without the optional package
__all__ = ["math_reward", "evaluated_math_reward", "extract_answer", "digit_overlap", "number_match",
           "final_answer_only", "resolve_reward_function", "RewardComputer"]


def __getattr__(name):
    if name in ("math_reward", "evaluated_math_reward", "extract_answer"):
        from grpo_dist.rewards import math as _math
        return getattr(_math, name)
    if name == "math_verify_reward":  # ImportError, with the pip command, when math-verify is not installed
        from grpo_dist.rewards import mathverify as _mathverify
        return _mathverify.math_verify_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["math_reward", "evaluated_math_reward", "math_verify_reward", "extract_answer"])
