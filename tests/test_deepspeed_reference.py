"""DeepSpeed ZeRO-2 with bf16: the replicated reference model casts its parameters only, its buffers (RoPE's
inv_freq) stay fp32 as the policy's do under DeepSpeed, so at step 0, where policy and reference hold the same
weights, every token's KL is exactly 0."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import TIED_BASE as BASE


def _first_step(rank, world, out):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + [f"output_dir={out}", "distributed.backend=deepspeed", "distributed.zero_stage=2",
                                    "distributed.mixed_precision=bf16", "prompts_per_rank=4", "max_steps=1"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    dtypes = lambda named: {n: t.dtype for n, t in named}  # noqa: E731
    policy = tr.engine.module.module
    out = {"ref_params": set(dtypes(tr.ref_model.named_parameters()).values()),
           "ref_buffers": dtypes(tr.ref_model.named_buffers()), "policy_buffers": dtypes(policy.named_buffers()),
           "kl": tr.train_step()["kl"]}
    return out


def test_zero2_bf16_reference_keeps_fp32_buffers_and_step0_kl_is_zero(tmp_path):
    pytest.importorskip("deepspeed")
    res = run_ranks(_first_step, 1, tmp_path, str(tmp_path / "out"))[0]
    assert res["ref_params"] == {torch.bfloat16}
    assert res["ref_buffers"] == res["policy_buffers"] and res["ref_buffers"]
    assert set(res["ref_buffers"].values()) == {torch.float32}
    assert res["kl"] == 0.0
