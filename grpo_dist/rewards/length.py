"""Length-aware rewards. A reward function that names the keyword arguments `completion_length` (tokens the
completion took, EOS included) and/or `max_completion_length` gets them from RewardComputer; such functions read
only numbers, so they run in the trainer process rather than in the grading workers."""

from __future__ import annotations


def soft_overlong_punishment(completion: str, reference: str, *, completion_length: int,
                             max_completion_length: int, overlong_buffer_length: int | None = None) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), as a reward added to the others:

        0                                  if L <= L_max - L_buffer
        (L_max - L_buffer - L) / L_buffer  if L_max - L_buffer < L <= L_max   (linear, from 0 down to -1)
        -1                                 if L > L_max

    L = completion_length, L_max = max_completion_length, L_buffer = overlong_buffer_length (default a fifth of
    L_max, DAPO's 4096 of 20480). Another buffer: point the reward spec at a functools.partial of this function
    in your own module."""
    buffer = max(1, max_completion_length // 5) if overlong_buffer_length is None else overlong_buffer_length
    if not 0 < buffer <= max_completion_length:
        raise ValueError(f"overlong_buffer_length must be in (0, max_completion_length], got {buffer}")
    free = max_completion_length - buffer
    if completion_length <= free:
        return 0.0
    if completion_length <= max_completion_length:
        return (free - completion_length) / buffer
    return -1.0
