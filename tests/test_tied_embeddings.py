"""Models that tie lm_head to the input embeddings (SmolLM2, Qwen2.5-0.5B..3B, Llama-3.2): a full-state checkpoint
stores the shared matrix once (as from_pretrained expects), and every engine resumes from it exactly: 2 steps
straight equal 1 step, a fresh trainer resuming from checkpoint-1, and 1 more step, bit for bit in weights and
optimizer state."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import TIED_BASE as BASE
from helpers import checkpoint_state as _state
from helpers import tensors_equal as _tensors_equal

ENGINES = {  # name: (ranks, overrides, engine class)
    "local": (1, ["prompts_per_rank=4"], "LocalEngine"),
    "fsdp_2_ranks": (2, [], "FSDPEngine"),
    "fsdp_1_rank_bf16": (1, ["prompts_per_rank=4", "distributed.mixed_precision=bf16"], "FSDPEngine"),
    "deepspeed_zero2": (2, ["distributed.backend=deepspeed", "distributed.zero_stage=2"], "DeepSpeedEngine"),
}


def _trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _run(rank, world, extra, out):
    """2 steps with a checkpoint after each, then a fresh trainer resumes from checkpoint-1 into another dir."""
    tr = _trainer(extra + [f"output_dir={out}/straight"])
    assert tr.gen_model.lm_head.weight is tr.gen_model.model.embed_tokens.weight  # really tied
    engine = type(tr.engine).__name__
    for _ in range(2):
        tr.train_step()
        tr.save()
    tr = _trainer(extra + [f"output_dir={out}/resumed", f"resume_from_checkpoint={out}/straight/checkpoint-1"])
    assert tr.step == 1
    assert tr.train() == 0
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINES))
def test_tied_embeddings_resume_exactly(name, tmp_path):
    ranks, extra, engine = ENGINES[name]
    if engine == "DeepSpeedEngine":
        pytest.importorskip("deepspeed")
    assert run_ranks(_run, ranks, tmp_path, extra, str(tmp_path))[0] == engine
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "straight" / "checkpoint-2" / "model.safetensors"))
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # stored once
    want = _state(tmp_path / "straight" / "checkpoint-2")
    got = _state(tmp_path / "resumed" / "checkpoint-2")
    _tensors_equal(got[:2], want[:2], name)
    if engine == "DeepSpeedEngine":  # its optimizer state lives in DeepSpeed's own files: compare those too
        for f in sorted((tmp_path / "straight" / "checkpoint-2" / "deepspeed").rglob("*optim_states.pt")):
            g = tmp_path / "resumed" / f.relative_to(tmp_path / "straight")
            a, b = torch.load(f, weights_only=False), torch.load(g, weights_only=False)
            _tensors_equal(a["optimizer_state_dict"]["base_optimizer_state"],
                           b["optimizer_state_dict"]["base_optimizer_state"], f.name)
