"""rollout_engine=vllm without vLLM: rollout_engines.VLLMRolloutEngine on a fake vLLM (tests/fake_vllm.py) that
keeps what a real engine's memory holds. Sleep mode never samples released weights (dynamic sampling rounds 2+,
evaluation batches after the first, the pass@k pass), empty_cache before each wake-up, the load_weights fallback of
an old vLLM, the sizes passed to vLLM (grpo_dist/vllm_plan.py, its formulas written out here), a bitwise resume
although vLLM reseeds the process RNGs when it is built, and evaluation with tensor_parallel_size > 1 on uneven
shards (2 and 4 gloo ranks) against one process. The real vLLM runs in tests/test_vllm.py."""

import math
import sys

import pytest
import torch

import fake_vllm
from dist_utils import run_ranks

BASE = ["rollout_engine=vllm", "reward_workers=0", "progress_bar=false", "report_to=[]", "prompts_per_rank=2",
        "num_generations=3", "max_completion_length=6", "data.limit=8", "data.max_prompt_length=64",
        "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "distributed.timeout_s=30"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fake_vllm.save_tiny_model(tmp_path_factory.mktemp("tiny_vllm") / "model")


@pytest.fixture
def fake(monkeypatch):
    """The fake vLLM in sys.modules, the GPU-only paths (sleep mode, the GPU plan) taken, empty_cache recorded in
    the engine's event list."""
    import grpo_dist.rollout_engines as re
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.inputs")}
    fake_vllm.install()
    fake_vllm.LLM.built.clear()
    monkeypatch.setattr(re, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 80 * 2**30})())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake_vllm.LLM.built[-1].events.append(("empty_cache",)))
    yield fake_vllm.LLM
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def _cfg(model_dir, extra=()):
    from grpo_dist.config import load_config
    return load_config(None, BASE + [f"model.name_or_path={model_dir}", "output_dir=/tmp/unused_vllm_fake"]
                       + list(extra))


def _engine(cfg, synced=True):
    from grpo_dist.distributed import DistContext
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rollout_engines import build_rollout_engine
    return build_rollout_engine(cfg, DistContext(0, 1, 0, torch.device("cpu"), "gloo"), None,
                                load_tokenizer(cfg.model), rows=cfg.prompts_per_rank * cfg.num_generations,
                                synced=synced)


def _weights(model_dir):
    from safetensors.torch import load_file
    return iter(load_file(f"{model_dir}/model.safetensors").items())


def _spec(greedy=False):
    from grpo_dist.rollout_engines import SamplingSpec
    return SamplingSpec(n=3, max_tokens=6, eos_ids=(1,), greedy=greedy)


def test_sleep_mode_releases_before_the_update_and_never_generates_from_released_weights(fake, model_dir):
    engine = _engine(_cfg(model_dir, ["vllm.enable_sleep_mode=true"]))
    llm = fake.built[-1]
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["enable_sleep_mode"] is True
    with pytest.raises(RuntimeError, match="sync the weights before generating"):
        engine.generate([[5, 6]], _spec())  # dummy weights: the first sync has not come
    engine.sync_weights(_weights(model_dir))
    for _ in range(3):  # dynamic sampling: more rounds on the same weights, no sync between them
        engine.generate([[5, 6], [7]], _spec())
    assert [e for e in llm.events if e[0] == "generate"] == [("generate", "synced", True)] * 3
    assert not any(e[0] == "sleep" for e in llm.events), "generate must not sleep"
    engine.release()
    assert llm.events[-1] == ("sleep", 2) and llm.weights == "released"
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([[5, 6]], _spec())
    mark = len(llm.events)
    engine.sync_weights(_weights(model_dir))
    assert llm.events[mark:] == [("empty_cache",), ("wake_up", ("weights",)), ("reload_weights", len(llm.synced)),
                                 ("reset_prefix_cache",), ("empty_cache",), ("wake_up", ("kv_cache",))]
    engine.generate([[5]], _spec())
    assert llm.events[-1] == ("generate", "synced", True)
    engine.release()
    engine.release()  # already asleep: one sleep
    assert sum(e == ("sleep", 2) for e in llm.events) == 2


def test_an_old_vllm_reload_falls_back_to_load_weights_with_one_line(fake, model_dir, monkeypatch, capsys):
    monkeypatch.setattr(fake, "reload_takes_iterator", False)
    engine = _engine(_cfg(model_dir))
    llm = fake.built[-1]
    for _ in range(2):
        engine.sync_weights(_weights(model_dir))
    expected = _weights(model_dir)
    assert [e for e in llm.events if e[0] == "load_weights"] == [("load_weights", len(llm.synced))] * 2
    for name, t in expected:
        assert torch.equal(llm.synced[name], t), name
    lines = [x for x in capsys.readouterr().out.splitlines() if "reload_weights takes no weights_iterator" in x]
    assert len(lines) == 1 and "0.0.fake" in lines[0] and "0.32" in lines[0], lines
    engine.generate([[5]], _spec())
    assert llm.events[-1] == ("generate", "synced", True)


def test_dynamic_sampling_rounds_after_the_first_sample_synced_weights(fake, model_dir):
    """The trainer with sleep mode and dynamic sampling (every group flat: dynamic_sampling_max_rounds rounds per
    step): one sync per step, then the rounds, then the release before the update."""
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = _cfg(model_dir, ["vllm.enable_sleep_mode=true", "dynamic_sampling=true", "dynamic_sampling_max_rounds=3",
                           "rewards=[{function: 'reward_fns:always_one', weight: 1.0}]", "max_steps=2", "beta=0"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    try:
        metrics = [tr.train_step() for _ in range(2)]
    finally:
        tr.close()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [m["dynamic_sampling_rounds"] for m in metrics] == [3, 3]
    kinds = [e[0] if e[0] != "generate" else e for e in fake.built[-1].events if e[0] != "empty_cache"]
    step = ["reload_weights", "reset_prefix_cache"] + [("generate", "synced", True)] * 3 + ["sleep"]
    assert kinds == step + ["wake_up"] + step[:2] + ["wake_up"] + step[2:], kinds


def _evaluation(engine_or_cfg, cfg, examples, ctx, num_samples, batch_size):
    from grpo_dist.evaluation import evaluate
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rewards import RewardComputer
    rewards = RewardComputer(cfg.rewards, num_workers=0)
    try:
        out = evaluate(engine_or_cfg, load_tokenizer(cfg.model), examples, cfg, ctx, rewards, num_samples,
                       batch_size)
    finally:
        rewards.close()
    out.pop("eval_time_s")
    return out


def test_evaluation_batches_after_the_first_and_the_pass_at_k_pass_sample_loaded_weights(fake, model_dir):
    """Evaluation through vLLM with sleep mode: weights from the directory, several greedy batches, then the
    sampled pass@k batches; every one generates from the loaded weights, and the greedy accuracy does not depend
    on the batch size."""
    from grpo_dist.data import load_examples
    from grpo_dist.distributed import DistContext
    cfg = _cfg(model_dir, ["vllm.enable_sleep_mode=true"])
    examples = load_examples(cfg.data, "eval")[:5]
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    results = {}
    for batch_size in (2, 64):
        engine = _engine(cfg, synced=False)
        llm = fake.built[-1]
        assert "load_format" not in llm.kwargs  # evaluation reads the weights from the directory
        results[batch_size] = _evaluation(engine, cfg, examples, ctx, 2, batch_size)
        generates = [e for e in llm.events if e[0] == "generate"]
        # greedy: ceil(5 / b) batches; pass@k: batches of b // 2 problems
        assert len(generates) == math.ceil(5 / batch_size) + math.ceil(5 / max(1, batch_size // 2))
        assert generates == [("generate", "loaded", True)] * len(generates), llm.events
        engine.close()
    assert results[2]["accuracy"] == results[64]["accuracy"] and results[2]["num_examples"] == 5
    assert set(results[2]) >= {"pass@1", "pass@2"}


def test_memory_plan_formulas():
    from grpo_dist.vllm_plan import GiB, ModelShape, cpu_kv_cache_gib, model_shape, plan
    # Qwen2.5-0.5B's config.json: 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, vocab 151936, tied
    conf = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
    shape = model_shape(conf)
    attention = 896 * (14 + 2 * 2) * 64 + 14 * 64 * 896
    assert shape.num_params == 151936 * 896 + 24 * (attention + 3 * 896 * 4864)
    assert 0.45e9 < shape.num_params < 0.5e9  # the model card's 0.49B (without biases and norms)
    shape = ModelShape(494_000_000, 24, 2, 64, 4864, 151936)
    # 8 prompts x 8 generations on one rank, 256 + 512 tokens, bf16, an 80 GiB card
    p = plan(shape, 2, 64, 768, 1, 80 * GiB)
    kv_per_token = 2 * 24 * 2 * 64 * 2
    assert p.max_num_seqs == 64 and p.max_num_batched_tokens == 4096
    assert p.kv_cache_bytes == 64 * 768 * kv_per_token  # 768 is 48 whole blocks of 16
    activations = 4096 * 2 * 4864 * 2 + 64 * 151936 * 4 * 2
    want = (494_000_000 * 2 + p.kv_cache_bytes + activations + 2 * GiB) / (80 * GiB)
    assert p.gpu_memory_utilization == pytest.approx(want) and p.gpu_memory_utilization < 0.05  # not 0.3
    assert p.needed_utilization is None
    # tensor parallelism: KV heads and weights split over the group; a length that is not whole blocks rounds up
    p2 = plan(shape, 2, 64, 770, 2, 80 * GiB)
    assert p2.kv_cache_bytes == 64 * 784 * (2 * 24 * 1 * 64 * 2)
    assert plan(shape, 2, 64, 770, 4, 80 * GiB).kv_cache_bytes == p2.kv_cache_bytes  # 2 KV heads: replicated
    # more rows than TRL's token budget: the budget grows to one token per sequence
    assert plan(shape, 2, 5000, 768, 1, 80 * GiB).max_num_batched_tokens == 5000
    # user values win
    p3 = plan(shape, 2, 64, 768, 1, 80 * GiB, gpu_memory_utilization=0.5, max_num_seqs=16)
    assert (p3.gpu_memory_utilization, p3.kv_cache_bytes, p3.max_num_seqs) == (0.5, None, 16)
    p4 = plan(shape, 2, 64, 768, 1, 80 * GiB, kv_cache_gb=3, max_num_batched_tokens=2048)
    assert p4.kv_cache_bytes == 3 * GiB and p4.max_num_batched_tokens == 2048 and p4.max_num_seqs == 64
    assert p4.gpu_memory_utilization == pytest.approx(
        (494_000_000 * 2 + 3 * GiB + 2048 * 2 * 4864 * 2 + 64 * 151936 * 4 * 2 + 2 * GiB) / (80 * GiB))
    assert plan(shape, 2, 64, 768, 1, 80 * GiB, max_num_batched_tokens=32).max_num_seqs == 32
    # a card too small: capped, and the wanted share reported
    big = plan(ModelShape(7_600_000_000, 28, 4, 128, 18944, 152064), 2, 64, 1536, 1, 16 * GiB)
    assert big.gpu_memory_utilization == 0.95 and big.needed_utilization > 1
    # CPU: no share, the KV cache in whole GiB (1 at least)
    cpu = plan(shape, 4, 8, 48, 1, None)
    assert cpu.gpu_memory_utilization is None and cpu_kv_cache_gib(cpu) == 1
    assert cpu_kv_cache_gib(plan(shape, 4, 8, 48, 1, None, kv_cache_gb=2.5)) == 3


def test_the_plan_reaches_vllm_and_config_refuses_bad_values(fake, model_dir):
    from grpo_dist.config import ConfigError
    from grpo_dist.vllm_plan import kv_bytes_per_token, read_model_shape
    _engine(_cfg(model_dir))
    kw = fake.built[-1].kwargs
    shape = read_model_shape(model_dir)
    rows = 2 * 3  # prompts_per_rank x num_generations
    assert kw["max_num_seqs"] == rows and kw["max_num_batched_tokens"] == 4096
    max_len = 64 + 6  # data.max_prompt_length + max_completion_length
    assert kw["max_model_len"] == max_len
    assert kw["kv_cache_memory_bytes"] == rows * math.ceil(max_len / 16) * 16 * kv_bytes_per_token(shape, 4, 1)
    assert 0 < kw["gpu_memory_utilization"] < 0.05
    _engine(_cfg(model_dir, ["vllm.gpu_memory_utilization=0.4", "vllm.max_num_seqs=4",
                             "vllm.max_num_batched_tokens=64"]))
    kw = fake.built[-1].kwargs
    assert (kw["gpu_memory_utilization"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (0.4, 4, 64)
    assert "kv_cache_memory_bytes" not in kw  # vLLM profiles the KV cache inside the share the user gave
    for bad, key in [("vllm.max_num_seqs=0", "vllm.max_num_seqs"),
                     ("vllm.max_num_batched_tokens=-1", "vllm.max_num_batched_tokens"),
                     ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization")]:
        with pytest.raises(ConfigError, match=key):
            _cfg(model_dir, [bad])
    with pytest.raises(ConfigError, match="'vllm.max_num_batched_tokens' = 8 is below vllm.max_num_seqs = 16"):
        _cfg(model_dir, ["vllm.max_num_seqs=16", "vllm.max_num_batched_tokens=8"])


# ------------------------------------------------------------------------------------------- multi-process

def _resume_run(rank, world, model_dir, out, max_steps, resume):
    fake_vllm.install()
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    extra = [f"model.name_or_path={model_dir}", f"output_dir={out}", f"max_steps={max_steps}", "save_steps=1",
             "save_format=full", "temperature=1.0", "learning_rate=1e-3", "beta=0.04"]
    extra += [f"resume_from_checkpoint={resume}"] if resume else []
    tr = GRPOTrainer(load_config(None, BASE + extra), init_distributed(60))
    start = tr.step
    assert tr.train() == 0
    return start, fake_vllm.LLM.built[-1].sampled


@pytest.mark.slow
def test_resume_with_vllm_is_bitwise_although_vllm_reseeds_the_rng(tmp_path, model_dir):
    """3 steps in one go vs 2 steps + a resume for the third: the third step samples the same tokens and ends in
    the same weights, optimizer state and trainer state (the fake engine reseeds the process RNGs when built, as
    vLLM does: a resume that kept that seed would sample the first step's tokens again)."""
    from helpers import checkpoint_state, tensors_equal
    full = tmp_path / "full"
    start, sampled = run_ranks(_resume_run, 1, tmp_path, model_dir, str(full), 3, None)[0]
    assert start == 0 and len(sampled) == 3
    resumed = tmp_path / "resumed"
    start, sampled_resumed = run_ranks(_resume_run, 1, tmp_path, model_dir, str(resumed), 3,
                                       str(full / "checkpoint-2"))[0]
    assert start == 2 and len(sampled_resumed) == 1
    assert sampled[2] != sampled[0]  # the steps draw different tokens: the comparison below means something
    assert sampled_resumed[0] == sampled[2]
    tensors_equal(checkpoint_state(resumed / "checkpoint-3"), checkpoint_state(full / "checkpoint-3"), "ckpt-3")


def _tp_evaluation(rank, world, model_dir, tp, n_examples, batch_size):
    fake_vllm.install()
    from grpo_dist.data import load_examples
    from grpo_dist.distributed import init_distributed
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rollout_engines import build_rollout_engine
    ctx = init_distributed(30)
    cfg = _cfg(model_dir, [f"vllm.tensor_parallel_size={tp}"])
    engine = build_rollout_engine(cfg, ctx, None, load_tokenizer(cfg.model), rows=batch_size)
    examples = load_examples(cfg.data, "eval")[:n_examples]
    try:
        out = _evaluation(engine, cfg, examples, ctx, 2, batch_size)
        out["trainer_accuracy"] = _trainer_accuracy(engine, cfg, examples, ctx, batch_size)
        return out
    finally:
        engine.close()


def _trainer_accuracy(engine, cfg, examples, ctx, batch_size):
    """evaluation.evaluate_accuracy, what the trainer's eval_steps run."""
    from grpo_dist.evaluation import evaluate_accuracy
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rewards import RewardComputer
    rewards = RewardComputer(cfg.rewards, num_workers=0)
    try:
        return evaluate_accuracy(engine, load_tokenizer(cfg.model), examples, cfg, ctx, rewards, batch_size)
    finally:
        rewards.close()


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)])
def test_tensor_parallel_evaluation_on_uneven_shards_agrees_and_matches_one_process(tmp_path, model_dir, fake, world,
                                                                                    tp):
    """3 problems, one per greedy call: on 2 ranks one TP group whose ranks make 2 and 1 calls; on 4 ranks a group
    with a rank that has no problem at all. Every rank finishes, with the greedy accuracy of one process."""
    n_examples, batch_size = 3, 1
    results = run_ranks(_tp_evaluation, world, tmp_path, model_dir, tp, n_examples, batch_size, timeout=240)
    from grpo_dist.data import load_examples
    from grpo_dist.distributed import DistContext
    cfg = _cfg(model_dir)
    examples, ctx = load_examples(cfg.data, "eval")[:n_examples], DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    engine = _engine(cfg, synced=False)
    one = _evaluation(engine, cfg, examples, ctx, 2, batch_size)
    assert 0 < one["accuracy"] < 1  # the fake's greedy lengths give both outcomes on these 3 problems
    assert _trainer_accuracy(engine, cfg, examples, ctx, batch_size) == one["accuracy"]
    for r in results:
        assert r["num_examples"] == n_examples and r["trainer_accuracy"] == one["accuracy"]
        assert r["accuracy"] == one["accuracy"] and r["truncated_fraction"] == one["truncated_fraction"]
        assert r == results[0]
