"""Asynchronous GRPO (grpo_dist/async_rollout.py) when something goes wrong, and its command line: a trainer rank
that dies, a trainer that fails with an exception (its Abort reaches the rollout rank at once), a rollout rank
slow by 10x (waited for: the run finishes), a reward function that hangs on the rollout rank (the reward timeout
applies there, counted and reported once), `python -m grpo_dist.train ... rollout_ranks=1` under torchrun, and
trainer ranks that build no generation replica. Faults from GRPO_DIST_FAULT (grpo_dist/faults.py); tiny model,
2-4 steps, small distributed.timeout_s."""

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dist_utils import free_port, run_ranks
from helpers import RESUME_BASE, async_rank

ROOT = Path(__file__).resolve().parents[1]
BASE = [o for o in RESUME_BASE if not o.startswith(("max_steps", "report_to", "distributed.timeout_s"))] + \
    ["save_final=false", "save_steps=0", "report_to=[jsonl]"]


# ------------------------------------------------------------------- ranks through train.main, as a launcher runs them
def _main_entry(rank, world_size, port, out_dir, argv, env):
    """One rank of `python -m grpo_dist.train`: its stderr, exit code and end time go to out_dir."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env)
    torch.set_num_threads(1)
    err = open(os.path.join(out_dir, f"rank{rank}.err"), "w")
    os.dup2(err.fileno(), 2)
    try:
        from grpo_dist.train import main
        code = str(main(argv))
    except BaseException:
        code = "raised " + traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.code"), "w") as f:
        f.write(code)
    sys.stderr.flush()
    os._exit(0)


def _launch(tmp_path, world_size, overrides, env=None, limit_s=240, wait_for=None):
    """{rank: {"code", "err" (stderr), "ended" (time.time() its process ended, None if it was killed)}}.
    wait_for: the ranks whose end is awaited (default all); the others are killed then."""
    out = tmp_path / "ranks"
    out.mkdir()
    argv = BASE + [f"output_dir={tmp_path / 'run'}"] + overrides
    ctx = mp.start_processes(_main_entry, args=(world_size, free_port(), str(out), argv, env or {}),
                             nprocs=world_size, join=False, start_method="spawn")
    ended: dict = {}
    deadline = time.time() + limit_s
    awaited = set(range(world_size) if wait_for is None else wait_for)
    while not awaited <= set(ended) and time.time() < deadline:
        for r, p in enumerate(ctx.processes):
            if r not in ended and not p.is_alive():
                ended[r] = time.time()
        time.sleep(0.1)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    result = {}
    for r in range(world_size):
        code = out / f"rank{r}.code"
        result[r] = {"code": code.read_text() if code.is_file() else None, "ended": ended.get(r),
                     "err": (out / f"rank{r}.err").read_text() if (out / f"rank{r}.err").is_file() else ""}
    return result


def _lines(err, prefix):
    return [x for x in err.splitlines() if x.startswith(prefix)]


@pytest.mark.slow
def test_a_trainer_rank_that_dies_ends_the_other_trainer_and_the_rollout_rank(tmp_path):
    """2 trainers + 1 rollout rank serving both; trainer rank 1 SIGKILLs itself in the middle of step 2."""
    timeout = 20
    r = _launch(tmp_path, 3, ["max_steps=4", "rollout_ranks=1", "prompts_per_rank=1",
                              f"distributed.timeout_s={timeout}"], {"GRPO_DIST_FAULT": "kill@step2@rank1"})
    assert "rank 1 kills itself (kill at step 2)" in r[1]["err"], r[1]["err"][-2000:]
    killed = r[1]["ended"]
    # the other trainer: the watchdog's line names the dead rank (exit 4: a peer failed)
    assert r[0]["code"] == "4", (r[0]["code"], r[0]["err"][-3000:])
    line = _lines(r[0]["err"], "grpo_dist: rank 0:")
    assert len(line) == 1 and "rank 1 is dead" in line[0], r[0]["err"][-3000:]
    # the rollout rank: one line naming the rank it waited for and what for, exit 4 (a peer failed)
    assert r[2]["code"] == "4", (r[2]["code"], r[2]["err"][-3000:])
    line = _lines(r[2]["err"], "grpo_dist: rank 2 (rollout)")
    assert len(line) == 1, r[2]["err"][-3000:]
    assert "the version header of batch" in line[0] or "the prompts of batch" in line[0], line
    assert "rank 0" in line[0] or "rank 1" in line[0], line
    # both within distributed.timeout_s of the death (plus the watchdog's few seconds of settling)
    for rank in (0, 2):
        assert r[rank]["ended"] - killed < timeout + 10, (rank, r[rank]["ended"] - killed)


@pytest.mark.slow
def test_a_trainer_that_fails_tells_the_rollout_rank_which_stops_at_once(tmp_path):
    """The trainer raises NonFiniteError at step 2 (a NaN loss, max_consecutive_nonfinite=1): its Abort reaches
    the rollout rank, which stops within seconds (not after distributed.timeout_s) with the trainer's error."""
    timeout = 30
    r = _launch(tmp_path, 2, ["max_steps=4", "rollout_ranks=1", "max_consecutive_nonfinite=1",
                              f"distributed.timeout_s={timeout}"], {"GRPO_DIST_FAULT": "nan@step2@rank0"})
    assert r[0]["code"] == "3", (r[0]["code"], r[0]["err"][-3000:])  # NONFINITE_EXIT_CODE
    assert r[1]["code"] == "4", (r[1]["code"], r[1]["err"][-3000:])  # a peer failed
    line = _lines(r[1]["err"], "grpo_dist: rank 1 (rollout)")
    assert len(line) == 1, r[1]["err"][-3000:]
    assert line[0].startswith("grpo_dist: rank 1 (rollout) stopped waiting for the version header of batch 2: "
                              "rank 0 (trainer) failed: NonFiniteError: "), line
    assert r[1]["ended"] - r[0]["ended"] < 5, r[1]["ended"] - r[0]["ended"]


@pytest.mark.slow
def test_sigterm_to_the_rollout_rank_checkpoints_and_exits_75(tmp_path):
    """SIGTERM reaches the rollout rank alone while it samples batch 1 (max_staleness 1: batches in flight). It
    finishes the batch and flags it; the trainer trains step 2, writes checkpoint-2 and exits 75, draining what is in
    flight; the rollout rank exits 75 at the stop header. (Before: the rollout rank died of the signal and the
    trainer exited 1 without a checkpoint.)"""
    r = _launch(tmp_path, 2, ["max_steps=6", "rollout_ranks=1", "max_staleness=1", "distributed.timeout_s=60"],
                {"GRPO_DIST_FAULT": "term@step2@rank1"})
    assert r[0]["code"] == "75", (r[0]["code"], r[0]["err"][-3000:])
    assert r[1]["code"] == "75", (r[1]["code"], r[1]["err"][-3000:])
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (run / "checkpoint-2" / "manifest.json").is_file()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "rank 1 (rollout): stop requested" in r[1]["err"], r[1]["err"][-2000:]


@pytest.mark.slow
def test_a_stopped_rollout_rank_ends_the_trainer_with_exit_4_naming_it(tmp_path):
    """SIGSTOP of the rollout rank while it samples batch 1: the trainer gives up after distributed.timeout_s with
    exit 4 (a peer failed; before: 1) and one line naming rank 1, its role, its last phase and its state."""
    timeout = 10
    r = _launch(tmp_path, 2, ["max_steps=4", "rollout_ranks=1", f"distributed.timeout_s={timeout}"],
                {"GRPO_DIST_FAULT": "stop@step2@rank1"}, limit_s=120, wait_for=[0])
    assert r[0]["code"] == "4", (r[0]["code"], r[0]["err"][-3000:])
    line = _lines(r[0]["err"], "grpo_dist: rank 0 (trainer)")
    assert len(line) == 1, r[0]["err"][-3000:]
    assert "the completions of batch 1 from rank 1 (rollout)" in line[0], line
    assert "it last reported 'rollout' at step 1" in line[0] and "stopped (SIGSTOP)" in line[0], line


# ------------------------------------------------------------------------------------- a slow rollout rank (objects)
def _train(rank, world_size, overrides, out_dir, env):
    from grpo_dist.async_rollout import PeerLost
    os.environ.update(env)
    trainer, served = async_rank(BASE + overrides, out_dir)
    if trainer is None:
        return {"served": served}
    held = {"replica": trainer.gen_model is not None, "engine": type(trainer.rollout_engine).__name__,
            "params": _params(trainer), "replica_params": _params(trainer, replica_only=True)}
    if env.get("build_only"):
        return held
    try:
        code = trainer.train()
    except PeerLost as e:
        return {"lost": str(e)}
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {"code": code, "metrics": metrics, **held}


def _params(trainer, replica_only=False) -> int:
    """Parameters of every model this rank holds: policy, reference, generation replica (or of the replica)."""
    models = [trainer.gen_model] if replica_only else [trainer.engine.module, trainer.ref_model, trainer.gen_model]
    return sum(p.numel() for m in models if isinstance(m, torch.nn.Module) for p in m.parameters())


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    """1 trainer + 1 rollout rank at max_staleness 1; the rollout rank is 10x slow from batch 2 on."""
    tmp = tmp_path_factory.mktemp("slow")
    return run_ranks(_train, 2, tmp, ["max_steps=3", "rollout_ranks=1", "max_staleness=1",
                                      "distributed.timeout_s=30"], str(tmp / "run"),
                     {"GRPO_DIST_FAULT": "slow@step2@rank1"})


@pytest.mark.slow
def test_a_rollout_rank_slow_by_10x_is_waited_for_and_shows_in_the_idle_fraction(slow_run):
    trainer, rollout = slow_run
    assert rollout == {"served": 0}
    assert trainer.get("code") == 0, trainer.get("lost")
    m = trainer["metrics"]
    assert [x["async/lag_max"] for x in m] == [0, 1, 1]
    idle = [x["async/trainer_idle_fraction"] for x in m]
    print("trainer idle", idle, "sync", [x["async/weight_sync_s"] for x in m],
          "rollout idle", [x["async/rollout_idle_fraction"] for x in m])
    # not a timing bar (the shares move with the machine's load): the 9x sleep of batches 1 and 2 only has to show
    # as more waiting than for batch 0, in step 2 or 3 (which one moves with the load: the push after step 1 no
    # longer waits for batch 1 to finish, so that wait is the trainer's idle time of step 2, not sync time)
    assert all(0.0 <= x <= 1.0 for x in idle) and max(idle[1:]) > idle[0], idle


@pytest.mark.slow
def test_trainer_ranks_build_no_generation_replica(slow_run, tmp_path):
    trainer = slow_run[0]
    assert trainer["replica"] is False and trainer["engine"] == "RolloutsElsewhere"
    colocated = run_ranks(_train, 1, tmp_path, [], str(tmp_path / "colocated"), {"build_only": "1"})[0]
    assert colocated["replica"] is True and colocated["engine"] == "ReplicaRolloutEngine"
    # the same policy and reference on both: what the trainer rank no longer holds is the whole replica
    assert colocated["replica_params"] > 0
    assert colocated["params"] - trainer["params"] == colocated["replica_params"], (colocated, trainer["params"])


# --------------------------------------------------------------------------------------------------- the command line
@pytest.mark.slow
def test_command_line_under_torchrun_with_a_reward_that_hangs_on_the_rollout_rank(tmp_path):
    """`torchrun -m grpo_dist.train ... rollout_ranks=1`: exit 0, async/* metrics every step with the lag of
    max_staleness 1; the reward function hangs on one completion on the rollout rank: reward_timeout_s cuts it,
    the run goes on, the timeout is counted in reward_errors/ and reported once."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               GRPO_DIST_TEST_HANG_ONCE=str(tmp_path / "hung"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop("GRPO_DIST_FAULT", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", "-m", "grpo_dist.train", *BASE, f"output_dir={out}", "max_steps=3",
            "rollout_ranks=1", "max_staleness=1", "distributed.timeout_s=30", "reward_workers=1",
            "reward_timeout_s=2", "rewards=[{function: 'reward_fns:hangs_once', name: hang}]"]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["async/lag_max"] for m in metrics] == [0, 1, 1]
    assert all(m["async/dropped"] == 0 and 0 <= m["async/trainer_idle_fraction"] <= 1 for m in metrics)
    assert metrics[0]["async/weight_sync_bytes"] > 0
    assert sum(m["reward_errors/hang"] for m in metrics) == 1  # the one hung completion, cut and counted
    reported = [x for x in r.stderr.splitlines() if "reward function 'hang'" in x]
    assert len(reported) == 1 and "timed out after 2 s (reward_timeout_s)" in reported[0], r.stderr[-3000:]
    assert "[grpo_dist] done: step 3" in r.stdout, r.stdout[-2000:]


def test_a_reward_timeout_the_trainers_wait_cannot_cover_is_refused_at_start():
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + ["rollout_ranks=1", "reward_timeout_s=30", "distributed.timeout_s=30"])
    assert str(e.value).startswith("command line: config key 'reward_timeout_s' = 30 is not below "
                                   "distributed.timeout_s = 30")
    load_config(None, BASE + ["reward_timeout_s=30", "distributed.timeout_s=30"])  # colocated: as before
