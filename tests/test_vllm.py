"""vLLM rollouts on the real model (SmolLM2-135M-Instruct, fp32, CPU build of vLLM): the weight sync proven by
greedy completions equal to the lean decoder's on the same trained weights, vLLM's sampled log-probs against the
trainer's, and 2-rank training that checkpoints, resumes and stays in step when one rank's completions all stop at
once. Runs in the vLLM environment (README: "vLLM rollouts"); skipped where vLLM is not importable, except under
CI with GRPO_DIST_REQUIRE_VLLM=1, where that is a failure."""

import json
import math
import os

import pytest
import torch

from dist_utils import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _vllm_importable():
    try:
        import vllm  # noqa: F401
    except Exception as e:
        if os.environ.get("CI") == "true" and os.environ.get("GRPO_DIST_REQUIRE_VLLM") == "1":
            pytest.fail(f"CI requires vLLM (GRPO_DIST_REQUIRE_VLLM=1) but it cannot be imported: {e}", pytrace=False)
        pytest.skip(f"vLLM not importable ({type(e).__name__}); see docs/vllm.md")


def _cfg(model_dir, out, extra):
    from grpo_dist.config import load_config
    return load_config(None, [
        f"model.name_or_path={model_dir}", "rollout_engine=vllm", f"output_dir={out}", "reward_workers=0",
        "progress_bar=false", "report_to=[jsonl]", "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]",
        "data.limit=16", "prompts_per_rank=2", "num_generations=4", "max_completion_length=12", "beta=0",
        "micro_batch_size=8", "vllm.kv_cache_gb=1", "distributed.timeout_s=600"] + extra)


PROMPTS = ["What is 12 + 30?", "Name a colour of the sky.", "Count from 1 to 5:", "The capital of France is"]


def _sync_and_parity(rank, world, model_dir, out):
    """3 optimizer steps with vLLM rollouts, then greedy completions of vLLM, of the lean decoder on the trainer's
    weights and of the untrained model; and vLLM's sampled log-probs next to the trainer's for the same tokens."""
    from grpo_dist.decoder import prepare_replica
    from grpo_dist.distributed import init_distributed
    from grpo_dist.engines import copy_named_weights
    from grpo_dist.logprobs import selective_log_probs
    from grpo_dist.models import load_model
    from grpo_dist.rollout import completion_logits
    from grpo_dist.rollout_engines import ReplicaRolloutEngine, generate_batch, prompt_token_ids
    from grpo_dist.trainer import GRPOTrainer
    cfg = _cfg(model_dir, out, ["learning_rate=5e-5", "max_steps=3", "temperature=0.7", "save_final=false"])
    tr = GRPOTrainer(cfg, init_distributed(600))
    try:
        metrics = [tr.train_step() for _ in range(3)]
        tr.sync_rollout_weights()  # the weights after the third step
        ids = prompt_token_ids(tr.tokenizer, PROMPTS, 64)
        greedy = tr.sampling_spec(greedy=True, n=1)
        greedy.max_tokens = 24
        vllm_greedy = tr.rollout_engine.generate(ids, greedy).completion_ids
        replica = load_model(cfg.model, tr.tokenizer).eval()
        prepare_replica(replica)
        lean = ReplicaRolloutEngine(replica, True, tr.tokenizer.pad_token_id)
        untrained_greedy = lean.generate(ids, greedy).completion_ids
        copy_named_weights(replica, tr.engine.iter_full_weights())
        lean_greedy = lean.generate(ids, greedy).completion_ids
        # sampled completions at temperature 0.7: vLLM's log-probs vs the trainer's forward of the same tokens
        batch = generate_batch(tr.rollout_engine, tr.tokenizer, PROMPTS, [""] * len(PROMPTS), tr.sampling_spec(),
                               64, tr.ctx.device)
        with torch.no_grad():
            trainer_lp = selective_log_probs(completion_logits(tr.engine.module, batch), batch.completion_ids,
                                             temperature=cfg.temperature)
        diff = (trainer_lp - batch.sampler_logprobs)[batch.completion_mask.bool()].abs()
    finally:
        tr.close()
    return dict(vllm=vllm_greedy, lean=lean_greedy, untrained=untrained_greedy, diff_mean=float(diff.mean()),
                diff_max=float(diff.max()), tokens=int(diff.numel()), metrics=metrics)


def test_vllm_weight_sync_greedy_equals_lean_and_sampled_logprobs_match(smollm2_dir, tmp_path):
    r = run_ranks(_sync_and_parity, 1, tmp_path, smollm2_dir, str(tmp_path / "run"), timeout=1500)[0]
    print(f"\nvLLM vs trainer log-probs: mean |diff| {r['diff_mean']:.2e}, max {r['diff_max']:.2e} over "
          f"{r['tokens']} tokens; logged per step: " +
          ", ".join(f"{m['sampler_logprob_diff']:.2e}/{m['sampler_kl']:.2e}" for m in r["metrics"]))
    assert r["vllm"] == r["lean"], "vLLM did not generate from the trained weights"
    assert r["lean"] != r["untrained"], "3 steps left every greedy completion unchanged: the test proves nothing"
    # fp32 on both sides, only kernels differ: measured mean 6e-6, max 4e-5 over 170 tokens (8e-6..1e-5 logged per
    # step). A stale tensor gives 1e-2 and more: without the tied "lm_head.weight" in the sync this measured mean
    # 1.1e-2, max 0.11 after 3 steps, while the greedy tokens still agreed. Bounds: 15x / 50x the measured values.
    assert r["diff_mean"] < 1e-4 and r["diff_max"] < 2e-3
    for m in r["metrics"]:  # the logged mismatch is the same quantity
        assert 0 < m["sampler_logprob_diff"] < 1e-4 and 0 <= m["sampler_kl"] < 1e-8


def _two_rank_run(rank, world, model_dir, out, max_steps, resume):
    """Training with vLLM rollouts; rank 0's completions all stop at their first token (every id counts as EOS
    there), rank 1's run on, so the ranks' batches and micro-batch counts differ."""
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    extra = [f"max_steps={max_steps}", "save_steps=1", "learning_rate=1e-5", "micro_batch_size=3",
             "sampler_correction=token"] + (["resume_from_checkpoint=auto"] if resume else [])
    tr = GRPOTrainer(_cfg(model_dir, out, extra), init_distributed(600))
    start = tr.step
    if rank == 0:
        generate = tr.rollout_engine.generate

        def stop_at_once(prompt_ids, sampling):
            sampling.eos_ids = tuple(range(tr.hf_model.config.vocab_size))
            return generate(prompt_ids, sampling)
        tr.rollout_engine.generate = stop_at_once
    code = tr.train()
    return start, code, tr.step


def test_two_ranks_with_vllm_train_checkpoint_resume_and_stay_in_step(smollm2_dir, tmp_path):
    out = tmp_path / "run"
    first = run_ranks(_two_rank_run, 2, tmp_path, smollm2_dir, str(out), 2, False, timeout=1800)
    assert first == [(0, 0, 2), (0, 0, 2)]
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    resumed = run_ranks(_two_rank_run, 2, tmp_path, smollm2_dir, str(out), 3, True, timeout=1800)
    assert resumed == [(2, 0, 3), (2, 0, 3)]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        # rank 0: 8 one-token completions; rank 1: longer ones (12 at most)
        assert m["completion_length_mean"] < 12 and m["completion_length_max"] > 1
        assert 0 < m["sampler_logprob_diff"] < 1e-3 and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-2)
        assert m["time_weight_sync_s"] > 0
    assert (out / "checkpoint-3").is_dir()


def _async_rank(rank, world, model_dir, out):
    """1 trainer + 1 rollout rank that owns the vLLM engine (async_rollout.replica_engine), max_staleness 1."""
    from helpers import async_rank
    trainer, served = async_rank(_async_overrides(model_dir), out)
    if trainer is None:
        return {"served": served}
    code = trainer.train()
    return {"code": code, "step": trainer.step}


def _async_overrides(model_dir):
    return [f"model.name_or_path={model_dir}", "rollout_engine=vllm", "reward_workers=0", "progress_bar=false",
            "report_to=[jsonl]", "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]", "data.limit=16",
            "prompts_per_rank=2", "num_generations=4", "max_completion_length=12", "beta=0", "micro_batch_size=8",
            "vllm.kv_cache_gb=1", "distributed.timeout_s=600", "rollout_ranks=1", "max_staleness=1", "max_steps=3",
            "learning_rate=1e-5", "save_final=false"]


def test_async_rollout_rank_owns_a_vllm_engine_and_trains_3_steps(smollm2_dir, tmp_path):
    """Issue 38 item 7: with rollout ranks the rollout rank builds vLLM (in a process of its own) and loads each
    pushed version into it through reload_weights; the trainer trains on what it samples."""
    out = tmp_path / "run"
    trainer, rollout = run_ranks(_async_rank, 2, tmp_path, smollm2_dir, str(out), timeout=1500)
    assert trainer == {"code": 0, "step": 3} and rollout == {"served": 0}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert 0 < m["completion_length_mean"] <= 12 and all(math.isfinite(m[k]) for k in ("loss", "reward_mean"))
        assert m["async/dropped"] == 0
    assert [m["async/lag_max"] for m in lines] == [0, 1, 1]  # batch j sampled with version max(0, j - 1)
    # vLLM's log-probs against the trainer's. Step 1 (lag 0): the pushed weights themselves, so only kernels differ
    # (measured 7.1e-6, as the colocated test's 6e-6..1e-5); vLLM's dummy weights, never loaded, are far off. Steps
    # 2-3 (lag 1) add one optimizer step of drift (measured 0.043, 0.029 at learning_rate 1e-5).
    assert 0 < lines[0]["sampler_logprob_diff"] < 1e-4
    assert all(0 < m["sampler_logprob_diff"] < 0.2 for m in lines[1:])
    assert lines[0]["async/weight_sync_bytes"] > 0  # versions 0 and 1 went out during step 1


def test_evaluate_with_vllm_matches_the_lean_decoder(smollm2_dir, tmp_path):
    """python -m grpo_dist.tools.evaluate rollout_engine=vllm: the same greedy accuracy as the lean decoder (the reward
    reads the text, so equal greedy completions give equal accuracy), and sampled pass@k from vLLM."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)}) + "\n"
                            for a in range(6)))
    env = dict(os.environ, PYTHONPATH=f"{root / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    results = {}
    for engine in ("vllm", "lean"):
        out = tmp_path / f"{engine}.json"
        cmd = [sys.executable, "-m", "grpo_dist.tools.evaluate", "--model", str(smollm2_dir), "--data", str(data),
               "--num-samples", "2", "--output", str(out), f"rollout_engine={engine}", "max_completion_length=16",
               "reward_workers=0", "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]",
               "vllm.kv_cache_gb=1"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=root)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[engine] = json.loads(out.read_text())
    assert results["vllm"]["num_examples"] == 6
    assert results["vllm"]["accuracy"] == results["lean"]["accuracy"]
    assert 0 <= results["vllm"]["pass@1"] <= results["vllm"]["pass@2"] <= 1
