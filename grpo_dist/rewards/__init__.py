"""Reward functions for RLVR and the bounded batch grader the trainer uses.

``math_reward`` / ``extract_answer`` grade math answers (see
:mod:`grpo_dist.rewards.math`); ``RewardComputer`` grades batches in worker
processes with a hard per-item time limit (see :mod:`grpo_dist.rewards.grading`);
``resolve_reward_function`` turns a ``"module:function"`` spec into a callable.
"""
from grpo_dist.rewards.grading import RewardComputer, resolve_reward_function
from grpo_dist.rewards.math import extract_answer, math_reward

__all__ = ["math_reward", "extract_answer", "resolve_reward_function", "RewardComputer"]
