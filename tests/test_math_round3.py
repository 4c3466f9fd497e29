"""Issue 25 grading rules: one labelled set per miss category (tests/data/math_cases_round3.jsonl, written by
tests/data/make_math_cases_round3.py), each both ways: the right answer paid, a wrong or hedged one not.

The rules are in the module docstring of grpo_dist.rewards.math (rules 1, 2, 4-7, 8, 9).
"""
import json
import os
from collections import Counter

import pytest

from grpo_dist.rewards import extract_answer, math_reward
from grpo_dist.rewards.math import is_equivalent

pytestmark = pytest.mark.fast

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "data", "math_cases_round3.jsonl"), encoding="utf-8") as _f:
    CASES = [json.loads(line) for line in _f if line.strip()]

CATEGORIES = ["solution_set", "assignment", "labelled_value", "interval_function", "abs_union", "multi_part",
              "set_braces", "percent_word", "phrase_number", "chain_last_side", "choice_denied", "order_matters",
              "over_escaped", "reference_form"]


def test_every_category_both_ways():
    assert {c["category"] for c in CASES} == set(CATEGORIES)
    per = Counter((c["category"], c["expected"]) for c in CASES)
    for cat in CATEGORIES:
        assert per[(cat, 1)] >= 2 and per[(cat, 0)] >= 3, cat


@pytest.mark.parametrize("case", CASES, ids=[f"{c['category']}-{i}-{c['expected']}" for i, c in enumerate(CASES)])
def test_case(case):
    assert math_reward(case["completion"], case["reference"]) == float(case["expected"])


# ------------------------------------------------------------------ the chain rule, written out both ways
@pytest.mark.parametrize("answer,ref,label", [
    # the last side is the answer (math-verify's rule): the sides before it are the work ...
    ("x = 2 + 2 = 5", "5", True), ("x = 2 + 2 = 5", "4", False),
    ("7 = 3 + 4 = 8", "8", True), ("7 = 3 + 4 = 8", "7", False),
    # ... and it names one value, so a chain cannot hedge between two
    ("t = 6 = 9", "9", True), ("t = 6 = 9", "6", False),
    # \approx ends the chain: the exact side before it
    ("r = \\frac{2}{3} \\approx 0.1", "\\frac23", True), ("r = \\frac{2}{3} \\approx 0.1", "0.1", False),
    ("u \\approx 12", "12", True),
    # an equation is not a value
    ("x^2 = 9", "9", False), ("a + b = 9", "9", False),
])
def test_chain_rule(answer, ref, label):
    assert is_equivalent(answer, ref) is label


def test_chain_rule_matches_math_verify():
    """Where math-verify reads the last side, so do we (same verdicts on chains both ways)."""
    mv = pytest.importorskip("math_verify")
    pairs = [("x = 2+2 = 5", "5"), ("x = 2+2 = 5", "4"), ("z = 4-1 = 3", "z = 1+2 = 3"), ("k = 6 = 9", "6"),
             ("r = \\frac{2}{3} \\approx 0.1", "\\frac23"), ("r = \\frac{2}{3} \\approx 0.1", "0.1")]
    for answer, ref in pairs:
        theirs = bool(mv.verify(mv.parse(f"${ref}$"), mv.parse(f"${answer}$")))
        assert is_equivalent(answer, ref) is theirs, (answer, ref)


# ------------------------------------------------------------------ extraction: parts, denial, words
@pytest.mark.parametrize("text,expected", [
    ("So $\\boxed{1}$ for part (a) and $\\boxed{2}$ for part (b).", "1, 2"),
    ("The answer is $\\boxed{C}$ is wrong.", None),                        # denied after the box
    ("The answer is $\\boxed{5}$, not 6.", "5"),                           # "not 6" denies 6, not the box
    ("Final answer: the tank holds 40 liters after refilling.", "40"),     # one number in the words
    ("Final answer: the tank holds 40 liters and 2 buckets.", "the tank holds 40 liters and 2 buckets"),  # two
    ("The answer is: 35 percent.", "35 percent"),                          # a percent, not the number 35
    ("Therefore $y \\le 4$ is the solution.", "y \\le 4"),                  # one segment, pointed at
    ("Therefore $y \\le 4$ is not the solution.", None),
    ("Therefore $y \\le 4$ or $y = 5$ is the solution.", None),
    ("Answer \\[\n  12 \\]", "12"),                                        # "Answer" then display math
    ("Final answer:\n$$\n\\frac{3}{4}\n$$", "\\frac{3}{4}"),
    ("The answer \\[ 12 \\] is what we check next, then $\\boxed{13}$.", "13"),  # not at a line start
])
def test_extraction(text, expected):
    assert extract_answer(text) == expected


def test_parts_are_ordered_plain_box_lists_are_not():
    ref = "4, 9"
    assert math_reward("(a) $\\boxed{4}$; (b) $\\boxed{9}$", ref) == 1.0
    assert math_reward("(a) $\\boxed{9}$; (b) $\\boxed{4}$", ref) == 0.0      # parts swapped
    assert math_reward("The roots are $\\boxed{9}$ and $\\boxed{4}$.", ref) == 1.0  # a solution list: any order
