"""The real entry point under torchrun: metrics, checkpoints that from_pretrained loads, resume; and bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _run(args, timeout=300):
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_torchrun_smoke_checkpoint_and_resume(tmp_path):
    out = tmp_path / "run"
    common = ["-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}", "save_steps=1",
              "progress_bar=false"]
    r = _run(TORCHRUN + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"] + common + ["max_steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward_mean", "reward_std", "accuracy", "completion_length_mean", "completion_length_max",
                "zero_advantage_fraction", "loss", "kl", "entropy", "clip_fraction", "grad_norm", "learning_rate",
                "step_time_s", "time_rollout_s", "time_reward_s", "time_logprobs_s", "time_update_s",
                "completion_tokens_per_s"):
        assert key in metrics[0], key
    assert (out / "config.yaml").is_file()
    for step in (1, 2):
        assert (out / f"checkpoint-{step}" / "manifest.json").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    tok = AutoTokenizer.from_pretrained(out / "checkpoint-2")
    assert model.config.model_type == "qwen2" and tok.eos_token_id is not None

    r = _run(TORCHRUN + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"] + common +
             ["max_steps=3", "resume_from_checkpoint=auto"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "checkpoint-2" in r.stdout
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert (out / "checkpoint-3" / "manifest.json").is_file()


def test_unknown_config_key_fails_fast_with_its_name(tmp_path):
    r = _run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", "num_generation=4"])
    assert r.returncode == 2
    assert "unknown config key 'num_generation' (did you mean 'num_generations'?)" in r.stderr


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n{"question": oops}\n')
    r = _run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
              f"output_dir={tmp_path / 'out'}", "data.preset=null", f"data.path={data}", "reward_workers=0"])
    assert r.returncode == 2
    assert f"{data}:3" in r.stderr


def test_smoke_config_updates_the_model(tmp_path):
    """The smoke config as shipped (one process) produces a gradient: its rewards vary within groups, so the run
    exercises a real update, not a string of zero-gradient steps. It ends saying where its outputs are."""
    out = tmp_path / "smoke"
    r = _run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={out}",
              "progress_bar=false"])
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4
    assert max(m["grad_norm"] for m in metrics) > 0, [m["grad_norm"] for m in metrics]
    assert min(m["zero_advantage_fraction"] for m in metrics) < 1
    assert f"outputs in {out.resolve()}" in r.stdout
