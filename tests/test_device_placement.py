"""Every parameter and buffer of the policy, the reference and the generation replica is on the rank's device after
setup, also on ranks that build the model on the meta device while rank 0 reads the weights (FSDP and FSDP2), with
rank 0's values in every shard (a buffer left on the
CPU of a GPU rank makes the first rollout index a CPU RoPE table with CUDA positions).

A CPU has one device, so a buffer forgotten there would look placed. The tests below make forgetting visible:
materialize_meta is aimed at another device (meta) in a unit test, and the setup runs with the meta ranks'
buffers built on the meta device too, so any buffer that setup does not materialise stays meta and the audit names
it; its values must then also come from rank 0."""

import functools

import pytest
import torch

from dist_utils import run_ranks
from grpo_dist.config import ModelConfig
from grpo_dist.models import load_model, load_tokenizer, materialize_meta, misplaced_tensors

TINY = ModelConfig(tiny=dict(architecture="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pretrained") / "m"
    tok = load_tokenizer(TINY)
    model = load_model(TINY, tok)
    with torch.no_grad():  # weights no seeded init reproduces
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _meta_model(model_dir):
    cfg = ModelConfig(name_or_path=model_dir)
    return load_model(cfg, load_tokenizer(cfg), on_meta=True)


def test_audit_names_every_tensor_off_the_device(model_dir):
    model = _meta_model(model_dir)
    found = misplaced_tensors(model, torch.device("cpu"))
    n_params = len(list(model.named_parameters(remove_duplicate=False)))
    assert len(found) == n_params and all(f.startswith("parameter ") and f.endswith(" on meta") for f in found)
    assert "buffer model.rotary_emb.inv_freq on cpu" in misplaced_tensors(model, torch.device("meta"))


def test_materialize_meta_puts_parameters_and_buffers_on_the_target_device(model_dir):
    # the buffers of a meta-built model are real CPU tensors: aimed at another device, they must move there too
    model = materialize_meta(_meta_model(model_dir), torch.device("meta"))
    assert misplaced_tensors(model, torch.device("meta")) == []
    # buffers built on meta as well get storage; tied weights stay one parameter; real buffers keep their values
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    with init_empty_weights(include_buffers=True):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    meta.tie_weights()
    materialize_meta(meta, torch.device("cpu"))
    assert misplaced_tensors(meta, torch.device("cpu")) == []
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    real = materialize_meta(_meta_model(model_dir), torch.device("cpu"))
    assert torch.equal(real.model.rotary_emb.inv_freq, _meta_model(model_dir).model.rotary_emb.inv_freq)


def _setup(rank, world, model_dir, meta_buffers, backend):
    if meta_buffers:  # the meta ranks build their buffers on meta too: a forgotten one cannot pass as placed
        import accelerate
        accelerate.init_empty_weights = functools.partial(accelerate.init_empty_weights, include_buffers=True)
    from grpo_dist.config import load_config
    from grpo_dist.decoder import LeanDecoder
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines import clean_name
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    cfg = load_config(None, [f"model.name_or_path={model_dir}", "beta=0.04", "reward_workers=0", "report_to=[]",
                             "progress_bar=false", "output_dir=/tmp/unused_device_placement", "num_generations=2",
                             "prompts_per_rank=1", "max_completion_length=4", "micro_batch_size=2",
                             "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]",
                             f"distributed.backend={backend}"])
    tr = GRPOTrainer(cfg, ctx)
    assert type(tr.engine).__name__ == {"fsdp": "FSDPEngine", "fsdp2": "FSDP2Engine"}[backend]
    # the weights every rank streams to its rollout engine: all-gathered from every rank's shards
    weights = {n: t.clone() for n, t in tr.engine.iter_full_weights()}
    models = {"policy": tr.engine.module, "reference": tr.ref_model, "replica": tr.gen_model}
    out = {"misplaced": {k: misplaced_tensors(m, ctx.device) for k, m in models.items()},
           "buffers": {k: {clean_name(n): b.clone() for n, b in m.named_buffers()} for k, m in models.items()},
           "weights": weights}
    decoder = LeanDecoder(tr.gen_model)
    ids = torch.tensor([[5, 6, 7]], device=ctx.device)
    decoder.prefill(ids, torch.ones_like(ids), None, 4)
    out["rope_tables"] = [(t.device.type, t.clone()) for t in (decoder.rope,)]
    out["loss"] = tr.train_step()["loss"]  # a whole step runs
    return out


@pytest.mark.parametrize("backend,meta_buffers", [("fsdp", False), ("fsdp", True), ("fsdp2", True)],
                         ids=["real_buffers", "meta_buffers", "fsdp2_meta_buffers"])
def test_every_tensor_on_the_rank_device_with_rank0_values_on_meta_built_ranks(model_dir, tmp_path, meta_buffers,
                                                                              backend):
    ranks = run_ranks(_setup, 2, tmp_path, model_dir, meta_buffers, backend)
    from safetensors.torch import load_file
    pretrained = load_file(f"{model_dir}/model.safetensors")  # the tied head stored once
    for r, res in enumerate(ranks):
        assert res["weights"].keys() == pretrained.keys(), r
        for name, want in pretrained.items():  # the shards built on meta hold rank 0's values
            assert torch.equal(res["weights"][name], want), (r, name)
        assert res["misplaced"] == {"policy": [], "reference": [], "replica": []}, r
        for part, buffers in ranks[0]["buffers"].items():
            assert buffers.keys() == res["buffers"][part].keys() and buffers, (r, part)
            for name, want in buffers.items():
                assert torch.equal(res["buffers"][part][name], want), (r, part, name)
        for (dev, got), (_, want) in zip(res["rope_tables"], ranks[0]["rope_tables"]):
            assert dev == "cpu" and torch.equal(got, want), r
        assert res["loss"] == ranks[0]["loss"]
