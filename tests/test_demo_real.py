"""The real-model demo (`bash launch/demo.sh --real`): its format reward and before/after pairing (fast), and a
2-step smoke run of the whole script on SmolLM2-135M-Instruct with configs/demo_real_cpu.yaml (real_model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_dist.rewards import final_answer_only
from grpo_dist.tools.demo import pair_completions

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("completion,expected", [
    ("The final answer is 55.", 1.0), ("The final answer is 55", 1.0), ("  The final answer is -3.\n", 1.0),
    ("The final answer is 54.", 1.0),          # format only: a wrong number in the right form still earns it
    ("The final answer is 55. Because 35 + 20", 0.0),  # did not stop
    ("The final answer is 35 + 20 = 55.", 0.0), ("55", 0.0), ("The answer is 55.", 0.0), ("", 0.0),
])
def test_final_answer_only(completion, expected):
    assert final_answer_only(completion, "55") == expected


def test_pair_completions_joins_by_problem(tmp_path, capsys):
    def rec(i, completion, correct, truncated=False):
        return {"index": i, "problem": f"{i}+1=", "reference": str(i + 1), "completion": completion,
                "correct": correct, "truncated": truncated, "num_tokens": 3}
    base = [rec(0, "1 + 0 = 2", False, True), rec(1, "The final answer is 2.", True), rec(2, "x", False)]
    final = [rec(2, "The final answer is 3.", True), rec(0, "The final answer is 1.", True),
             rec(1, "The final answer is 3.", False)]  # written in another order: the join is by index
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in base))
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final))
    pairs = pair_completions(tmp_path / "b.jsonl", tmp_path / "f.jsonl", tmp_path / "pairs.jsonl", show=2)
    assert [(p["problem"], p["before"], p["after"]) for p in pairs] == [
        ("0+1=", "1 + 0 = 2", "The final answer is 1."), ("1+1=", "The final answer is 2.", "The final answer is 3."),
        ("2+1=", "x", "The final answer is 3.")]
    assert [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()] == pairs
    out = capsys.readouterr().out
    assert "2 went wrong -> right, 1 right -> wrong" in out
    assert "[wrong, cut off] '1 + 0 = 2'" in out and "0+1=" in out and "2+1=" not in out  # only the first 2 shown


@pytest.mark.real_model
@pytest.mark.slow
def test_real_demo_smoke(tmp_path, smollm2_dir):
    """The whole --real demo for 2 optimizer steps on 6 held-out problems: every output exists, and the summary and
    completion files agree with each other and with the verifier."""
    from grpo_dist.rewards.math import evaluated_math_reward
    for module in ("matplotlib", "tensorboard", "tqdm"):  # else demo.sh would pip-install into this interpreter
        pytest.importorskip(module)

    out = tmp_path / "demo"
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent), DEMO_SAMPLES="2",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GRPO_DIST_CACHE=str(smollm2_dir.parent))
    # 24 training problems, 6 held out; one evaluation: best/ = step 2. 2 prompts x 4 completions a step (the recipe
    # has 64): the script's plumbing is under test here, not the recipe, and 64 rows cost ~25 s a step on 2 cores.
    cmd = ["bash", "launch/demo.sh", "--real", str(out), "max_steps=2", "eval_steps=2",
           "data.arithmetic.num_examples=24", "prompts_per_rank=1", "num_generations=4", "micro_batch_size=4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    summary = json.loads((out / "demo_summary.json").read_text())
    for key in ("base_accuracy", "final_accuracy", "wall_time_s", "base_pass@1", "final_pass@2",
                "final_truncated_fraction", "best_accuracy"):
        assert key in summary, key
    assert summary["best_step"] == 2 and summary["best_accuracy"] == summary["final_accuracy"]  # the same weights
    assert summary["num_eval_problems"] == 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    assert {"reward/evaluated_math_reward", "reward/final_answer_only"} <= set(rows[-1])  # each reward on its own
    for when in ("base", "final", "best"):
        recs = [json.loads(line) for line in (out / f"eval_{when}_completions.jsonl").read_text().splitlines()]
        assert len(recs) == 6
        for r in recs:  # "correct" is the verifier's verdict (the config's first reward), not the format reward's
            assert r["correct"] == (evaluated_math_reward(r["completion"], r["reference"]) == 1.0)
        assert summary[f"{when}_accuracy"] == pytest.approx(sum(r["correct"] for r in recs) / 6)
        assert summary[f"{when}_truncated_fraction"] == pytest.approx(sum(r["truncated"] for r in recs) / 6)
    pairs = (out / "sample_completions.jsonl").read_text().splitlines()
    assert len(pairs) == 6
    assert "before" in proc.stdout and "after" in proc.stdout and "went wrong -> right" in proc.stdout
    assert (out / "plots" / "training_curves.png").stat().st_size > 5000
