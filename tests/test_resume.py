"""Exact resume on 2 gloo ranks: 4 steps straight equal 1 (or 2) steps, a fresh trainer resuming from the checkpoint,
and the remaining steps, bit for bit in weights, optimizer and trainer state. Sampling is on (temperature 1), there
is no dropout, the reward depends on the sampled text, the LR has warmup + cosine decay. Also: resume across an
epoch boundary, from a sharded (DCP) checkpoint, at another world size, and the sharded -> HF export."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_ranks
from helpers import checkpoint_state as _state
from helpers import resume_trainer, tensors_equal

STEPS = 4


def _straight(rank, world, out, out_sharded):
    """4 steps, a full checkpoint after each; after step 2 also a sharded one (into another directory). All are
    background saves (async_save), written while the next steps train: the resumes below prove each holds the state
    of its own step."""
    tr = resume_trainer([f"output_dir={out}"])
    for _ in range(STEPS):
        tr.train_step()
        tr.save(background=True)
        if tr.step == 2:
            tr.checkpointer.with_target(output_dir=out_sharded, save_format="sharded").save(background=True)
    tr.checkpointer.saver.wait()


def _resumed(rank, world, runs):
    """For each (checkpoint, output_dir): a fresh trainer resumes from it and trains to step 4 (the real loop)."""
    for path, out in runs:
        tr = resume_trainer([f"output_dir={out}", f"resume_from_checkpoint={path}"])
        assert tr.step == int(path.rsplit("-", 1)[1])
        assert tr.train() == 0


def _one_rank(rank, world, full_ckpt, sharded_ckpt, out):
    """World size 2 -> 1: a clear error when the global batch would change; with prompts_per_rank doubled the full
    and the sharded checkpoint both load the same state, and training goes on."""
    from grpo_dist.data import DataError
    with pytest.raises(DataError) as err:
        resume_trainer([f"output_dir={out}/a", f"resume_from_checkpoint={full_ckpt}"])
    states = []
    for i, path in enumerate([full_ckpt, sharded_ckpt]):
        # max_steps as in the checkpoint: a changed max_steps changes the LR schedule, which a resume now applies
        tr = resume_trainer([f"output_dir={out}/{i}", f"resume_from_checkpoint={path}", "prompts_per_rank=4"])
        model_sd, optim_sd = tr.engine.gather_full_state()
        # deepcopy: the gathered optimizer state shares its `step` tensors with the live optimizer
        states.append(copy.deepcopy((model_sd, optim_sd, tr.sampler.state_dict())))
        assert tr.train() == 0 and tr.step == STEPS
    return str(err.value), states


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    run_ranks(_straight, 2, tmp, tmp / "a", tmp / "s")
    return tmp


def test_resume_is_bitwise_exact_mid_epoch_at_epoch_boundary_and_from_sharded(straight, tmp_path):
    a = straight / "a"
    # The weights move at every step (no weight decay: only gradients of sampled, rewarded text move them),
    # so equality below is not trivially true.
    w = [load_file(str(a / f"checkpoint-{s}" / "model.safetensors")) for s in range(1, STEPS + 1)]
    for s in range(STEPS - 1):
        assert max((w[s][k] - w[s + 1][k]).abs().max().item() for k in w[s]) > 1e-6, f"step {s + 2} moved nothing"
    epochs = [json.loads((a / f"checkpoint-{s}" / "trainer_state.json").read_text())["sampler"]
              for s in range(1, STEPS + 1)]
    assert [(e["epoch"], e["step_in_epoch"]) for e in epochs] == [(0, 1), (1, 0), (1, 1), (2, 0)]

    runs = [(str(a / "checkpoint-1"), str(tmp_path / "mid_epoch")),
            (str(a / "checkpoint-2"), str(tmp_path / "epoch_boundary")),
            (str(straight / "s" / "checkpoint-2"), str(tmp_path / "from_sharded"))]
    run_ranks(_resumed, 2, tmp_path, runs)
    want = _state(a / f"checkpoint-{STEPS}")
    for _, out in runs:
        got = _state(tmp_path / out / f"checkpoint-{STEPS}")
        tensors_equal(got, want, out)
        metrics = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["step"] == STEPS


def test_other_world_size_needs_same_global_batch_and_maps_full_and_sharded_state(straight, tmp_path):
    full, sharded = straight / "a" / "checkpoint-2", straight / "s" / "checkpoint-2"
    message, states = run_ranks(_one_rank, 1, tmp_path, str(full), str(sharded), str(tmp_path))[0]
    assert "global batch" in message and "prompts_per_rank=4" in message and str(full) in message
    want_model, want_optim, _ = _state(full)
    for model_sd, optim_sd, sampler in states:
        tensors_equal(model_sd, want_model, "model")
        tensors_equal(optim_sd, want_optim, "optimizer")
        assert (sampler["epoch"], sampler["step_in_epoch"], sampler["world_size"]) == (1, 0, 1)


def test_sharded_export_loads_with_from_pretrained_like_full_state(straight, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_dist.tools.export_checkpoint import main as export_main
    full, sharded = straight / "a" / "checkpoint-2", straight / "s" / "checkpoint-2"
    assert not (sharded / "model.safetensors").exists() and (sharded / "sharded" / ".metadata").is_file()
    want = AutoModelForCausalLM.from_pretrained(full).state_dict()
    assert export_main([str(sharded), str(tmp_path / "one")]) == 0
    assert export_main([str(sharded), str(tmp_path / "many"), "--max-shard-size", "20KB"]) == 0
    assert len(list((tmp_path / "many").glob("model-*-of-*.safetensors"))) > 2
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    for name in ("one", "many"):
        got = AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
        tensors_equal(got, want, name)
    assert export_main([str(sharded), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).state_dict()
    tensors_equal(bf16, {k: v.to(torch.bfloat16) for k, v in want.items()}, "bf16")
    assert export_main([str(full), str(tmp_path / "x")]) == 2  # a full-state checkpoint needs no export
