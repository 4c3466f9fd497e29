"""bench/step.py runs a tiny GRPO step end to end and ends with its JSON line (figures are not checked: timings
belong in benchmarks, never in assertions)."""

import json
import os
import subprocess
import sys

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
