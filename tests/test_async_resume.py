"""Asynchronous GRPO resumed mid-flight (grpo_dist/async_rollout.py, docs/async.md): a trainer rank SIGKILLed
while batches are in flight on the rollout ranks, the job resumed with resume_from_checkpoint=auto. From the record
of the prompts each step trained (GRPO_DIST_TRAINED_PROMPTS, grpo_dist/trained_prompts.py): the killed run's
checkpointed steps followed by the resumed run's steps are the prompt sequence written out from the sampler's
epoch permutations (which the uninterrupted run trains), each prompt once per epoch. At max_staleness 0 the resumed
weights and optimizer state equal the uninterrupted run's bitwise (the colocated run on as many ranks as there are
trainers: bitwise the same as the asynchronous one, tests/test_async.py); at max_staleness 1 the regenerated
batches were sampled by the resumed weights (their lag says so). Also the trainer group's checkpoint broadcast."""

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from dist_utils import free_port, run_ranks
from helpers import RESUME_BASE, async_rank, tensors_equal

STEPS, SAVE, EXAMPLES = 5, 2, 8  # global batch 2: 4 steps per epoch, step 5 starts the second epoch
BASE = [o for o in RESUME_BASE if not o.startswith(("max_steps", "report_to", "distributed.timeout_s",
                                                     "prompts_per_rank", "data.limit"))] + \
    [f"max_steps={STEPS}", f"save_steps={SAVE}", "save_final=false", "report_to=[jsonl]",
     "distributed.timeout_s=60", f"data.limit={EXAMPLES}", "resume_from_checkpoint=auto"]


def _overrides(trainers: int, rollouts: int, k: int = 0) -> list[str]:
    return BASE + [f"prompts_per_rank={2 // trainers}", f"rollout_ranks={rollouts}", f"max_staleness={k}"]


def _train(rank, world_size, overrides, out_dir, record_dir, fault=""):
    os.environ["GRPO_DIST_TRAINED_PROMPTS"] = record_dir
    os.environ["GRPO_DIST_FAULT"] = fault
    trainer, served = async_rank(overrides, out_dir)
    if trainer is None:
        return {"served": served}
    start = trainer.step
    code = trainer.train()
    sd, osd = trainer.engine.gather_full_state()
    if rank != 0:
        return None
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {"code": code, "start": start, "model": {k: v.clone() for k, v in sd.items()}, "optim": osd,
            "metrics": metrics}


def _killed_entry(rank, world_size, port, overrides, out_dir, record_dir, fault):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    _train(rank, world_size, overrides, out_dir, record_dir, fault)
    os._exit(0)  # not reached by the killed rank; the others are killed while they wait for it


def _run_killed(world_size, overrides, out_dir, record_dir, fault, victim):
    """The job dies as under torchrun: the victim SIGKILLs itself, then every other rank is killed."""
    ctx = mp.start_processes(_killed_entry, args=(world_size, free_port(), overrides, out_dir, record_dir, fault),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.time() + 300
    while ctx.processes[victim].is_alive() and time.time() < deadline:
        time.sleep(0.5)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join()
    return codes


def _trained(record_dir, trainers):
    """{step: the step's global batch of example indices (trainer ranks in order)} from the record."""
    lines = {}
    for r in range(trainers):
        for line in open(os.path.join(record_dir, f"rank{r}.jsonl")):
            d = json.loads(line)
            assert (d["step"], r) not in lines, f"step {d['step']} drawn twice on rank {r}"
            lines[d["step"], r] = d
    steps = sorted({s for s, _ in lines})
    assert all((s, r) in lines for s in steps for r in range(trainers))  # every trainer trains every step
    assert all(len({lines[s, r]["batch_number"] for r in range(trainers)}) == 1 for s in steps)
    return {s: [i for r in range(trainers) for i in lines[s, r]["examples"]] for s in steps}


def _sampler_order(seed: int) -> list[list[int]]:
    """The prompt order written out: global batch b of 2 is positions 2b', 2b'+1 of epoch b // 4's permutation,
    numpy PCG64 seeded with (seed, epoch) (grpo_dist/data/sampler.py), b' = b mod 4."""
    import numpy as np
    out = []
    for b in range(STEPS):
        epoch, at = divmod(b, EXAMPLES // 2)
        perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(EXAMPLES)
        out.append([int(i) for i in perm[2 * at:2 * at + 2]])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trainers, k", [(2, 0), (2, 1)], ids=["2+2-k0", "2+2-k1"])  # 2 ranks of each kind (issue 23)
def test_resume_mid_flight_trains_every_prompt_once_and_at_k0_bitwise(tmp_path, trainers, k):
    from grpo_dist.config import load_config
    world, overrides = 2 * trainers, _overrides(trainers, trainers, k)
    order = _sampler_order(load_config(None, overrides).seed)
    assert sorted(i for s in range(4) for i in order[s]) == list(range(EXAMPLES))  # epoch 0: every prompt once

    # Step 3's weight sync sends the prompts of step 4 + k (batch 3 + k): the victim (the last trainer rank) dies
    # once its rollout rank took them. checkpoint-2 is the last; batches 2 + k .. 3 + k are in flight (at k = 1,
    # batch 3 went out before checkpoint-2 was written).
    # async_save=false in the killed run: a background checkpoint-2 could still be writing when the victim dies
    # (seen under load); this test is about the batches in flight, not about a kill during a write
    out, victim = tmp_path / "run", trainers - 1
    codes = _run_killed(world, overrides + ["async_save=false"], str(out), str(tmp_path / "rec_k"),
                        f"kill_sent@step{4 + k}@rank{victim}", victim)
    assert codes[victim] == -9, codes  # SIGKILLed by the fault, not ended by anything else
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    killed = _trained(tmp_path / "rec_k", trainers)
    assert max(killed) == 3  # step 3 trained and never checkpointed: its prompts must be trained again

    resumed = run_ranks(_train, world, tmp_path, overrides, str(out), str(tmp_path / "rec_r"))
    assert all(r == {"served": 0} for r in resumed[trainers:])
    b = resumed[0]
    assert b["code"] == 0 and b["start"] == SAVE
    resumed_order = _trained(tmp_path / "rec_r", trainers)
    assert list(resumed_order) == list(range(SAVE + 1, STEPS + 1))
    # no prompt lost, none trained twice: checkpointed steps + resumed steps == the uninterrupted sequence
    assert [killed[s] for s in range(1, SAVE + 1)] + list(resumed_order.values()) == order

    # metrics.jsonl: steps 1-2 of the killed run, then the resumed 3-5. Uninterrupted, batch j has lag min(j, k);
    # resumed, batches 2 .. 2 + k are sampled again with version 2 (the checkpoint's weights): lag 0 .. k, then k
    assert [m["step"] for m in b["metrics"]] == list(range(1, STEPS + 1))
    lags = [m["async/lag_max"] for m in b["metrics"]]
    assert lags == [min(j, k) for j in range(SAVE)] + [min(j, k) for j in range(STEPS - SAVE)]
    if k == 0:  # the uninterrupted run, colocated on as many ranks: the same order, bitwise the same state
        a = run_ranks(_train, trainers, tmp_path, _overrides(trainers, 0), str(tmp_path / "straight"),
                      str(tmp_path / "rec_s"))[0]
        assert list(_trained(tmp_path / "rec_s", trainers).values()) == order
        assert a["code"] == 0 and any(float(m["grad_norm"]) > 0 for m in a["metrics"])  # the weights moved
        tensors_equal(a["model"], b["model"], "model")
        tensors_equal(a["optim"], b["optim"], "optimizer")
        assert [m["loss"] for m in a["metrics"]] == [m["loss"] for m in b["metrics"]]


def _broadcast_in_subgroup(rank, world_size):
    import torch.distributed as dist

    from grpo_dist import distributed as gdist
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    if rank == 2:  # outside the group, as a rollout rank: it joins no broadcast
        return None
    gdist.use_group(group)
    mine = {"w": torch.arange(6.0).reshape(2, 3), "state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]} if rank == 0 else {"junk": 1}
    return gdist.broadcast_state(mine, torch.device("cpu")), gdist.broadcast_state(None, torch.device("cpu"))


@pytest.mark.slow  # three processes
def test_broadcast_state_copies_rank0s_dicts_within_the_trainer_group(tmp_path):
    got = run_ranks(_broadcast_in_subgroup, 3, tmp_path, timeout=120)
    assert got[2] is None
    for state, none in got[:2]:
        assert none is None
        tensors_equal(state, {"w": torch.arange(6.0).reshape(2, 3),
                              "state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}, "state")
