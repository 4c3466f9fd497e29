"""Rewards that read the form of a completion, no math: ``number_match`` (the completion is exactly the reference
integer: the tiny demo's verifier) and ``final_answer_only`` (the whole completion is the line "The final answer is
N.": the real-model demo's format reward). Both are cheap and safe to grade in-process (reward_workers: 0)."""

from __future__ import annotations

import re


def number_match(completion: str, reference: str) -> float:
    """Reward of the demo: 1 when the completion is exactly the reference integer (surrounding spaces allowed).

    The demo model answers "3+14=" with "17<eos>", a bare number; math_reward wants \\boxed{} or '#### n', so the
    demo grades with this instead. Only digits (and one leading '-') are read: nothing reaches eval."""
    text = completion.strip()
    body = text[1:] if text.startswith("-") else text
    if not body.isdigit() or len(body) > 12:
        return 0.0
    try:
        return float(int(text) == int(reference.strip()))
    except ValueError:
        return 0.0


_FINAL_ANSWER_LINE = re.compile(r"The final answer is -?\d+\.?")


def final_answer_only(completion: str, reference: str) -> float:
    """Format reward of the real-model demo: 1 when the whole completion is the line "The final answer is N." with
    an integer N (right or wrong), else 0. Correctness is math_reward's job (it reads the same phrase); this small
    extra reward pays for answering in the graded form and then stopping, which math_reward alone does not (a right
    answer followed by rambling up to the cut-off scores 1)."""
    return float(_FINAL_ANSWER_LINE.fullmatch(completion.strip()) is not None)
