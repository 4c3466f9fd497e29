"""GPU-readiness that a CPU can check: the generation replica is made in the compute dtype without an fp32 copy,
the frozen reference is kept in the compute dtype, evaluation generates in it on GPUs, log-prob chunks are sized
for the device, and the NCCL group is bound to the rank's GPU."""

import pytest
import torch

from dist_utils import run_ranks
from grpo_dist.config import ModelConfig, load_config
from grpo_dist.models import build_tiny_model, build_tiny_tokenizer, copy_in_dtype

TINY = dict(architecture="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)


def _no_parameter_deepcopy(monkeypatch):
    def refuse(self, memo):
        raise AssertionError("a parameter was deep-copied at its source dtype")
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", refuse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_copy_in_dtype_casts_while_copying(monkeypatch, dtype):
    mcfg = ModelConfig(tiny=TINY)
    model = build_tiny_model(mcfg, build_tiny_tokenizer(mcfg))
    _no_parameter_deepcopy(monkeypatch)
    rep = copy_in_dtype(model, dtype)
    want = dtype or torch.float32
    for (name, p), (_, q) in zip(model.named_parameters(), rep.named_parameters()):
        assert q.dtype == want and p.dtype == torch.float32, name
        assert torch.equal(q, p.detach().to(want)) and q.data_ptr() != p.data_ptr(), name
    assert rep.lm_head.weight is rep.model.embed_tokens.weight   # still tied
    for (name, b), (_, c) in zip(model.named_buffers(), rep.named_buffers()):
        assert c.dtype == b.dtype and torch.equal(b, c) and c.data_ptr() != b.data_ptr(), name  # inv_freq stays fp32


def _mixed_precision_trainer(rank, world, out):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, [f"output_dir={out}", "model.tiny={architecture: qwen2, hidden_size: 32, "
                             "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
                             "intermediate_size: 64, tie_word_embeddings: true}",
                             "distributed.mixed_precision=bf16", "beta=0.04", "prompts_per_rank=2",
                             "num_generations=4", "max_completion_length=6", "reward_workers=0",
                             "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "progress_bar=false",
                             "log_completions=0"])
    refused = []

    def refuse(self, memo):
        refused.append(tuple(self.shape))
        raise AssertionError("a parameter was deep-copied at its source dtype")
    torch.nn.Parameter.__deepcopy__ = refuse  # a spawned process: nothing to restore
    tr = GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))
    dtypes = lambda m, what: sorted({str(t.dtype) for t in getattr(m, what)()})  # noqa: E731
    out = dict(gen_params=dtypes(tr.gen_model, "parameters"), gen_buffers=dtypes(tr.gen_model, "buffers"),
               ref_params=dtypes(tr.ref_model, "parameters"), ref_buffers=dtypes(tr.ref_model, "buffers"),
               policy_params=dtypes(tr.engine.module, "parameters"))
    out["kl"] = tr.train_step()["kl"]
    return out


def test_replica_and_reference_in_the_compute_dtype(tmp_path):
    got = run_ranks(_mixed_precision_trainer, 1, tmp_path, str(tmp_path / "run"))[0]
    assert got["gen_params"] == ["torch.bfloat16"] and got["ref_params"] == ["torch.bfloat16"]
    assert got["gen_buffers"] == ["torch.float32"] and got["ref_buffers"] == ["torch.float32"]
    assert got["policy_params"] == ["torch.float32"]   # the trained master weights stay fp32
    assert got["kl"] == 0.0   # the bf16 reference computes exactly what MixedPrecision's cast of the policy does


def test_evaluation_generates_in_the_compute_dtype_on_gpus():
    from grpo_dist.tools.evaluate import generation_dtype
    bf16 = load_config(None, ["distributed.mixed_precision=bf16"])
    assert generation_dtype(bf16, torch.device("cuda", 0)) == torch.bfloat16
    assert generation_dtype(bf16, torch.device("cpu")) is None
    assert generation_dtype(load_config(None, []), torch.device("cuda", 0)) is None


def test_logprob_chunk_rows_fit_the_device():
    from grpo_dist.logprobs import _rows_per_chunk
    vocab = 151_936
    assert _rows_per_chunk(None, vocab, torch.device("cpu")) == (1 << 22) // vocab == 27   # as before on a CPU
    assert _rows_per_chunk(None, vocab, torch.device("cuda", 0)) == (1 << 27) // vocab == 883
    assert _rows_per_chunk(4, vocab, torch.device("cuda", 0)) == 4
    assert _rows_per_chunk(10_000, vocab, torch.device("cpu")) == 27
    assert load_config(None, []).logprob_chunk_size is None


def test_nccl_group_is_created_with_the_rank_device(monkeypatch):
    import torch.distributed as dist
    from grpo_dist import distributed as gdist
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)   # a node of 2 GPUs; a CPU build reports 0
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    for k, v in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    ctx = gdist.init_distributed(60)
    assert ctx.device == torch.device("cuda", 1) and ctx.backend == "nccl"
    assert calls[0][0] == "nccl" and calls[0][1]["device_id"] == torch.device("cuda", 1)


def test_7b_multinode_config_keeps_collectives_on_the_node():
    cfg = load_config("configs/qwen2.5_7b_multinode.yaml", [])
    assert cfg.distributed.sharding_strategy == "HYBRID_SHARD" and cfg.distributed.mixed_precision == "bf16"
    assert cfg.micro_batch_size == 8
    assert cfg.generation_batch_size == cfg.prompts_per_rank * cfg.num_generations   # one generation pass per step
