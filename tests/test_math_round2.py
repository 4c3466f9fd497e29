"""Issue 15 grading rules: one labelled set per rule (tests/data/math_cases_round2.jsonl).

Each category is one rule of the module docstring of grpo_dist.rewards.math and
holds cases that must pass (expected 1) and cases that must fail (expected 0).
"""
import json
import os
import time
from collections import Counter

import pytest

from grpo_dist.rewards import extract_answer, math_reward
from grpo_dist.rewards.math import is_equivalent

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_PATH = os.path.join(HERE, "data", "math_cases_round2.jsonl")

with open(CASES_PATH, encoding="utf-8") as _f:
    CASES = [json.loads(line) for line in _f if line.strip()]

RULES = ["boxed_list", "labelled", "chained", "inequality", "final_phrase", "number_format",
         "set_notation", "repeating_decimal", "units_text", "percent_words", "size_guard", "unicode",
         "choice", "hedge", "bare_answer", "general"]


def test_every_rule_has_pass_and_fail_cases():
    assert {c["category"] for c in CASES} == set(RULES)
    per = Counter((c["category"], c["expected"]) for c in CASES)
    for rule in RULES:
        assert per[(rule, 1)] >= 3, rule
        assert per[(rule, 0)] >= 3, rule
    assert per[("hedge", 0)] + per[("choice", 0)] >= 20  # reward hacks that must get 0


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['category']}-{i}-{c['expected']}" for i, c in enumerate(CASES)])
def test_rule_case(case):
    assert math_reward(case["completion"], case["reference"]) == float(case["expected"])


@pytest.mark.parametrize("rule", RULES)
def test_rule_latency(rule):
    math_reward("\\boxed{x^2+1}", "1+x^2")  # imports and caches are not the grader's cost
    for c in CASES:
        if c["category"] == rule:
            t = time.perf_counter()
            math_reward(c["completion"], c["reference"])
            assert time.perf_counter() - t < 1.0, c


# ---------------------------------------------------------------- extraction rules 1-3
@pytest.mark.parametrize("text,expected", [
    # rule 1: a group of chained boxes is one list; other words end the group
    ("$\\boxed{-4}$ \\text{ and } $\\boxed{2}$", "-4, 2"),
    ("$x=\\boxed{3}$, $y=\\boxed{7}$", "3, 7"),
    ("\\boxed{3} (or \\boxed{4})", "3, 4"),
    ("\\boxed{5} and again \\boxed{5}", "5"),          # "again" is not a joining word
    ("\\boxed{5} and \\boxed{5}", "5"),                # equal boxes count once
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{4}\n\nRechecking the sum, it is \\boxed{5}.", "5"),
    # rule 2: the marker that comes last wins, if it states math
    ("\\boxed{4}\nFinal Answer: The final answer is 5. I hope it is correct.", "5"),
    ("\\boxed{4}\nSo the final answer is correct.", "4"),
    ("Final Answer: The smallest $k$ is 12.", "12"),
    ("The answer is: 17", "17"),
    ("**Final Answer:** $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("the answer is 42", "42"),                         # one statement of one value (round 5)
    ("#### 7\nFinal answer: \\boxed{8}", "8"),
    # rule 3: a completion that is only an answer
    ("5", "5"), ("$x = 2$", "x = 2"), ("\\(\\frac12\\)", "\\frac12"), ("Yes", "Yes"),
    ("We computed it and it is 5.", "5"),
])
def test_extraction_rules(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- equivalence rules 4-11
@pytest.mark.parametrize("ans,ref,label", [
    # rule 4: lists never equal one value
    ("7, 9", "7", 0), ("7, 9", "9, 7", 1), ("\\pm 3", "3", 0), ("\\pm 3", "3, -3", 1),
    ("(1, 2)", "(2, 1)", 0), ("\\{1, 2\\}", "\\{2, 1, 1\\}", 1),
    # rule 5: exactly one option
    ("(B)", "B", 1), ("B, C", "B", 0), ("(B)(C)", "C", 0), ("\\text{(D)}", "(D)", 1),
    # rule 6: labels and chains
    ("f(x) = 3", "3", 1), ("(a, b) = (1, 2)", "(1, 2)", 1), ("x + y = 5", "5", 0),
    ("z = 1 + 1 = 2", "2", 1), ("1 + 1 = 3", "3", 1), ("1 + 1 = 3", "2", 0),  # the last side (issue 25)
    ("\\pi \\approx 3.14", "\\pi", 1),
    # rule 7: inequalities
    ("3 > x", "x < 3", 1), ("-2x < 4", "x > -2", 1), ("-2x < 4", "x < -2", 0),
    ("x \\ge 0", "[0, \\infty)", 1), ("x > 0", "[0, \\infty)", 0),
    # rule 8: number formats
    ("10 000", "10000", 1), ("2,5", "2.5", 1), ("2,500", "2.5", 0), ("2,5", "2, 5", 1),
    ("0.1\\overline{6}", "\\frac16", 1), ("50 pct", "\\frac12", 1), ("4\\textnormal{ m}", "4", 1),
    # rule 9: sets
    ("{1, 2}", "\\{2, 1\\}", 1), ("\\mathbb{R}", "(-\\infty, \\infty)", 1), ("\\mathbb{R}", "[0, \\infty)", 0),
    # rule 10: unicode
    ("\u00bc", "0.25", 1), ("\uff17", "7", 1), ("7\u200b", "7", 1), ("\u2153", "0.3", 0),
    # rule 11: size guards
    ("2^{2^{4}}", "65536", 1), ("2^{200000}", "4^{100000}", 0),  # equal, beyond the guard
])
def test_equivalence_rules(ans, ref, label):
    assert is_equivalent(ans, ref) == bool(label)
