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
