"""backend=deepspeed: ZeRO-2 and ZeRO-3 take the same GRPO step as FSDP on the same fixed rollouts, skip steps the
same way, and write checkpoints that from_pretrained loads and that resume exactly. The distributed tests need the
optional `deepspeed` package (pip install -e .[deepspeed]) and are skipped without it; the config and
missing-package checks run always."""

import json
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from helpers import EQUIV_BASE as BASE
from helpers import G, PROMPTS, fixed_rollout, need_deepspeed

EXAMPLE_ZERO3 = Path(__file__).resolve().parents[1] / "configs" / "deepspeed_zero3.json"
ENGINES = {
    "fsdp": ["distributed.backend=fsdp"],
    "zero2": ["distributed.backend=deepspeed", "distributed.zero_stage=2"],
    # ZeRO-3 from the example DeepSpeed file (HF-style "auto" values, overlap_comm) rather than from our keys
    "zero3": ["distributed.backend=deepspeed", f"distributed.deepspeed_config={EXAMPLE_ZERO3}"],
}
VARIANTS = {  # beta > 0 in BASE: the reference model runs too (ZeRO-3: partitioned, inference only)
    "token_mean": ["loss_type=token_mean"],
    "two_iterations": ["scale_rewards=batch", "num_iterations=2", "epsilon=0.1"],  # old log-probs + 2 steps
    "bf16": ["loss_type=token_mean", "distributed.mixed_precision=bf16"],  # compared within bf16 noise
    "activation_checkpointing": ["loss_type=token_mean", "distributed.activation_checkpointing=true"],
}


# ---------------------------------------------------------------------------------------- no deepspeed needed
def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    from grpo_dist.config import ConfigError
    from grpo_dist.engines.deepspeed import import_deepspeed
    with pytest.raises(ConfigError, match=r"pip install -e \.\[deepspeed\]"):
        import_deepspeed()


def _cfg(*overrides):
    from grpo_dist.config import load_config
    return load_config(None, BASE + ["distributed.backend=deepspeed", *overrides])


def test_deepspeed_config_from_keys_and_from_files(tmp_path):
    from grpo_dist.config import ConfigError
    from grpo_dist.engines.deepspeed import build_deepspeed_config

    ds = build_deepspeed_config(_cfg("distributed.zero_stage=3", "micro_batch_size=3", "max_grad_norm=0.5"), 2)
    assert ds["zero_optimization"] == {"stage": 3}
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 0.5
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["train_batch_size"] == 6
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert build_deepspeed_config(_cfg("max_grad_norm=0"), 2)["gradient_clipping"] == 0.0
    assert build_deepspeed_config(_cfg("distributed.mixed_precision=bf16"), 2)["bf16"]["enabled"] is True

    # A user's config in the HF style: "auto" filled in, optimizer/scheduler dropped, GAS and clipping ours.
    user = {"zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "overlap_comm": True},
            "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR"}, "gradient_accumulation_steps": 8, "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto"}
    (tmp_path / "ds.json").write_text(json.dumps(user))
    (tmp_path / "ds.yaml").write_text("zero_optimization:\n  stage: 3\nbf16:\n  enabled: true\n")
    with pytest.warns(UserWarning) as caught:
        ds = build_deepspeed_config(_cfg(f"distributed.deepspeed_config={tmp_path / 'ds.json'}",
                                         "distributed.zero_stage=3"), 2, hidden_size=32)
    said = " ".join(str(w.message) for w in caught)
    assert "'optimizer' section is ignored" in said and "gradient_accumulation_steps=8 is replaced by 1" in said
    assert "optimizer" not in ds and "scheduler" not in ds
    assert ds["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 32 * 32, "overlap_comm": True}
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is False
    ds = build_deepspeed_config(_cfg(f"distributed.deepspeed_config={tmp_path / 'ds.yaml'}"), 2)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True  # the file's stage wins

    bad = {"s1.json": ({"zero_optimization": {"stage": 1}}, r"ds/s1.json: zero_optimization.stage=1"),
           "auto.json": ({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}},
                         r"'auto' at zero_optimization.sub_group_size"),
           "list.json": ([1, 2], r"must be a mapping"),
           "fp16.json": ({"fp16": {"enabled": True}}, r"contradicts distributed.mixed_precision=bf16")}
    (tmp_path / "ds").mkdir()
    for name, (content, message) in bad.items():
        (tmp_path / "ds" / name).write_text(json.dumps(content))
        extra = ["distributed.mixed_precision=bf16"] if name == "fp16.json" else []
        with pytest.raises(ConfigError, match=message):
            build_deepspeed_config(_cfg(f"distributed.deepspeed_config={tmp_path / 'ds' / name}", *extra), 2)
    ds = build_deepspeed_config(_cfg(f"distributed.deepspeed_config={EXAMPLE_ZERO3}"), 2, hidden_size=32)
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 10**9  # JSON numbers stay numbers
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 320
    (tmp_path / "broken.json").write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        build_deepspeed_config(_cfg(f"distributed.deepspeed_config={tmp_path / 'broken.json'}"), 2)
    with pytest.raises(ConfigError, match="does not exist"):
        build_deepspeed_config(_cfg(f"distributed.deepspeed_config={tmp_path / 'nope.json'}"), 2)


# ------------------------------------------------------------------------------------ distributed, deepspeed
def _full(trainer):
    sd, _ = trainer.engine.gather_full_state()
    return None if sd is None else {k: v.clone() for k, v in sd.items()}


def _steps(rank, world_size, engine_names):
    """For each engine: one learn() per variant on the fixed rollouts; then skip checks. Results on rank 0."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    batch, rewards = fixed_rollout()
    per_rank = PROMPTS // world_size
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    results = {}
    for engine in engine_names:
        for variant, overrides in VARIANTS.items():
            # micro_batch_size=3: three micro-batches per rank, gradients accumulated before one step
            cfg = load_config(None, BASE + overrides + ENGINES[engine] + [
                f"prompts_per_rank={per_rank}", "micro_batch_size=3", "output_dir=/tmp/unused"])
            trainer = GRPOTrainer(cfg, ctx)
            metrics = trainer.learn(batch.rows(rows), rewards[rows])
            sd = _full(trainer)
            # the generation replica gets exactly these weights, on every rank
            trainer.engine.copy_weights_to(trainer.gen_model)
            # (DeepSpeed bf16: the weights it computes with, i.e. the fp32 masters rounded to bf16)
            replica_diff = max(min((p - sd[n]).abs().max().item(), (p - sd[n].bfloat16().float()).abs().max().item())
                               for n, p in trainer.gen_model.named_parameters()) if rank == 0 else 0.0
            if rank == 0:
                results[(engine, variant)] = (sd, metrics, replica_diff)

        # Skips leave weights, optimizer and schedule alone, on every backend: asked for with finite gradients,
        # and forced by a NaN gradient on one rank only.
        eng = trainer.engine
        skips = []
        for kind in ("asked", "nan_on_rank1"):
            before, lr = _full(trainer), eng.current_lr()
            out = eng.module(**trainer.learner.empty_inputs())
            loss = out.logits.float().pow(2).mean()
            if kind == "nan_on_rank1" and rank == 1:
                loss = loss * float("nan")
            eng.backward(loss)
            res = eng.step(skip=(kind == "asked"))
            after = _full(trainer)
            same = rank != 0 or all(torch.equal(before[k], after[k]) for k in before)
            skips.append((kind, res.applied, res.grad_norm, same, eng.current_lr() == lr))
        # ... and the next real step still applies (nothing held, no stale gradients)
        out = eng.module(**trainer.learner.empty_inputs())
        eng.backward(out.logits.float().pow(2).mean())
        res = eng.step()
        if rank == 0:
            results[(engine, "skips")] = (skips, res.applied, res.grad_norm)
    return results


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    need_deepspeed()
    tmp = tmp_path_factory.mktemp("ds_steps")
    # One launch for the three backends (an FSDP and two DeepSpeed engines live in turn in the same processes).
    return run_ranks(_steps, 2, tmp, list(ENGINES), timeout=600)[0]


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_zero_step_equals_fsdp_step(stepped, engine):
    for variant in VARIANTS:
        ref_sd, ref_m, _ = stepped[("fsdp", variant)]
        sd, m, replica_diff = stepped[(engine, variant)]
        assert replica_diff == 0.0
        assert all(v.dtype == torch.float32 for v in sd.values())  # bf16: the fp32 master weights are saved
        if variant == "bf16":  # bf16 compute rounds differently in the two engines: same step within bf16 noise
            assert _max_diff(ref_sd, sd) < 2e-3
            assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-3)
            continue
        assert _max_diff(ref_sd, sd) < 1e-5, variant
        for key in ("loss", "kl", "policy_loss", "clip_fraction", "grad_norm"):
            assert m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-6), (variant, key)
        assert m["learning_rate"] == ref_m["learning_rate"]
    # the step moved the weights (else equality proves nothing), and the variants differ
    a, b = stepped[(engine, "token_mean")][0], stepped[(engine, "two_iterations")][0]
    assert _max_diff(a, b) > 1e-4
    assert _max_diff(a, stepped[(engine, "bf16")][0]) > 0


@pytest.mark.parametrize("engine", list(ENGINES))
def test_skipped_steps_change_nothing(stepped, engine):
    skips, next_applied, next_norm = stepped[(engine, "skips")]
    for kind, applied, grad_norm, unchanged, same_lr in skips:
        assert not applied and unchanged and same_lr, (engine, kind)
        if kind == "asked":
            assert grad_norm > 0 and grad_norm == grad_norm and grad_norm != float("inf")  # still reported
    assert next_applied and next_norm > 0


def _run_then_resume(rank, world_size, out_dir, stages):
    """Per ZeRO stage, run A: 2 steps, checkpoint after each; run B: resume from A's checkpoint-1, run step 2."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    ctx = init_distributed(120)
    codes = []
    for stage in stages:
        common = BASE[:1] + [
            "data.preset=arithmetic", "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]",
            "reward_workers=0", "prompts_per_rank=2", "num_generations=4", "max_completion_length=8",
            "micro_batch_size=3", "learning_rate=1e-3", "beta=0.04", "max_steps=2", "save_steps=1",
            "progress_bar=false", "report_to=[]", "distributed.backend=deepspeed", f"distributed.zero_stage={stage}"]
        for run, extra in (("a", []), ("b", [f"resume_from_checkpoint={out_dir}/{stage}/a/checkpoint-1"])):
            cfg = load_config(None, common + [f"output_dir={out_dir}/{stage}/{run}", *extra])
            codes.append(GRPOTrainer(cfg, ctx).train())
    return codes


def test_deepspeed_checkpoints_load_in_hf_and_resume_exactly(tmp_path):
    need_deepspeed()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_dist.checkpoint import verify_checkpoint
    stages = [2, 3]
    assert run_ranks(_run_then_resume, 2, tmp_path, str(tmp_path), stages, timeout=600) == [[0] * 4] * 2
    for stage in stages:
        a, b = tmp_path / str(stage) / "a", tmp_path / str(stage) / "b"
        for ck in (a / "checkpoint-1", a / "checkpoint-2", b / "checkpoint-2"):
            assert verify_checkpoint(ck, check_hashes=True) is None
            assert sorted(p.name for p in (ck / "deepspeed" / "state").glob("*optim_states.pt")) == [
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        w1, wa, wb = (load_file(str(ck / "model.safetensors"))
                      for ck in (a / "checkpoint-1", a / "checkpoint-2", b / "checkpoint-2"))
        # bitwise: the AdamW moments of step 1 came back (fresh moments would give another step 2)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"ZeRO-{stage}: resumed run differs"
        assert max((wa[k] - w1[k]).abs().max().item() for k in wa) > 0  # step 2 did train
        model = AutoModelForCausalLM.from_pretrained(a / "checkpoint-2")
        assert all(torch.equal(p, wa[n]) for n, p in model.named_parameters() if n in wa)
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()
