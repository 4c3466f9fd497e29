"""One rank in full precision runs the models unwrapped (engines/local.py), and its checkpoints are the FSDP engine's:
a one-rank checkpoint resumes on two FSDP ranks with the same weights and optimizer state, bit for bit.
(The 2-rank FSDP step equal to the 1-process step for every loss type is tests/test_equivalence.py, whose
1-process side now runs on this engine; FSDP -> one rank is tests/test_resume.py.)"""

import contextlib
import copy

import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from grpo_dist.engines.fsdp import clean_name

from dist_utils import run_ranks
from test_resume import _tensors_equal, _trainer


def _engine_kind(rank, world, extra):
    tr = _trainer(["output_dir=/tmp/unused_local_engine", "save_final=false"] + extra)
    with torch.no_grad():  # make the policy differ from the replica's initial copy
        for p in tr.engine.module.parameters():
            p.add_(0.01)
    tr.engine.copy_weights_to(tr.gen_model)
    replica = dict(tr.gen_model.named_parameters())
    module = tr.engine.module
    full = FSDP.summon_full_params(module, writeback=False) if isinstance(module, FSDP) else contextlib.nullcontext()
    with full:  # the replica holds the policy's weights, cast to its own dtype
        refreshed = all(torch.equal(replica[clean_name(k)], p.to(replica[clean_name(k)].dtype))
                        for k, p in module.named_parameters())
    # buffers keep their dtype (RoPE's inv_freq in fp32, as the training forward has it)
    assert {b.dtype for b in tr.gen_model.buffers() if b.is_floating_point()} == {torch.float32}
    return type(tr.engine).__name__, type(tr.ref_model).__name__, {p.dtype for p in replica.values()}, refreshed


def test_engine_choice_and_the_generation_replica_dtype(tmp_path):
    assert run_ranks(_engine_kind, 1, tmp_path, [])[0] == \
        ("LocalEngine", "Qwen2ForCausalLM", {torch.float32}, True)
    # mixed precision keeps FSDP's MixedPrecision semantics even on one rank, and the replica samples in bf16
    assert run_ranks(_engine_kind, 1, tmp_path, ["distributed.mixed_precision=bf16"])[0] == \
        ("FSDPEngine", "FullyShardedDataParallel", {torch.bfloat16}, True)
    assert run_ranks(_engine_kind, 2, tmp_path, []) == \
        [("FSDPEngine", "FullyShardedDataParallel", {torch.float32}, True)] * 2


def _one_rank_run(rank, world, out):
    tr = _trainer([f"output_dir={out}", "prompts_per_rank=4", "max_steps=1", "save_steps=1"])
    assert tr.train() == 0


def _two_rank_resume(rank, world, ckpt, out):
    tr = _trainer([f"output_dir={out}", f"resume_from_checkpoint={ckpt}", "max_steps=2"])
    state = copy.deepcopy(tr.engine.gather_full_state())
    assert tr.train() == 0 and tr.step == 2
    return state


def test_one_rank_checkpoint_resumes_on_two_fsdp_ranks(tmp_path):
    run_ranks(_one_rank_run, 1, tmp_path, str(tmp_path / "one"))
    ckpt = tmp_path / "one" / "checkpoint-1"
    (model_sd, optim_sd), _ = run_ranks(_two_rank_resume, 2, tmp_path, str(ckpt), str(tmp_path / "two"))
    _tensors_equal(model_sd, load_file(str(ckpt / "model.safetensors")), "model")
    saved_optim = torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert saved_optim["state"], "the one-rank run saved no optimizer state"
    _tensors_equal(optim_sd, saved_optim, "optimizer")
    assert (tmp_path / "two" / "checkpoint-2" / "model.safetensors").is_file()
