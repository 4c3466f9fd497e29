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


@pytest.mark.slow
def test_bench_async_quick_prints_the_json_line():
    """bench/async.py --quick at the smallest sizes: 2 colocated ranks and 1 trainer + 1 rollout rank at
    max_staleness 0, 1, 2 ran to the end with the forced lengths (the bench checks every step's
    completion_length_mean against them), and the last line carries each configuration's figures; the lag of every
    step is within k, and exactly min(step, k) as the scheduler sends batch j with version max(0, j - k)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    steps = 4
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "async.py"), "--quick", "--steps", str(steps),
                        "--prompts", "4", "--num-generations", "4", "--length-cap", "32", "--tiny-hidden", "32",
                        "--tiny-layers", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    runs = last["results"]
    assert set(runs) == {"colocated", "async_k0", "async_k1", "async_k2"}
    tokens = {r["completion_tokens"] for r in runs.values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # the same prompts and lengths in every configuration
    for key in ("rollout_s_per_token", "train_s_per_token", "tokens_per_s", "tokens_per_s_full"):
        assert runs["colocated"][key] > 0, key
    sync = set()
    for k in (0, 1, 2):
        r = runs[f"async_k{k}"]
        for key in ("tokens_per_s", "tokens_per_s_full", "trainer_idle_fraction", "trainer_idle_fraction_full",
                    "rollout_idle_fraction", "rollout_idle_fraction_full", "weight_sync_s_per_step", "lag_mean"):
            assert key in r, (k, key)
        for key in ("trainer_idle_fraction", "trainer_idle_fraction_full", "rollout_idle_fraction",
                    "rollout_idle_fraction_full"):
            assert 0 <= r[key] <= 1, (k, key, r[key])
        assert r["full_from_step"] == k + 1 and r["steps"] == steps
        assert r["lag_max"] <= k, (k, r["lag_per_step"])
        assert r["lag_per_step"] == [min(s, k) for s in range(steps)], (k, r["lag_per_step"])
        assert r["lag_mean"] == sum(min(s, k) for s in range(steps)) / steps and r["dropped"] == 0
        # version 0 goes out before step 0 (logged with step 0); after step s version s + 1 goes out with batch
        # s + k + 1 when there is one
        b = r["weight_sync_bytes_per_version"]
        assert r["weight_sync_bytes_per_step"] == [b * ((s == 0) + (s + k + 1 < steps)) for s in range(steps)], k
        sync.add(r["weight_sync_bytes_per_version"])
    assert len(sync) == 1 and sync.pop() > 0  # the same model's weights in every configuration
    proj = last["projection"]
    for name in ("qwen2.5_0.5b_gsm8k", "qwen2.5_7b_multinode"):
        splits = proj[name]["splits"]
        assert set(splits) == {"colocated_8", "async_4t+4r", "async_2t+6r", "async_6t+2r"}
        for s in splits.values():  # the printed arithmetic is the step time
            assert s["step_s"] == pytest.approx(max(s["rollout_s"], s["train_s"]) + s["sync_s"]
                                                if s["sync_s"] else s["rollout_s"] + s["train_s"], rel=1e-3)
