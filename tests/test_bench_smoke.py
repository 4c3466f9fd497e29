"""bench/step.py runs a tiny GRPO step end to end and ends with its JSON line (figures are not checked: timings
belong in benchmarks, never in assertions)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_step_prints_the_json_line():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "step.py"), "--steps", "2", "--tiny-hidden", "32",
                        "--tiny-layers", "1", "--num-generations", "2", "--prompts-per-rank", "2",
                        "--max-completion-length", "4"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("step_time_median_s", "completion_tokens_per_s", "rollout_median_s", "update_median_s",
                "peak_memory_per_rank"):
        assert key in last, key
    assert last["completion_tokens_per_step"] == 2 * 2 * 4  # --exact-length is the default


@pytest.mark.slow
def test_bench_long_cot_quick_prints_the_json_line():
    """bench/long_cot.py --quick: the tiny model at 2 ranks, off and on; the forced lengths held (the worker checks
    the completion lengths against them) and the last line carries the issue's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "long_cot.py"), "--quick", "--no-all-configs"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(last["padding_fraction"]) == {"decode", "reference", "old", "train"}
    for key in ("time_ratio", "peak_rss_ratio"):
        assert last[key] > 0, key
    runs = last["results"]["tiny"]["runs"]
    for name in ("off", "on"):
        for pas in ("reference", "old", "train"):
            t = runs[name]["tokens"][pas]
            assert t["processed"] >= t["useful"] > 0, (name, pas)
    # levers on: packed rows compute only the real tokens; off: padded micro-batches of 16 rows compute more
    assert all(runs["on"]["tokens"][p]["processed"] == runs["on"]["tokens"][p]["useful"] for p in ("reference",
                                                                                                    "train"))
    assert runs["off"]["tokens"]["train"]["processed"] > runs["off"]["tokens"]["train"]["useful"]
