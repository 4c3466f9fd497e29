"""Nothing lost around checkpoints, 2 gloo ranks, FSDP1 and FSDP2. Before the first optimizer step the optimizer
has no state, and torch's DCP state-dict calls fill it by a zero-gradient step (step 1, zero moments), which shifts
Adam's bias correction of every later step. Here: N steps after a gather of the full state at step 0, after a full
and after a sharded checkpoint at step 0, and resumed from either checkpoint, all equal N plain steps bit for bit
(weights and optimizer state)."""

import copy

import pytest

from dist_utils import run_ranks
from helpers import resume_trainer, tensors_equal

STEPS = 2  # trainer steps; num_iterations=2 (RESUME_BASE): 2 optimizer steps each


def _final(tr):
    for _ in range(STEPS):
        tr.train_step()
    sd, optim = tr.engine.gather_full_state()
    return copy.deepcopy((sd, optim)) if tr.ctx.is_main else None


def _runs(rank, world, backend, out):
    """{variant: rank 0's final (weights, optimizer state)} after STEPS steps."""
    base = [f"distributed.backend={backend}", f"max_steps={STEPS}"]
    got = {}
    tr = resume_trainer(base + [f"output_dir={out}/plain"])
    got["plain"] = _final(tr)
    tr = resume_trainer(base + [f"output_dir={out}/gather"])
    tr.engine.gather_full_state()  # an eval / export before any step
    got["gather"] = _final(tr)
    for fmt in ("full", "sharded"):
        tr = resume_trainer(base + [f"output_dir={out}/{fmt}", f"save_format={fmt}"])
        ckpt = tr.save()  # checkpoint-0
        got[f"save_{fmt}"] = _final(tr)
        tr = resume_trainer(base + [f"output_dir={out}/{fmt}_resumed", f"save_format={fmt}",
                                    f"resume_from_checkpoint={ckpt}"])
        assert tr.step == 0
        got[f"resumed_{fmt}"] = _final(tr)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "fsdp2"])
def test_state_taken_before_the_first_step_changes_nothing(backend, tmp_path):
    got = run_ranks(_runs, 2, tmp_path, backend, str(tmp_path / "out"), timeout=600)[0]
    plain = got.pop("plain")
    assert plain[1]["state"] and all(int(s["step"]) == 2 * STEPS for s in plain[1]["state"].values())
    for name, state in got.items():
        tensors_equal(plain, state, f"{backend} {name}")


# ------------------------------------------------------------------ loading an optimizer state: the same calls
def _load_without_optimizer(rank, world, out):
    """FSDP1: rank 0 loads weights and no optimizer state (optim_state None): every rank must skip the optimizer
    load alike (it used to be rank 0 alone, the others waiting in its broadcast until the timeout)."""
    tr = resume_trainer(["distributed.backend=fsdp", f"output_dir={out}", "distributed.timeout_s=20"])
    tr.train_step()
    sd, _ = tr.engine.gather_full_state()
    before = copy.deepcopy(tr.engine.optimizer.state_dict())
    tr.engine.load_full_state(sd, None)
    tensors_equal(before, tr.engine.optimizer.state_dict(), f"rank {rank} optimizer")
    tr.train_step()  # and the ranks still agree on their collectives
    return tr.step


def test_fsdp1_load_without_optimizer_state_runs_the_same_calls_on_every_rank(tmp_path):
    assert run_ranks(_load_without_optimizer, 2, tmp_path, str(tmp_path / "out"), timeout=120) == [2, 2]


def _absent_entries(rank, world, out, extra):
    """1 step, a full checkpoint, 1 more step; a fresh trainer resumes from the checkpoint and takes that step.
    Returns the names this rank's optimizer holds state for, and rank 0's two final states."""
    base = ["distributed.backend=fsdp", "max_steps=2"] + extra
    tr = resume_trainer(base + [f"output_dir={out}/a"])
    tr.train_step()
    ckpt = tr.save()
    names = {id(p): n for n, p in tr.engine.module.named_parameters()}
    held = sorted(names[id(p)] for p in tr.engine.optimizer.state)
    straight = _final_after(tr, 1)
    tr = resume_trainer(base + [f"output_dir={out}/b", f"resume_from_checkpoint={ckpt}"])
    return held, straight, _final_after(tr, 1)


def _final_after(tr, steps):
    for _ in range(steps):
        tr.train_step()
    sd, optim = tr.engine.gather_full_state()
    return copy.deepcopy((sd, optim)) if tr.ctx.is_main else None


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj, v_proj]"]],
                         ids=["full", "lora"])
def test_fsdp1_resume_with_optimizer_entries_absent_on_a_rank(extra, tmp_path):
    (held0, straight, resumed), (held1, _, _) = run_ranks(_absent_entries, 2, tmp_path, str(tmp_path / "o"), extra)
    assert held0 and held1
    if extra:  # frozen base weights: no optimizer entries at all (each adapter is a unit of its own, split in two)
        assert all(".lora_" in n for n in held0 + held1)
    else:  # one unit's flat parameter split in two: a parameter wholly in one rank's half has no state on the other
        assert set(held0) != set(held1), (held0, held1)
    tensors_equal(straight, resumed, "resumed")


# ------------------------------------------------------------- a checkpoint that only rank 0 sees (full format)
def _rank0_sees(rank, world, out):
    """LoRA (whose load gathers the base weights: a collective), full format, FSDP1: a checkpoint after 1 step is
    loaded by fresh trainers, once with every rank given its path, once with rank 1 given an empty directory (its
    node-local disk: a full checkpoint is read by rank 0 alone), then by a trainer's resume_from_checkpoint where rank
    1 cannot read trainer_state.json. Rank 0 returns the three loaded states."""
    import os

    from grpo_dist import checkpoint as ckpt
    base = ["distributed.backend=fsdp", "lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj, v_proj]",
            "distributed.timeout_s=20"]
    tr = resume_trainer(base + [f"output_dir={out}/a"])
    tr.train_step()
    saved = tr.save()
    elsewhere = f"{out}/empty"
    os.makedirs(elsewhere, exist_ok=True)
    got = []
    for path in (saved, saved if rank == 0 else elsewhere):
        tr = resume_trainer(base + [f"output_dir={out}/b"])
        state = ckpt.load_checkpoint(path, tr.engine, tr.ctx, tied=tr.tied_weights)
        assert state["step"] == 1
        sd, optim = tr.engine.gather_full_state()
        got.append(copy.deepcopy((sd, optim)) if rank == 0 else None)
    # the trainer's resume: rank 1 cannot read the trainer state (stands in for a directory it does not see)
    if rank == 1:
        def unreadable(path):
            raise FileNotFoundError(f"{path}/trainer_state.json")
        ckpt.read_trainer_state = unreadable
    tr = resume_trainer(base + [f"output_dir={out}/c", f"resume_from_checkpoint={saved}"])
    assert tr.step == 1
    sd, optim = tr.engine.gather_full_state()
    got.append(copy.deepcopy((sd, optim)) if rank == 0 else None)
    return got


@pytest.mark.slow
def test_full_checkpoint_seen_by_rank0_alone_loads_the_same(tmp_path):
    both, rank0_only, trainer = run_ranks(_rank0_sees, 2, tmp_path, str(tmp_path / "o"), timeout=180)[0]
    assert both[1]["state"]
    tensors_equal(both, rank0_only, "rank 0 alone")
    tensors_equal(both, trainer, "resume_from_checkpoint, rank 0 alone reads")
