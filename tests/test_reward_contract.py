"""TRL's reward-function contract (grpo_dist.rewards.batch): batch-form functions detected from the signature or
declared in the config, the dataset's columns passed by name, None = not applicable (left out of the total), and
the same failure accounting and time limits as per-completion functions."""

import json
import math

import pytest

from grpo_dist.rewards import RewardComputer

pytestmark = pytest.mark.fast

COMPLETIONS = ["a 7 b", "seven", "7", "xx", "the 9", "9", "", "nine"]
REFS = ["7", "7", "7", "7", "9", "9", "9", "9"]
PROMPTS = ["3+4=", "3+4=", "3+4=", "3+4=", "4+5=", "4+5=", "4+5=", "4+5="]
SOLUTION = ["7", "7", "7", "7", "", "", "", ""]  # the second prompt has no solution: the function does not apply


def test_detection_from_signature_and_config():
    import reward_fns as rf

    from grpo_dist.rewards.batch import is_batch_function
    assert not is_batch_function(rf.odd_length) and not is_batch_function(rf.batch_by_config)
    assert all(map(is_batch_function, (rf.trl_length_reward, rf.trl_solution_reward, rf.per_item_with_kwargs)))
    specs = [{"function": "reward_fns:batch_by_config", "batch": True},
             {"function": "reward_fns:per_item_with_kwargs", "batch": False}]
    with RewardComputer(specs, num_workers=0) as rc:
        _, per_fn = rc(["x7", "y"], ["7", "7"])
    assert per_fn == {"batch_by_config": [1.0, 0.0], "per_item_with_kwargs": [1.0, 0.0]}
    assert rc.last_errors == {"batch_by_config": 0, "per_item_with_kwargs": 0}


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_functions_run_unchanged_and_none_is_weighted_out(workers):
    specs = [{"function": "reward_fns:trl_solution_reward", "weight": 1.0},
             {"function": "reward_fns:trl_length_reward", "weight": 0.5},
             {"function": "reward_fns:odd_length", "weight": 0.25}]
    with RewardComputer(specs, num_workers=workers, timeout_s=10) as rc:
        totals, per_fn = rc(COMPLETIONS, REFS, prompts=PROMPTS, completion_ids=[[1]] * 8,
                            columns={"solution": SOLUTION, "answer": REFS})
    sol = [float("7" in c) for c in COMPLETIONS[:4]] + [None] * 4
    length = [-abs(6 - len(c)) / 6 for c in COMPLETIONS]
    odd = [float(len(c) % 2) for c in COMPLETIONS]
    assert per_fn["trl_solution_reward"][:4] == sol[:4] and all(map(math.isnan, per_fn["trl_solution_reward"][4:]))
    assert per_fn["trl_length_reward"] == length and per_fn["odd_length"] == odd
    # TRL's nansum: a function that does not apply to a row is left out of that row's total
    want = [(s if s is not None else 0.0) + 0.5 * lg + 0.25 * o for s, lg, o in zip(sol, length, odd)]
    assert totals == pytest.approx(want, abs=1e-12)
    assert rc.last_errors == {"trl_solution_reward": 0, "trl_length_reward": 0, "odd_length": 0}  # None: no error


def test_every_argument_reaches_the_function():
    with RewardComputer(["reward_fns:batch_echo"], num_workers=1, timeout_s=10) as rc:
        _, per_fn = rc(["c1", "c2"], ["5", "6"], prompts=["p", "pp"], completion_ids=[[1, 2], [3]],
                       columns={"gold": ["5", "x"]})
    assert per_fn["batch_echo"] == [1 + 200 + 10000, 2 + 100]


def test_conversational_completions_are_messages():
    with RewardComputer(["reward_fns:trl_format_reward"], num_workers=0, conversational=True) as rc:
        _, per_fn = rc(["<think>hm</think>7", "7"], ["7", "7"], prompts=["3+4=", "3+4="])
    assert per_fn["trl_format_reward"] == [1.0, 0.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_failures_counted_and_reported_once(workers, capfd):
    specs = ["reward_fns:batch_raises", "reward_fns:batch_short", "reward_fns:batch_mixed", "reward_fns:odd_length"]
    with RewardComputer(specs, num_workers=workers, timeout_s=10) as rc:
        for _ in range(2):
            totals, per_fn = rc(COMPLETIONS, REFS, prompts=PROMPTS)
            # a raise and a wrong length make every item an error; None is n/a, NaN and a string are errors
            assert rc.last_errors == {"batch_raises": 8, "batch_short": 8, "batch_mixed": 4, "odd_length": 0}
            assert per_fn["batch_raises"] == [0.0] * 8 and per_fn["batch_short"] == [0.0] * 8
            mixed = per_fn["batch_mixed"]
            assert math.isnan(mixed[0]) and mixed[1:4] == [1.0, 0.0, 0.0]
            assert totals == [float(len(c) % 2) + (1.0 if i % 4 == 1 else 0.0) for i, c in enumerate(COMPLETIONS)]
    err = capfd.readouterr().err
    for name in ("batch_raises", "batch_short", "batch_mixed"):
        assert err.count(f"reward function '{name}'") == 1, err
    assert "ValueError: judge exploded" in err and "Traceback" in err
    assert "reward function 'batch_short' (reward_fns:batch_short) failed on 8 of 8" in err
    assert "returned 7 scores for 8 completions (expected 8" in err
    assert "returned nan" in err or "returned str" in err


def test_batch_timeout_scaled_by_batch_size():
    import time
    with RewardComputer(["reward_fns:batch_slow", "reward_fns:odd_length"], num_workers=1, timeout_s=0.1) as rc:
        t0 = time.monotonic()
        totals, per_fn = rc(["x", "yy", "z"], ["1"] * 3)
        took = time.monotonic() - t0
        assert rc.last_errors == {"batch_slow": 3, "odd_length": 0}
        assert totals == [1.0, 0.0, 1.0] and took < 10
        # the worker was killed; the next call starts a fresh one
        rc(["x"], ["1"])
        assert rc.last_errors["batch_slow"] == 1


def test_dataset_columns_reach_the_examples(tmp_path):
    import torch

    from grpo_dist.config import DataConfig
    from grpo_dist.data import load_examples
    from grpo_dist.rewards.batch import rollout_context
    from grpo_dist.rollout import RolloutBatch
    p = tmp_path / "train.jsonl"
    rows = [{"question": "3+4=", "answer": "7", "solution": "seven", "meta": {"level": 1}},
            {"question": "1+1=", "answer": "2", "solution": "", "meta": {"level": 2}}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ex = load_examples(DataConfig(preset=None, path=str(p)))
    assert [e.columns for e in ex] == [{k: v for k, v in r.items() if k != "question"} for r in rows]
    ids = torch.tensor([[5, 6, 1], [5, 1, 0], [7, 1, 0], [8, 9, 1]])
    batch = RolloutBatch(ids, torch.ones_like(ids), ids, (ids != 0).long(), 2, ["a", "b", "c", "d"],
                         ["7", "7", "2", "2"])
    ctx = rollout_context(ex, batch)
    assert ctx["prompts"] == ["3+4=", "3+4=", "1+1=", "1+1="]
    assert ctx["completion_ids"] == [[5, 6, 1], [5, 1], [7, 1], [8, 9, 1]]
    assert ctx["columns"]["solution"] == ["seven", "seven", "", ""]
    assert ctx["columns"]["meta"] == [{"level": 1}, {"level": 1}, {"level": 2}, {"level": 2}]


@pytest.mark.parametrize("entry, key", [
    ("{function: 'reward_fns:odd_length', batch: maybe}", "rewards[0].batch"),
    ("{function: 'reward_fns:odd_length', url: 'http://x'}", "rewards[0]"),
    ("{url: 'ftp://x'}", "rewards[0].url"),
    ("{url: 'http://127.0.0.1:1/', max_retries: -1}", "rewards[0].max_retries"),
    ("{url: 'http://127.0.0.1:1/', retries: 3}", "rewards[0].retries"),
    ("{model: /nonexistent/rm}", "rewards[0].model"),
    ("{model: /nonexistent/rm, batch_size: 0}", "rewards[0].batch_size"),
])
def test_bad_entries_refused_naming_the_key(entry, key, capsys):
    from grpo_dist.config import main
    assert main(["--check", "none", f"rewards=[{entry}]"]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err, err


@pytest.mark.slow  # a training subprocess (about 2 s: it stops before any model loads)
def test_a_column_the_data_lacks_is_refused_at_start(tmp_path):
    """trl_solution_reward takes `solution`; the arithmetic set has no such column: exit 2 before any model loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH",
                                                                                                      "")]))
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                        f"output_dir={tmp_path / 'run'}", "reward_workers=0", "progress_bar=false",
                        "rewards=[{function: 'reward_fns:trl_solution_reward'}]"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("grpo_dist:")]
    assert len(lines) == 1 and "'rewards[0].function'" in lines[0] and "takes solution" in lines[0], r.stderr


def test_a_dead_batch_worker_counts_the_call_and_is_replaced():
    with RewardComputer(["reward_fns:batch_crash"], num_workers=1, timeout_s=10) as rc:
        totals, _ = rc(["ok", "CRASH"], ["1", "1"])
        assert rc.last_errors == {"batch_crash": 2} and totals == [0.0, 0.0]
        totals, _ = rc(["ok", "fine"], ["1", "1"])
        assert rc.last_errors == {"batch_crash": 0} and totals == [1.0, 1.0]


def test_not_applicable_in_the_metrics_and_the_completion_log(tmp_path):
    from grpo_dist.completions import CompletionLog
    from grpo_dist.step_metrics import reward_means
    nan = float("nan")
    # one process, no process group: the mean is over the rows the function applied to
    assert reward_means({"sol": [1.0, nan, 0.0, nan], "len": [0.5] * 4}, "cpu") == \
        {"reward/sol": 0.5, "reward/len": 0.5}
    log = CompletionLog(str(tmp_path), 2, True)
    log.write(1, ["p", "p"], ["a", "b"], ["1", "1"], [1.0, 0.5], {"sol": [1.0, nan], "len": [0.0, 0.5]}, [0.1, -0.1],
              [1, 1])
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in rows] == [{"sol": 1.0, "len": 0.0}, {"sol": None, "len": 0.5}]
