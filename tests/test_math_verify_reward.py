"""grpo_dist.rewards:math_verify_reward: math-verify's grades (TRL's accuracy_reward), with the isolation, time limit
and error accounting of every per-completion reward, and a one-line refusal at start when math-verify is missing."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify")  # the dev extra installs it (CI); the missing-package test below fakes absence

from grpo_dist.rewards import RewardComputer, math_verify_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = "grpo_dist.rewards:math_verify_reward"
# (completion, reference, what math-verify itself says): right answers in several forms, wrong ones, no answer
PAIRS = [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("Thus $x = \\boxed{3}$.", "3", 1.0),
    ("The roots are $\\boxed{2, -2}$.", "\\pm 2", 1.0),
    ("So the answer is $\\boxed{\\frac{1}{3}}$.", "0.5", 0.0),
    ("Thus $x = \\boxed{4}$.", "3", 0.0),
    ("I do not know.", "3", 0.0),
]
SLOW = "So the answer is $\\boxed{9^{9^{9^{9}}}}$."  # math-verify builds the number: minutes, unbounded


pytestmark = pytest.mark.fast


def test_grades_like_math_verify_called_directly():
    from math_verify import parse, verify
    for completion, reference, expected in PAIRS:
        direct = float(verify(parse(f"${reference}$"), parse(completion)))
        assert direct == expected, (completion, reference)  # the table above is math-verify's own verdict
        assert math_verify_reward(completion, reference) == expected, (completion, reference)
    # a reference with its own delimiters (a MATH solution) is parsed as written, not wrapped again
    assert math_verify_reward("$\\boxed{7}$", "The sum is $\\boxed{7}$.") == 1.0
    assert math_verify_reward("$\\boxed{8}$", "The sum is $\\boxed{7}$.") == 0.0


@pytest.mark.parametrize("workers", [0, 1])
def test_through_reward_computer(workers):
    completions = [c for c, _, _ in PAIRS]
    references = [r for _, r, _ in PAIRS]
    with RewardComputer([{"function": SPEC}], num_workers=workers, timeout_s=20) as rc:
        totals, per_fn = rc(completions, references)
        assert totals == [e for _, _, e in PAIRS]
        assert per_fn == {"math_verify_reward": totals} and rc.last_errors == {"math_verify_reward": 0}


def test_overlong_grading_is_a_counted_error_in_process(monkeypatch, capfd):
    """math-verify's own alarm would report a timeout as "not equal" (a silent 0); ours raises: a counted error."""
    from grpo_dist.rewards import mathverify
    monkeypatch.setattr(mathverify, "TIMEOUT_S", 0.5)
    with RewardComputer([{"function": SPEC}], num_workers=0) as rc:
        t = time.perf_counter()
        totals, _ = rc([SLOW, PAIRS[0][0]], ["1", PAIRS[0][1]])
        assert time.perf_counter() - t < 10
    assert totals == [0.0, 1.0] and rc.last_errors == {"math_verify_reward": 1}
    assert "math-verify took over 0.5 s" in capfd.readouterr().err


@pytest.mark.heavy  # waits out a grading time limit: ~3.4 s; out of `make fast`
def test_overlong_grading_is_killed_in_a_worker():
    # 3 s: the replacement worker imports math-verify (~1 s) within the next item's limit
    with RewardComputer([{"function": SPEC}], num_workers=1, timeout_s=3.0) as rc:
        t = time.perf_counter()
        totals, _ = rc([SLOW, PAIRS[0][0]], ["1", PAIRS[0][1]])
        assert time.perf_counter() - t < 30
        assert totals == [0.0, 1.0] and rc.last_errors == {"math_verify_reward": 1}


@pytest.mark.heavy  # a training subprocess: ~2 s; out of `make fast`
def test_missing_package_refused_at_start_in_one_line(tmp_path):
    """Without math-verify the config is refused before any model loads, with the pip command, in one line."""
    (tmp_path / "math_verify.py").write_text("raise ImportError('No module named math_verify')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                        f"output_dir={tmp_path / 'out'}", f"rewards=[{{function: '{SPEC}'}}]"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if "math-verify" in x]
    assert len(lines) == 1, r.stderr
    assert "rewards[0].function" in lines[0] and "pip install 'grpo_dist[math-verify]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stdout.lower(), (r.stdout, r.stderr)
