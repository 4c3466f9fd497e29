"""A reward function that raises, times out or returns None / NaN / inf / a string / a list is never silent: each
failure scores 0 and is counted per function (reward_errors/<name>), the first one is printed once with its
traceback, and a function that fails on every completion of a step stops the run (exit 2) on every rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "ggggggg", "hhhhhhhh", "iiiiiiiii", "jjjjjjjjjj"]


@pytest.mark.parametrize("workers", [0, 1])
def test_failures_counted_and_reported_once(workers, capfd):
    from grpo_dist.rewards import RewardComputer
    specs = [{"function": "reward_fns:broken"}, {"function": "reward_fns:returns_none"},
             {"function": "reward_fns:returns_bad"}, {"function": "reward_fns:odd_length"}]
    with RewardComputer(specs, num_workers=workers, timeout_s=20) as rc:
        for _ in range(2):
            totals, per_fn = rc(COMPLETIONS, ["1"] * len(COMPLETIONS))
            # returns_bad: len % 5 == 4 is the only number (1.0); NaN, inf, "1.0" and a list count as failures
            assert rc.last_errors == {"broken": 10, "returns_none": 10, "returns_bad": 8, "odd_length": 0}
            assert per_fn["returns_bad"] == [1.0 if len(c) % 5 == 4 else 0.0 for c in COMPLETIONS]
            assert totals == [float(len(c) % 2) + (1.0 if len(c) % 5 == 4 else 0.0) for c in COMPLETIONS]
    err = capfd.readouterr().err
    for name in ("broken", "returns_none", "returns_bad"):  # once per function, not once per call or item
        assert err.count(f"reward function '{name}'") == 1, err
    assert "KeyError: 'no such field'" in err and "Traceback" in err  # the traceback of the exception
    assert "returned NoneType None, not a number" in err
    assert "reward_errors/broken" in err and "odd_length" not in err


def test_timeout_counted():
    from grpo_dist.rewards import RewardComputer
    with RewardComputer([{"function": "reward_fns:slow"}], num_workers=1, timeout_s=0.5) as rc:
        totals, _ = rc(["x", "y"], ["1", "1"])
    assert totals == [0.0, 0.0] and rc.last_errors == {"slow": 2}


def _train(*extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get(
        "PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                           "max_steps=2", "save_steps=0", "save_final=false", "reward_workers=0",
                           "progress_bar=false", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_all_failing_function_stops_the_run(tmp_path):
    r = _train(f"output_dir={tmp_path / 'a'}", "rewards=[{function: 'reward_fns:broken'}]")
    assert r.returncode == 2, r.stderr
    final = [x for x in r.stderr.splitlines() if x.startswith("grpo_dist: rank")]
    assert len(final) == 1 and "reward function 'broken' failed on all 8 completions of step 1" in final[0], r.stderr
    # configurable: with the check off the run goes on, and the failures are in the metrics
    r = _train(f"output_dir={tmp_path / 'b'}", "rewards=[{function: 'reward_fns:broken'}, "
               "{function: 'reward_fns:odd_length'}]", "reward_fail_on_all_errors=false")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_errors/broken"] for m in rows] == [8, 8]
    assert [m["reward_errors/odd_length"] for m in rows] == [0, 0]


def _two_ranks(rank, world, out):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.batch_source import RewardFunctionError
    from grpo_dist.trainer import GRPOTrainer
    # rank 0's completions fail, rank 1's do not: counted globally, the run goes on
    cfg = load_config("configs/smoke_cpu.yaml", [f"output_dir={out}", "reward_workers=0", "progress_bar=false",
                                                 "rewards=[{function: 'reward_fns:broken_on_rank0'}]"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    os.environ["BROKEN_RANK"] = "0"
    metrics = tr.train_step()
    # now every rank fails: every rank raises, none waits in a collective
    os.environ["BROKEN_RANK"] = "all"
    try:
        tr.train_step()
    except RewardFunctionError as e:
        return metrics["reward_errors/broken_on_rank0"], str(e)
    return metrics["reward_errors/broken_on_rank0"], None


@pytest.mark.slow
def test_two_ranks_agree(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    res = run_ranks(_two_ranks, 2, tmp_path, str(tmp_path / "run"))
    for count, err in res:
        assert count == 8  # rank 0's 2 prompts x 4 generations (of 16), summed over ranks
        assert err is not None and "failed on all 16 completions of step 2" in err


def _reward_means_on_rank(rank, world):
    """Rank 0 scores [1, 1, 0, 0] on 'verifier', rank 1 [1, 0, 0, 0]; the format reward differs too."""
    from grpo_dist import distributed as gdist
    from grpo_dist.step_metrics import reward_means
    ctx = gdist.init_distributed(60)
    per_function = {"verifier": [1.0, 1.0, 0.0, 0.0] if rank == 0 else [1.0, 0.0, 0.0, 0.0],
                    "format": [0.2, 0.2, 0.2, 0.2] if rank == 0 else [0.0, 0.0, 0.2, 0.0]}
    return reward_means(per_function, ctx.device)


def test_reward_metrics_are_means_over_all_ranks(tmp_path):
    """reward/<name> is the mean over every rank's completions, not rank 0's alone."""
    res = run_ranks(_reward_means_on_rank, 2, tmp_path)
    want = {"reward/verifier": 3 / 8, "reward/format": 1.0 / 8}
    for r in res:
        assert r.keys() == want.keys()
        for k, v in want.items():
            assert abs(r[k] - v) < 1e-12, (k, r[k], v)
