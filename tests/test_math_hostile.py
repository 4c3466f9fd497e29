"""Hostile inputs: every case grades 0.0, quickly, and executes nothing."""
import json
import os
import time

import pytest

from grpo_dist.rewards import RewardComputer, math_reward

pytestmark = pytest.mark.fast  # the `make fast` tier

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTILE_PATH = os.path.join(HERE, "data", "math_hostile.jsonl")
TIME_LIMIT_S = 1.0


def _load():
    with open(HOSTILE_PATH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


HOSTILE = _load()


def build(case, marker):
    if "parts" in case:
        text = "".join(s * n for s, n in case["parts"])
    else:
        text = case["completion"]
    return text.replace("{MARKER}", marker)


def test_hostile_set_covers_the_issue():
    names = {c["name"] for c in HOSTILE}
    assert len(HOSTILE) >= 60
    for must in ["injection_0", "pow_tower_python", "megabyte_garbage", "nested_braces_10000",
                 "unbalanced_open_10000", "null_bytes", "control_chars", "factorial_huge"]:
        assert must in names
    assert sum("{MARKER}" in json.dumps(c) for c in HOSTILE) >= 15


@pytest.fixture(scope="module", autouse=True)
def _warm():
    math_reward("\\boxed{x^2+1}", "1+x^2")  # imports and sympy caches are not the grader's cost


@pytest.mark.parametrize("case", HOSTILE, ids=[c["name"] for c in HOSTILE])
def test_hostile_in_process(case, tmp_path):
    marker = str(tmp_path / "marker")
    text = build(case, marker)
    t = time.perf_counter()
    score = math_reward(text, case["reference"])
    dt = time.perf_counter() - t
    assert score == 0.0
    assert dt < TIME_LIMIT_S, f"{case['name']} took {dt:.2f}s"
    assert not os.path.exists(marker), "model text was executed"


def test_hostile_through_worker_pool(tmp_path):
    comps, refs, markers = [], [], []
    for k, case in enumerate(HOSTILE):
        marker = str(tmp_path / f"marker_{k}")
        markers.append(marker)
        comps.append(build(case, marker))
        refs.append(case["reference"])
    with RewardComputer([{"function": "grpo_dist.rewards:math_reward"}], num_workers=1, timeout_s=5.0) as rc:
        rc(["\\boxed{1}"], ["1"])  # wait for the worker to start
        t = time.perf_counter()
        totals, per = rc(comps, refs)
        dt = time.perf_counter() - t
        assert rc.stats["timeouts"] == 0
    assert totals == [0.0] * len(HOSTILE)
    assert per["math_reward"] == [0.0] * len(HOSTILE)
    assert dt < TIME_LIMIT_S * len(HOSTILE)
    assert not any(os.path.exists(m) for m in markers)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text", ["\\boxed{5}\x00", "\x00" * 10, "\\boxed{\ud800}", "\\boxed{" + "\\" * 5000 + "}"])
def test_odd_strings_do_not_raise(text):
    assert math_reward(text, "5") in (0.0, 1.0)
    assert math_reward("\\boxed{5}", text) in (0.0, 1.0)
