"""model.dtype=float64 (CPU): what the golden trajectories (tests/golden.py) rest on.

- the config refuses the combinations no test runs in float64, one line naming the key; a GPU is refused at start;
- log-probs of float64 logits stay float64 (rounded to float32 they would carry the kernels' last-bit differences);
- FSDP's clip_grad_norm_ refuses float64 gradients, so the engine clips them itself: one step on 2 ranks (FULL_SHARD:
  each rank holds half of every gradient, the squares are summed over ranks; NO_SHARD: each holds them whole) equals
  the same step in 1 process, and its grad_norm and update equal the float32 step's up to float32 rounding.
"""

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import G, PROMPTS, fixed_rollout


@pytest.mark.fast
@pytest.mark.parametrize("override, key", [("distributed.mixed_precision=bf16", "distributed.mixed_precision"),
                                           ("distributed.backend=deepspeed", "model.dtype"),
                                           ("distributed.sharding_strategy=HYBRID_SHARD",
                                            "distributed.sharding_strategy")])
def test_float64_refuses_what_it_does_not_support(override, key):
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dtype=float64", override])
    assert f"config key '{key}'" in str(e.value) and "float64" in str(e.value)
    assert load_config(None, ["model.dtype=float64"]).model.dtype == "float64"


@pytest.mark.fast
def test_float64_is_refused_on_a_gpu():
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.preflight import check_dtype_device
    check_dtype_device(load_config(None, ["model.dtype=float64"]), torch.device("cpu"))
    check_dtype_device(load_config(None, []), torch.device("cuda"))  # float32 on a GPU: fine
    with pytest.raises(ConfigError, match="config key 'model.dtype' = float64 runs on the CPU only"):
        check_dtype_device(load_config(None, ["model.dtype=float64"]), torch.device("cuda"))


@pytest.mark.fast
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_of_float64_logits_are_float64(temperature):
    from grpo_dist.logprobs import selective_log_probs, selective_log_probs_and_entropy, token_entropy
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    labels = torch.randint(0, 50, (3, 5), generator=g)
    # log p[label] = z[label] - logsumexp(z), z = logits / T; entropy = -sum p log p, all in float64
    z = logits.detach() / temperature
    ref_lp = z.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
    ref_p = torch.softmax(z, -1)
    ref_h = -(ref_p * torch.log(ref_p)).sum(-1)
    lp = selective_log_probs(logits, labels, chunk_size=4, temperature=temperature)
    lp2, h = selective_log_probs_and_entropy(logits, labels, chunk_size=4, temperature=temperature)
    for got, ref in ((lp, ref_lp), (lp2, ref_lp), (h, ref_h), (token_entropy(z, chunk_size=4), ref_h)):
        assert got.dtype == torch.float64
        assert (got.detach() - ref).abs().max() < 1e-13  # float32 would be off by ~1e-7
    # the hand-written backward: d log p[label] / d logits = (onehot - p) / T
    lp.sum().backward()
    want = (torch.nn.functional.one_hot(labels, 50).double() - ref_p) / temperature
    assert logits.grad.dtype == torch.float64 and (logits.grad - want).abs().max() < 1e-13


def _one_step(rank, world_size, overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    out = {}
    for name, extra in overrides.items():
        # max_grad_norm far below the norm: the clip coefficient shapes the whole update
        cfg = load_config(None, BASE + ["max_grad_norm=0.05"] + extra + [f"prompts_per_rank={per_rank}",
                                                "output_dir=/tmp/unused"])
        trainer = GRPOTrainer(cfg, ctx)
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        after, _ = trainer.engine.gather_full_state()
        if rank == 0:
            before = _initial_weights(extra)
            out[name] = ({k: after[k] - before[k] for k in after}, metrics["grad_norm"], metrics["loss"])
    return out


def _initial_weights(extra):
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE + extra)
    return load_model(cfg.model, load_tokenizer(cfg.model)).state_dict()


def _saved_init(path):
    """The tiny model's float32 init as an HF directory: float32 and float64 runs then start from the same values
    (a float64 init draws other random numbers)."""
    from grpo_dist.config import load_config
    from grpo_dist.models import load_model, load_tokenizer
    cfg = load_config(None, BASE)
    tok = load_tokenizer(cfg.model)
    load_model(cfg.model, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return f"model.name_or_path={path}"


@pytest.mark.slow
def test_float64_step_on_2_ranks_equals_1_process_and_the_float32_step(tmp_path):
    init = _saved_init(tmp_path / "init")
    f64 = [init, "model.dtype=float64"]
    one = run_ranks(_one_step, 1, tmp_path, {"f64": f64, "f32": [init]})[0]
    two = run_ranks(_one_step, 2, tmp_path, {"f64": f64, "f64_no_shard": f64 + ["distributed.sharding_strategy="
                                                                               "NO_SHARD"]})[0]
    delta, norm, loss = one["f64"]
    assert next(iter(delta.values())).dtype == torch.float64
    assert norm > 0.5, "the clip must be active (max_grad_norm=0.05)"
    for name in ("f64", "f64_no_shard"):
        d2, n2, l2 = two[name]
        assert abs(n2 - norm) <= 1e-12 * norm and abs(l2 - loss) <= 1e-12, name
        assert max((d2[k] - delta[k]).abs().max().item() for k in delta) < 1e-12, name
    d32, n32, _ = one["f32"]
    assert abs(n32 - norm) <= 1e-5 * norm  # the same norm as FSDP's float32 clip_grad_norm_, to float32 rounding
    step = max(v.abs().max().item() for v in delta.values())
    assert max((d32[k].double() - delta[k]).abs().max().item() for k in delta) < 1e-3 * step
