"""bench/gpu_check.sh in its CPU smoke mode (GPU_CHECK_SMOKE=1): every stage runs end to end and prints its figures.
On this 2-core box it takes 1-4 minutes (seven processes importing torch), hence `slow`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "build", "train_sharded", "train_full", "train_untied", "evaluate", "cli")


@pytest.mark.slow
def test_gpu_check_smoke_mode_runs_every_stage(tmp_path):
    env = dict(os.environ, GPU_CHECK_SMOKE="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_BUDGET_S="1000", TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    status = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in summary}
    assert tuple(status) == STAGES, r.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    # train_full resumes a tied-embedding model from a full checkpoint: issue 13's "Missing key lm_head.weight" until
    # the tied-embedding fix lands; any other failure, or a failure elsewhere, is a regression.
    tied_known_bug = any(x["stage"] == "resume" and not x["ok"] and "lm_head.weight" in x["error"] for x in rows)
    failed = [s for s, v in status.items() if not v.startswith("ok")]
    assert failed in ([], ["train_full"] if tied_known_bug else []), (failed, r.stdout[-4000:])
    assert r.returncode == len(failed)
    steps = [x for x in rows if x["stage"] == "step"]
    assert len(steps) >= 3 * 3 and all(x["rollout_tokens_per_s"] > 0 and x["train_tokens_per_s"] > 0 and
                                       x["step_time_s"] > 0 for x in steps)
    phases = {(x["run"], x["phase"]) for x in rows if x["stage"] == "phase"}
    assert {("qwen05/sharded", p) for p in ("rollout", "learn", "save", "evaluate")} <= phases
    resumed = {x["format"]: x for x in rows if x["stage"] == "resume" and x["ok"]}
    assert resumed["sharded"]["max_weight_diff"] == 0.0 and resumed["sharded"]["last_loss_equal"]
    assert [x["ok"] for x in rows if x["stage"] == "evaluate"] == [True]
    assert "=== figures" in r.stdout and "step_time_s=" in r.stdout
