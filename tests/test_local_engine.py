"""One rank in full precision runs the models unwrapped (engines/local.py), and its checkpoints are the FSDP engine's:
a one-rank checkpoint resumes on two FSDP ranks with the same weights and optimizer state, bit for bit.
(The 2-rank FSDP step equal to the 1-process step for every loss type is tests/test_equivalence.py, whose
1-process side now runs on this engine; FSDP -> one rank is tests/test_resume.py.)"""

import contextlib
import copy

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from grpo_dist.engines import clean_name

from dist_utils import run_ranks
from helpers import resume_trainer, tensors_equal


def _engine_kind(rank, world, extra):
    tr = resume_trainer(["output_dir=/tmp/unused_local_engine", "save_final=false"] + extra)
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
    tr = resume_trainer([f"output_dir={out}", "prompts_per_rank=4", "max_steps=1", "save_steps=1"])
    assert tr.train() == 0


def _two_rank_resume(rank, world, ckpt, out):
    tr = resume_trainer([f"output_dir={out}", f"resume_from_checkpoint={ckpt}", "max_steps=2"])
    state = copy.deepcopy(tr.engine.gather_full_state())
    assert tr.train() == 0 and tr.step == 2
    return state


def test_one_rank_checkpoint_resumes_on_two_fsdp_ranks(tmp_path):
    run_ranks(_one_rank_run, 1, tmp_path, str(tmp_path / "one"))
    ckpt = tmp_path / "one" / "checkpoint-1"
    (model_sd, optim_sd), _ = run_ranks(_two_rank_resume, 2, tmp_path, str(ckpt), str(tmp_path / "two"))
    tensors_equal(model_sd, load_file(str(ckpt / "model.safetensors")), "model")
    saved_optim = torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert saved_optim["state"], "the one-rank run saved no optimizer state"
    tensors_equal(optim_sd, saved_optim, "optimizer")
    assert (tmp_path / "two" / "checkpoint-2" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- FSDP unit choice
def _fsdp_units(rank, world, extra):
    tr = resume_trainer(["output_dir=/tmp/unused_fsdp_units", "save_final=false"] + extra)
    layers = tr.gen_model.config.num_hidden_layers
    return len(FSDP.fsdp_modules(tr.engine.module)), len(FSDP.fsdp_modules(tr.ref_model)), layers


def test_fsdp_wrap_auto_makes_a_small_model_one_unit_and_layer_one_per_decoder_layer(tmp_path):
    (units, ref_units, layers), _ = run_ranks(_fsdp_units, 2, tmp_path, [])
    assert (units, ref_units) == (1, 1)
    (units, ref_units, layers), _ = run_ranks(_fsdp_units, 2, tmp_path, ["distributed.fsdp_wrap=layer"])
    assert (units, ref_units) == (1 + layers, 1 + layers)


@pytest.mark.fast
def test_fsdp_wrap_auto_threshold_counts_parameters_also_on_meta_models():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_dist.engines.fsdp import WHOLE_MODEL_UNIT_BELOW, wrap_units

    def meta_model(layers):  # 16.8M parameters per layer plus 2 x 13.1M embedding and head, no storage
        cfg = Qwen2Config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=8, vocab_size=12800, tie_word_embeddings=False)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    small, big = meta_model(4), meta_model(5)  # 93.3M, 110.1M
    assert sum(p.numel() for p in small.parameters()) < WHOLE_MODEL_UNIT_BELOW < sum(
        p.numel() for p in big.parameters())
    assert (wrap_units(small, "auto"), wrap_units(big, "auto")) == ("model", "layer")
    assert (wrap_units(small, "layer"), wrap_units(big, "model")) == ("layer", "model")


def _save_sharded_per_layer(rank, world, out):
    tr = resume_trainer([f"output_dir={out}", "distributed.fsdp_wrap=layer", "max_steps=1", "save_final=false"])
    assert tr.train() == 0
    tr.checkpointer.with_target(save_format="sharded").save()
    return copy.deepcopy(tr.engine.gather_full_state())


def _resume_as_one_unit(rank, world, ckpt_dir, out):
    tr = resume_trainer([f"output_dir={out}", f"resume_from_checkpoint={ckpt_dir}", "max_steps=2"])
    assert len(FSDP.fsdp_modules(tr.engine.module)) == 1
    state = copy.deepcopy(tr.engine.gather_full_state())
    assert tr.train() == 0 and tr.step == 2
    return state


def test_sharded_checkpoint_of_per_layer_units_resumes_with_one_unit(tmp_path):
    """Runs saved before fsdp_wrap existed (per-layer units) resume under auto's single unit: DCP keys are FQNs."""
    (saved_model, saved_optim), _ = run_ranks(_save_sharded_per_layer, 2, tmp_path, str(tmp_path / "a"))
    (model_sd, optim_sd), _ = run_ranks(_resume_as_one_unit, 2, tmp_path, str(tmp_path / "a" / "checkpoint-1"),
                                        str(tmp_path / "b"))
    assert saved_optim["state"]
    tensors_equal(model_sd, saved_model, "model")
    tensors_equal(optim_sd, saved_optim, "optimizer")
