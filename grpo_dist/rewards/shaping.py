"""Shaping rewards: partial credit that is not a verdict on correctness.

``digit_overlap`` gives a model that is never right yet a reward that still differs between completions, so GRPO
groups are not flat and the update has a gradient (the smoke config uses it next to ``math_reward``, which stays
first and so defines ``accuracy``). It is a signal for plumbing tests and warm-ups, easy to game: never use it alone.
"""
from __future__ import annotations

from collections import Counter

__all__ = ["digit_overlap"]


def digit_overlap(completion: str, reference: str) -> float:
    """The share of the reference answer's characters found in the completion, counted with multiplicity:
    reference "17" scores 1.0 for "7 1" or "17", 0.5 for "x1", 0.0 for "abc" (an empty reference scores 0)."""
    ref = Counter(reference.strip())
    if not ref:
        return 0.0
    return sum((ref & Counter(completion)).values()) / sum(ref.values())
