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


def _bench_async():
    """bench/async.py as a module (its name is a Python keyword: no plain import)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "bench", "async.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.fast
def test_bench_async_figures_are_the_formulas_over_the_steps_after_the_fill():
    """summarise() on hand-made metrics of 4 steps at k = 1 (the pipeline full from step 2): the trainer's idle
    fraction weights each step's by its step time, the rollout rank's comes from the per-batch differences of the
    cumulative seconds its messages carry, bytes per version divide by the versions sent (1 + steps - k - 1)."""
    from argparse import Namespace
    bench = _bench_async()
    args = Namespace(prompts=2, num_generations=2, median=5, p95=20, cap=32)
    tokens = [sum(bench.step_targets(args, s)) for s in range(4)]
    step_s, idle_f = [2.0, 1.0, 4.0, 2.0], [0.5, 0.1, 0.25, 0.0]
    B = 1000.0
    metrics = [{"completion_length_mean": tokens[s] / 4, "step_time_s": step_s[s], "time_rollout_s": 0.1,
                "async/trainer_idle_fraction": idle_f[s], "async/rollout_idle_fraction": 0.0,
                "async/weight_sync_s": 0.01 * (s + 1), "async/weight_sync_bytes": B * ((s == 0) + (s + 2 < 4)),
                "async/lag_mean": float(min(s, 1)), "async/lag_max": float(min(s, 1)), "async/dropped": 0.0}
               for s in range(4)]
    # cumulative (idle, busy) after batches 0..3: per batch (1, 1), (0, 2), (3, 1), (1, 3)
    cumulative = [(0, 1.0, 1.0), (1, 1.0, 3.0), (2, 4.0, 4.0), (3, 5.0, 7.0)]
    main = {"code": 0, "train_s": 10.0, "metrics": metrics, "rollout_cumulative": cumulative}
    r = bench.summarise(args, 1, [main, {"served": 0}])
    assert r["full_from_step"] == 2 and r["completion_tokens"] == sum(tokens)
    assert r["tokens_per_s"] == round(sum(tokens) / 10.0, 2)
    assert r["tokens_per_s_full"] == round((tokens[2] + tokens[3]) / (4.0 + 2.0), 2)
    assert r["trainer_idle_fraction"] == round((1.0 + 0.1 + 1.0 + 0.0) / 9.0, 4)
    assert r["trainer_idle_fraction_full"] == round((1.0 + 0.0) / 6.0, 4)
    assert r["rollout_idle_fraction"] == round(5.0 / 12.0, 4)
    assert r["rollout_idle_fraction_full"] == round((3 + 1) / (4 + 4), 4)
    assert r["weight_sync_bytes_per_version"] == 3 * B / 3  # versions 0, 1, 2 (batches 0-1, 2, 3)
    assert r["weight_sync_s_per_step"] == round((0.01 + 0.02 + 0.03 + 0.04) / 4, 4)
    assert r["lag_mean"] == 0.75 and r["lag_max"] == 1.0
    metrics[3]["completion_length_mean"] += 1  # a length the forcing did not hold is refused
    with pytest.raises(RuntimeError, match="completion_length_mean"):
        bench.summarise(args, 1, [main, {"served": 0}])


@pytest.mark.fast
def test_bench_async_projection_arithmetic():
    """project(): colocated = rollout + train on every GPU; a split = max(rollout, train) + sync, with rollout =
    longest x decode step + tokens / GPUs x per-token decode and train = tokens x per-token train / GPUs."""
    bench = _bench_async()
    inp = dict(rows=8, longest=100, tokens=400, decode_step_s=0.01, decode_row_s=0.001, train_s_per_token=0.004,
               sync_bytes=2e9, sync_bytes_s=1e10)
    colo = bench.project(inp, 0, 8)
    assert colo["rollout_s"] == pytest.approx(100 * 0.01 + 400 / 8 * 0.001)
    assert colo["step_s"] == pytest.approx(1.05 + 400 * 0.004 / 8)
    split = bench.project(inp, 4, 4)
    assert split["step_s"] == pytest.approx(max(1.0 + 0.1, 0.4) + 0.2)
    split = bench.project(inp, 2, 6)  # 2 rollout GPUs, 6 trainer GPUs: the rollout is the longer side
    assert split["step_s"] == pytest.approx(max(1.0 + 400 / 2 * 0.001, 400 * 0.004 / 6) + 0.2)
    split = bench.project(inp, 7, 1)  # the trainer is the longer side
    assert split["step_s"] == pytest.approx(max(1.0 + 400 / 7 * 0.001, 400 * 0.004 / 1) + 0.2)
    assert split["arithmetic"] == "max(1.06, 1.60) + 0.200"


@pytest.mark.fast
def test_bench_async_colocated_per_token_times_count_the_rows_of_rank_0():
    """The colocated reference's per-token phase times (what the projection takes) divide rank 0's phase seconds
    by rank 0's completion tokens: with 1 rank (bench/gpu_check.sh's one-GPU reference) every row is rank 0's, with
    2 ranks the first half. Steps 1 and 2 count (step 0 warms up): lengths [7, 10, 7, 2] and [6, 3, 4, 1]."""
    from argparse import Namespace
    bench = _bench_async()
    args = Namespace(prompts=2, num_generations=2, median=5, p95=20, cap=32)
    assert [bench.step_targets(args, s) for s in range(3)] == [[6, 4, 9, 5], [7, 10, 7, 2], [6, 3, 4, 1]]
    metrics = [{"completion_length_mean": mean, "step_time_s": step_s, "time_rollout_s": roll}
               for mean, step_s, roll in ((6.0, 3.0, 1.0), (6.5, 2.0, 0.5), (3.5, 4.0, 1.5))]
    main = {"code": 0, "train_s": 9.0, "metrics": metrics}
    one = bench.summarise(args, -1, [main])
    # rollout 0.5 + 1.5 s, the rest of the step 2.0 + 4.0 - 2.0 s, over 26 + 14 tokens
    assert one["ranks"] == 1 and one["completion_tokens"] == 24 + 26 + 14
    assert one["rollout_s_per_token"] == pytest.approx(2.0 / 40) and one["train_s_per_token"] == pytest.approx(4.0 / 40)
    two = bench.summarise(args, -1, [main, {"rank": 1}])
    assert two["ranks"] == 2  # rank 0's rows: 7 + 10 and 6 + 3 tokens
    assert two["rollout_s_per_token"] == pytest.approx(2.0 / 26) and two["train_s_per_token"] == pytest.approx(4.0 / 26)


def test_decode_ops_counts_within_the_bars():
    """bench/decode_ops.py on a small random Qwen2 shape: its JSON line carries the counts and the timing, and the
    lean decode step stays within issue 36's CPU bars: at most 20 ops per layer (36 in bf16 and 30 in fp32 before)
    and at most one host sync per 8 decode steps (1 per step before: "all rows done?" was read every step on a CPU).
    Counts, not timings: they do not depend on the machine's load."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_ops.py"), "--layers", "2", "--hidden",
                        "32", "--rows", "8", "--vocab", "96", "--steps", "8", "--reps", "1", "--dtype", "bfloat16"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("kernels_per_step", "kernels_per_layer", "host_syncs_per_step", "ms_per_step"):
        assert key in last, key
    assert last["kernels_per_layer"] <= 20, last  # bf16: the most (fp32 needs no casts)
    assert 0 < last["host_syncs_per_step"] <= 0.125, last
    assert last["kernels_per_step"] >= 2 * last["kernels_per_layer"], last


def test_bench_pass_profile_prints_the_json_line():
    """bench/pass_profile.py at tiny sizes: the last line carries the issue's figures (attention calls per layer,
    host syncs per micro-batch, both peaks, seconds per pass); the packed forward runs at most 2 attention calls
    per layer (one per sequence before)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pass_profile.py"), "--layers", "1", "--hidden",
                        "32", "--vocab", "500", "--rows", "16", "--cap", "32", "--budget", "1024", "--repeats", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("attention_calls_per_layer", "host_syncs_per_micro_batch", "peak_mib_logprob_pass",
                "peak_mib_train_micro_batch", "logprob_pass_s", "train_pass_s"):
        assert key in last, key
    assert 1 <= last["attention_calls_per_layer"] <= 2
