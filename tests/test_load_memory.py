"""Memory while loading at scale, on a CPU:
* FSDP shards from the host: rank 0 never moves the whole fp32 policy to its device before sharding (a 7B policy
  would need 45.7 GB there at once); FSDP moves each unit as it wraps and shards it.
* DeepSpeed reads pretrained weights on rank 0 only: the other ranks build on the meta device and get rank 0's
  values by broadcast before deepspeed.initialize, and end with the same weights as the files.
A CPU has one device, so "moved to the device" is what the tests record: every Module.to / .cuda call that takes a
module's fp32 parameters to the rank's device, and every from_pretrained call per rank."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import need_deepspeed

TINY = ("model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}")
BASE = ["num_generations=4", "prompts_per_rank=2", "max_completion_length=6", "reward_workers=0", "beta=0.04",
        "progress_bar=false", "report_to=[]", "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]"]


def _record_moves(monkeypatch, device):
    """(module class, fp32 parameter elements) of every Module.to(device) / Module.cuda() call."""
    moves = []
    orig_to, orig_cuda = torch.nn.Module.to, torch.nn.Module.cuda

    def fp32_numel(m):
        return sum(p.numel() for p in m.parameters() if p.dtype == torch.float32)

    def to(self, *args, **kwargs):
        target = torch._C._nn._parse_to(*args, **kwargs)[0]
        if target is not None and torch.device(target).type == device.type:
            moves.append((type(self).__name__, fp32_numel(self)))
        return orig_to(self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        moves.append((type(self).__name__, fp32_numel(self)))
        return orig_cuda(self, *args, **kwargs)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    monkeypatch.setattr(torch.nn.Module, "cuda", cuda)
    return moves


@pytest.mark.parametrize("extra", [["distributed.mixed_precision=bf16"], ["distributed.cpu_offload=false"]],
                         ids=["fsdp_bf16", "local"])
def test_fsdp_rank0_never_moves_the_whole_fp32_policy_to_its_device(monkeypatch, tmp_path, extra):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines import shards_from_host
    from grpo_dist.models import misplaced_tensors
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, [TINY, *BASE, f"output_dir={tmp_path}", *extra])
    ctx = init_distributed(60)
    moves = _record_moves(monkeypatch, ctx.device)
    tr = GRPOTrainer(cfg, ctx)
    monkeypatch.undo()
    n = sum(p.numel() for p in tr.hf_model.parameters())
    whole_fp32 = [m for m in moves if m[1] >= n]
    if shards_from_host(cfg, ctx.world_size):  # FSDP: not one move of the whole fp32 model
        assert type(tr.engine).__name__ == "FSDPEngine"
        assert whole_fp32 == [], moves
        # the replica went to the device in the compute dtype (no fp32 parameter moved with it)
        assert ("Qwen2ForCausalLM", 0) in moves
    else:  # the local engine takes the model on the device: the one move it needs
        assert type(tr.engine).__name__ == "LocalEngine" and len(whole_fp32) >= 1
    for name, model in (("replica", tr.gen_model), ("policy", tr.engine.module), ("reference", tr.ref_model)):
        assert misplaced_tensors(model, ctx.device) == [], name
    m = tr.train_step()
    assert m["loss"] == m["loss"] and m["grad_norm"] > 0  # finite, and the step reached the sharded weights
    tr.rewards.close()


# ----------------------------------------------------------------------------------------------- deepspeed
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved pretrained model whose weights no seeded init reproduces."""
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    d = tmp_path_factory.mktemp("pretrained") / "m"
    mcfg = load_config(None, [TINY]).model
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, tok)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _deepspeed_setup(rank, world_size, model_dir, out_dir, stage):
    from transformers import AutoModelForCausalLM

    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.models import misplaced_tensors
    from grpo_dist.trainer import GRPOTrainer
    reads = []
    orig = AutoModelForCausalLM.from_pretrained

    def counted(*args, **kwargs):
        reads.append(args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return orig(*args, **kwargs)
    AutoModelForCausalLM.from_pretrained = counted
    cfg = load_config(None, [f"model.name_or_path={model_dir}", *BASE, f"output_dir={out_dir}",
                             "distributed.backend=deepspeed", f"distributed.zero_stage={stage}",
                             "distributed.timeout_s=120"])
    tr = GRPOTrainer(cfg, init_distributed(120))
    AutoModelForCausalLM.from_pretrained = orig
    policy = {k: v.detach().float().cpu().clone() for k, v in tr.engine.iter_full_weights()}
    replica = {k: v.detach().float().cpu().clone() for k, v in tr.gen_model.state_dict().items()}
    ref = tr.ref_model.module if hasattr(tr.ref_model, "module") else tr.ref_model
    if stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(ref.parameters())):
            ref_w = {k: v.detach().float().cpu().clone() for k, v in ref.named_parameters()}
    else:
        ref_w = {k: v.detach().float().cpu().clone() for k, v in ref.named_parameters()}
    placed = misplaced_tensors(tr.gen_model, tr.ctx.device)
    m = tr.train_step()
    tr.rewards.close()
    return dict(reads=len(reads), policy=policy, replica=replica, ref=ref_w, misplaced=placed, loss=m["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_reads_pretrained_weights_on_rank0_only(tmp_path, model_dir, stage):
    need_deepspeed()
    from safetensors.torch import load_file
    files = {k: v.float() for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    r0, r1 = run_ranks(_deepspeed_setup, 2, tmp_path, model_dir, str(tmp_path / "out"), stage, timeout=600)
    assert r0["reads"] == 2 and r1["reads"] == 0  # rank 0: policy and reference; rank 1: none
    for r in (r0, r1):
        assert r["misplaced"] == []
        for name, w in files.items():  # rank 1's policy, reference and (after the first sync) replica hold the files
            assert torch.equal(r["policy"][name], w), name
            assert torch.equal(r["ref"][name], w.to(r["ref"][name].dtype)), name
        assert r["loss"] == r["loss"]
    assert r0["loss"] == r1["loss"]  # the loss is all-reduced: the same on both ranks
