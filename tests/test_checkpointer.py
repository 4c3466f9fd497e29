"""The checkpointer of stateful parts (grpo_dist/checkpointer.py): trainer_state.json is the parts' state_dicts in
the places the format had before the parts existed (so older checkpoints load), and a resume restores every part:
a save right after a resume writes the checkpoint it resumed from again, byte for byte."""

import json
from types import SimpleNamespace

import pytest

from helpers import in_process, resume_trainer


class _Part:
    def __init__(self, state):
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.fast
def test_trainer_state_puts_each_part_where_the_format_has_it():
    from grpo_dist.checkpointer import Checkpointer
    cfg = SimpleNamespace(output_dir="out", save_total_limit=None, lora=SimpleNamespace(r=0),
                          model=SimpleNamespace(name_or_path=None), verify_checkpoint_hashes=False, async_save=False)
    models = SimpleNamespace(tied_weights={}, engine=None, hf_model=None, tokenizer=None, save_format="full")
    parts = {"counters": _Part({"step": 3, "epoch": 1, "nonfinite_steps": 2}), "sampler": _Part({"order": [1, 0]}),
             "scheduler": _Part({"last_epoch": 3}), "run": _Part({"world_size": 2, "config": {"seed": 7}}),
             "sft_sampler": None, "curriculum": _Part({"counts": [4]})}
    state = Checkpointer(cfg, SimpleNamespace(), models, parts).trainer_state()
    # counters and run at the top level, the others under their names; a part the run lacks is absent
    assert state == {"step": 3, "epoch": 1, "nonfinite_steps": 2, "sampler": {"order": [1, 0]},
                     "scheduler": {"last_epoch": 3}, "world_size": 2, "config": {"seed": 7},
                     "curriculum": {"counts": [4]}}
    assert list(state) == ["step", "epoch", "sampler", "scheduler", "world_size", "nonfinite_steps", "config",
                           "curriculum"]  # the order written before the parts existed


def test_a_save_right_after_a_resume_writes_the_same_checkpoint(tmp_path):
    """Every part is restored: weights, optimizer (full state), LR schedule, counters, data cursor, RNG."""
    def run():
        first = resume_trainer([f"output_dir={tmp_path / 'a'}", "async_save=false"])
        first.train_step()
        first.nonfinite_steps = 5  # a counter that is not 0, so that a lost one shows
        saved = first.save()
        again = resume_trainer([f"output_dir={tmp_path / 'b'}", "async_save=false",
                                f"resume_from_checkpoint={saved}"])
        return saved, again.save(), again.nonfinite_steps
    saved, resaved, nonfinite = in_process(run)
    assert nonfinite == 5 and resaved.name == saved.name == "checkpoint-1"
    files = json.loads((saved / "manifest.json").read_text())["files"]
    assert files.keys() == json.loads((resaved / "manifest.json").read_text())["files"].keys()
    for name in files:
        if name != "trainer_state.json":
            assert (saved / name).read_bytes() == (resaved / name).read_bytes(), name
    state, restate = (json.loads((p / "trainer_state.json").read_text()) for p in (saved, resaved))
    for s in (state, restate):
        s["config"] = {k: v for k, v in s["config"].items() if k not in ("output_dir", "resume_from_checkpoint")}
    assert state == restate
    assert set(state) == {"step", "epoch", "nonfinite_steps", "sampler", "scheduler", "world_size", "config",
                          "save_format"}
    assert state["step"] == 1 and state["nonfinite_steps"] == 5 and state["save_format"] == "full"
