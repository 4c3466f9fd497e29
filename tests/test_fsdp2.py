"""distributed.backend=fsdp2 (FSDP2Engine, fully_shard): one optimizer step on 2 ranks equals 1 process (the local
engine) and FSDP1 on 2 ranks, on the same fixed rollouts: full precision with one unit and with a unit per layer
plus activation checkpointing and num_iterations=2, bf16 mixed precision (against FSDP1's bf16), LoRA (fp32 and
bf16); a tied model resumes bit for bit fsdp2 -> fsdp2 from full and from sharded (DCP) checkpoints, and across
backends fsdp -> fsdp2 and fsdp2 -> fsdp; a bad sharding strategy is refused at start."""

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE, G, PROMPTS, TIED_BASE, fixed_rollout, set_lora_b, tensors_equal
from helpers import checkpoint_state as _state

LORA = ["lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj, v_proj, down_proj]"]
FSDP2 = ["distributed.backend=fsdp2"]
BF16 = ["distributed.mixed_precision=bf16"]
TWO_ITER = ["scale_rewards=batch", "num_iterations=2", "epsilon=0.1"]
STEP_VARIANTS = {  # name: overrides (on EQUIV_BASE, token_mean)
    "local": [],  # one process: LocalEngine
    "local_two_iterations": TWO_ITER,
    "local_lora": LORA,
    "fsdp2": FSDP2,
    "fsdp2_layers_ac_two_iterations": FSDP2 + ["distributed.fsdp_wrap=layer",
                                               "distributed.activation_checkpointing=true"] + TWO_ITER,
    "fsdp2_lora": FSDP2 + LORA,
    "fsdp_bf16": BF16,
    "fsdp2_bf16": FSDP2 + BF16,
    "fsdp2_bf16_layers": FSDP2 + BF16 + ["distributed.fsdp_wrap=layer"],
    "fsdp_lora_bf16": LORA + BF16,
    "fsdp2_lora_bf16": FSDP2 + LORA + BF16,
}
ONE_PROCESS = ["local", "local_two_iterations", "local_lora"]
TWO_RANKS = [n for n in STEP_VARIANTS if n not in ONE_PROCESS]


def _steps(rank, world_size, names):
    """One learn() on this rank's half (or all) of the fixed rollouts per variant: rank 0 returns the gathered
    weights, the metrics, the weights the rollout engine gets (iter_full_weights in the rollout dtype) and the
    engine's class."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.rollout_engines import rollout_dtype
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    out = {}
    for name in names:
        cfg = load_config(None, EQUIV_BASE + ["loss_type=token_mean"] + STEP_VARIANTS[name] + [
            f"prompts_per_rank={per_rank}", "micro_batch_size=3", "output_dir=/tmp/unused_fsdp2"])
        trainer = GRPOTrainer(cfg, ctx)
        if cfg.lora.r:
            set_lora_b(trainer)  # B = 0 would leave A without gradient
        metrics = trainer.learn(batch.rows(rows), rewards[rows])
        sd, optim = trainer.engine.gather_full_state()
        synced = {n: t.clone() for n, t in trainer.engine.iter_full_weights(rollout_dtype(cfg))}
        if rank == 0:
            out[name] = dict(state={k: v.clone() for k, v in sd.items()}, metrics=metrics, synced=synced,
                             engine=type(trainer.engine).__name__, trained=sorted(optim["state"]))
    return out


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2_steps")
    one = run_ranks(_steps, 1, tmp, ONE_PROCESS)[0]
    two = run_ranks(_steps, 2, tmp, TWO_RANKS, timeout=600)[0]
    return {**one, **two}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _close(a, b, weights_tol: float, loss_tol: float, what: str) -> None:
    assert _max_diff(a["state"], b["state"]) <= weights_tol, (what, _max_diff(a["state"], b["state"]))
    assert abs(a["metrics"]["loss"] - b["metrics"]["loss"]) <= loss_tol, what
    assert abs(a["metrics"]["kl"] - b["metrics"]["kl"]) <= loss_tol, what
    assert a["metrics"]["grad_norm"] == pytest.approx(b["metrics"]["grad_norm"], rel=1e-4, abs=loss_tol), what


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_one_process_and_fsdp1(steps):
    assert {n: steps[n]["engine"] for n in TWO_RANKS if n.startswith("fsdp2")} == \
        {n: "FSDP2Engine" for n in TWO_RANKS if n.startswith("fsdp2")}
    assert steps["local"]["engine"] == "LocalEngine"
    moved = _max_diff(steps["local"]["state"], steps["local_two_iterations"]["state"])
    assert moved > 1e-4  # the variants are different steps: agreement below is not trivially true
    # full precision: 2 ranks of fsdp2 = 1 process, to the tolerance of test_equivalence's FSDP1 check
    _close(steps["fsdp2"], steps["local"], 1e-5, 1e-5, "fsdp2")
    _close(steps["fsdp2_layers_ac_two_iterations"], steps["local_two_iterations"], 1e-5, 1e-5, "layers+AC, 2 iters")
    _close(steps["fsdp2_lora"], steps["local_lora"], 1e-6, 1e-6, "lora")
    assert steps["fsdp2_bf16"]["metrics"]["loss"] != steps["local"]["metrics"]["loss"]  # bf16 really computes
    # bf16 compute from fp32 shards, fp32 gradient reduction: FSDP1's MixedPrecision does the same arithmetic
    _close(steps["fsdp2_bf16"], steps["fsdp_bf16"], 1e-6, 1e-6, "bf16")
    _close(steps["fsdp2_bf16_layers"], steps["fsdp_bf16"], 1e-6, 1e-6, "bf16, a unit per layer")
    _close(steps["fsdp2_lora_bf16"], steps["fsdp_lora_bf16"], 1e-6, 1e-6, "lora bf16")
    # LoRA trains the adapters only: the optimizer holds them alone, the base weights did not move
    lora = steps["fsdp2_lora"]
    assert lora["trained"] and all(".lora_" in k for k in lora["trained"])
    # the rollout weights: the master weights in the compute dtype (fp32: the weights themselves; bf16: their
    # rounding, gathered in bf16), LoRA merged W + (alpha / r) B A from the fp32 masters, as FSDP1 gives them
    for name in ("fsdp2", "fsdp2_bf16", "fsdp2_bf16_layers"):
        want = torch.bfloat16 if "bf16" in name else torch.float32
        got, state = steps[name]["synced"], steps[name]["state"]
        assert {t.dtype for t in got.values()} == {want}, name
        tensors_equal({k: state[k].to(want) for k in got}, got, name)
    for name in ("fsdp2_lora", "fsdp2_lora_bf16"):
        twin = steps[name.replace("fsdp2", "fsdp") if "bf16" in name else "local_lora"]
        tensors_equal(steps[name]["synced"].keys(), twin["synced"].keys(), name)
        assert _max_diff(steps[name]["synced"], twin["synced"]) <= 1e-6, name
        state = steps[name]["state"]
        for k, w in steps[name]["synced"].items():
            base = k.replace(".weight", ".base_layer.weight")
            if base in state:
                a, b = (state[base.replace("base_layer", f"lora_{x}.default")] for x in "AB")
                assert torch.equal(w, (state[base] + 2.0 * b @ a).to(w.dtype)), (name, k)


# ---------------------------------------------------------------------------------------------- checkpoints
def _tied_trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, TIED_BASE + overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def _straight(rank, world, backend, out):
    """2 steps with a full checkpoint after each; after step 1 also a sharded one (fsdp2)."""
    tr = _tied_trainer([f"distributed.backend={backend}", f"output_dir={out}"])
    assert tr.gen_model.lm_head.weight is tr.gen_model.model.embed_tokens.weight  # really tied
    if backend == "fsdp2":
        m = tr.engine.module
        assert m.lm_head.weight is m.model.embed_tokens.weight  # still one parameter once sharded
    for _ in range(2):
        tr.train_step()
        tr.save()
        if tr.step == 1 and backend == "fsdp2":
            tr.checkpointer.with_target(output_dir=f"{out}_sharded", save_format="sharded").save()


def _resumed(rank, world, runs):
    for backend, path, out in runs:
        tr = _tied_trainer([f"distributed.backend={backend}", f"output_dir={out}", f"resume_from_checkpoint={path}"])
        assert tr.step == 1 and type(tr.engine).__name__ == {"fsdp": "FSDPEngine", "fsdp2": "FSDP2Engine"}[backend]
        assert tr.train() == 0


@pytest.mark.slow
def test_fsdp2_tied_model_resumes_bitwise_and_across_backends(tmp_path):
    run_ranks(_straight, 2, tmp_path, "fsdp2", str(tmp_path / "fsdp2"))
    run_ranks(_straight, 2, tmp_path, "fsdp", str(tmp_path / "fsdp"))
    runs = {"fsdp2_from_fsdp2": ("fsdp2", "fsdp2/checkpoint-1"),
            "fsdp2_from_sharded": ("fsdp2", "fsdp2_sharded/checkpoint-1"),
            "fsdp2_from_fsdp": ("fsdp2", "fsdp/checkpoint-1"),
            "fsdp_from_fsdp2": ("fsdp", "fsdp2/checkpoint-1")}
    run_ranks(_resumed, 2, tmp_path, [(b, str(tmp_path / p), str(tmp_path / n)) for n, (b, p) in runs.items()])
    from safetensors.torch import load_file
    for backend in ("fsdp", "fsdp2"):  # the same HF layout: the tied matrix stored once
        weights = load_file(str(tmp_path / backend / "checkpoint-2" / "model.safetensors"))
        assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    fsdp2, fsdp = _state(tmp_path / "fsdp2" / "checkpoint-2"), _state(tmp_path / "fsdp" / "checkpoint-2")
    # the same files, keys and optimizer layout from both backends (FQN-keyed AdamW state)
    assert fsdp2[0].keys() == fsdp[0].keys() and fsdp2[1]["state"].keys() == fsdp[1]["state"].keys()
    assert fsdp2[1]["param_groups"][0]["params"] == fsdp[1]["param_groups"][0]["params"]
    first = _state(tmp_path / "fsdp2" / "checkpoint-1")[0]
    assert _max_diff(first, fsdp2[0]) > 1e-6  # step 2 moved the weights
    for name in ("fsdp2_from_fsdp2", "fsdp2_from_sharded"):  # the same backend: bit for bit
        tensors_equal(_state(tmp_path / name / "checkpoint-2")[:2], fsdp2[:2], name)
    # across backends the arithmetic of the reduction and the clip differs in the last bits only
    for name, want in (("fsdp2_from_fsdp", fsdp), ("fsdp_from_fsdp2", fsdp2)):
        got = _state(tmp_path / name / "checkpoint-2")
        assert _max_diff(got[0], want[0]) <= 1e-6, name
        for k, s in want[1]["state"].items():
            assert _max_diff(got[1]["state"][k], s) <= 1e-6, (name, k)
        assert got[2]["step"] == want[2]["step"] == 2


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.fast
@pytest.mark.parametrize("strategy", ["NO_SHARD", "HYBRID_SHARD"])
def test_fsdp2_refuses_sharding_strategies_it_has_not(strategy):
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(None, EQUIV_BASE + FSDP2 + [f"distributed.sharding_strategy={strategy}"])
    assert "config key 'distributed.sharding_strategy'" in str(err.value) and "fsdp2" in str(err.value)
    load_config(None, EQUIV_BASE + FSDP2 + ["distributed.sharding_strategy=SHARD_GRAD_OP"])  # it has this one
