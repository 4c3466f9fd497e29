"""output_dir/completions.jsonl (rank 0's first log_completions rows per step) and the console's eval sample, under
torchrun with 2 ranks and as one plain process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
G = 4  # smoke_cpu.yaml's num_generations


def _train(tmp_path, ranks: int, extra=()):
    out = tmp_path / f"run{ranks}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv-backend",
                "c10d", "--rdzv-endpoint", "localhost:0"] if ranks > 1 else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    # Two reward functions (weights 1 and 0.5), so the per-function values and their weighted sum can be checked.
    rewards = ('rewards=[{function: "reward_fns:char_parity", weight: 1.0}, '
               '{function: "reward_fns:odd_length", weight: 0.5}]')
    r = subprocess.run(launcher + ["-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}",
                                   "max_steps=2", "save_steps=0", "save_final=false", "progress_bar=false",
                                   "eval_steps=2", "data.eval_limit=4", "reward_workers=0", rewards, *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_completions_jsonl_rows_and_console_sample(tmp_path, ranks):
    out, stdout = _train(tmp_path, ranks, ["log_completions=4"])
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4   # rank 0's first 4 rows each step, nothing from rank 1
    for r in rows:
        assert set(r) == {"step", "prompt", "completion", "reference", "reward", "rewards", "advantage",
                          "completion_tokens"}
        assert r["prompt"].endswith("=") and r["reference"].lstrip("-").isdigit()   # arithmetic prompts "3+14="
        assert "<eos>" not in r["completion"] and "<pad>" not in r["completion"]     # decoded without specials
        assert set(r["rewards"]) == {"char_parity", "odd_length"}
        assert r["reward"] == pytest.approx(r["rewards"]["char_parity"]
                                            + 0.5 * r["rewards"]["odd_length"])
        assert r["rewards"]["odd_length"] == len(r["completion"]) % 2
        assert 1 <= r["completion_tokens"] <= 8
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]   # log_completions = G: exactly the first prompt's group
        assert len({r["prompt"] for r in group}) == 1
        rewards = [r["reward"] for r in group]
        mean = sum(rewards) / G
        std = (sum((x - mean) ** 2 for x in rewards) / (G - 1)) ** 0.5   # unbiased, as GRPO
        for r in group:
            assert r["advantage"] == pytest.approx((r["reward"] - mean) / (std + 1e-4), abs=1e-5)
    # one evaluation (step 2), one sample on the console
    assert stdout.count("eval sample at step 2") == 1 and "completion:" in stdout


def test_log_completions_off(tmp_path):
    out, _ = _train(tmp_path, 1, ["log_completions=0"])
    assert not (out / "completions.jsonl").exists()
    assert (out / "metrics.jsonl").is_file()
