"""save_best: output_dir/best/ keeps the checkpoint of the best evaluation (config keys save_best, save_best_mode).

One CPU process, in-process trainers of the tiny model (4 steps, an evaluation every step, a few seconds each). The
evaluation runs for real and its accuracy is then replaced by a scripted one that
goes up, then down, so which step is best is known. The weights of every step are captured at its evaluation, so
best/ is compared with the step it claims to hold even after pruning deleted that step's checkpoint-N.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import in_process, tensors_equal

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}",
        "data.limit=8", "data.eval_limit=4", "prompts_per_rank=2", "num_generations=4", "max_completion_length=6",
        "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "reward_workers=0", "learning_rate=1e-3",
        "beta=0", "micro_batch_size=8", "max_steps=4", "save_format=full", "progress_bar=false",
        "report_to=[jsonl]", "eval_steps=1", "save_best=eval_accuracy", "log_completions=0"]
SCRIPT = {1: 0.25, 2: 0.75, 3: 0.5, 4: 0.0, 5: 0.5, 6: 0.9}  # up, then down (a resume: worse, then better)


def run(overrides, weights=None):
    """Build a trainer on BASE + overrides and train it; evaluate() runs for real, then reports SCRIPT[step]
    (and records the step's weights in `weights`)."""
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + overrides)
    # The process group and its variables must not outlive the run: the module-scoped fixture below runs before
    # the per-test restore of RANK/MASTER_PORT (conftest.py), and a later subprocess given the same MASTER_PORT
    # would find this process still listening on it (EADDRINUSE).
    return in_process(lambda: _train(GRPOTrainer(cfg, init_distributed(60)), weights))


def _train(tr, weights):
    real = tr.evaluate

    def scripted():
        out = real()
        assert 0.0 <= out["eval_accuracy"] <= 1.0
        if weights is not None:
            model_sd = tr.engine.gather_full_state()[0]  # collective; the state on rank 0 only
            weights[tr.step] = {k: v.clone() for k, v in model_sd.items()} if model_sd is not None else None
        return {"eval_accuracy": SCRIPT[tr.step]}

    tr.evaluate = scripted
    assert tr.train() == 0
    return tr


def best_record(out):
    return json.loads((out / "best" / "best.json").read_text())


def digest(folder):
    import hashlib
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """save_steps=1, save_total_limit=1: best/ is made of checkpoint-2's files, and checkpoint-2 is pruned."""
    out = tmp_path_factory.mktemp("linked") / "run"
    weights: dict = {}
    run([f"output_dir={out}", "save_steps=1", "save_total_limit=1"], weights)
    return out, weights


def test_best_holds_the_best_step_survives_pruning_and_verifies(linked):
    from transformers import AutoModelForCausalLM

    from grpo_dist import checkpoint as ckpt
    out, weights = linked
    assert best_record(out) == {"metric": "eval_accuracy", "mode": "max", "value": 0.75, "step": 2}
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["checkpoint-4"]  # checkpoint-2 was pruned
    assert ckpt.verify_checkpoint(out / "best", check_hashes=True) is None
    best = load_file(str(out / "best" / "model.safetensors"))
    tensors_equal(best, {k: weights[2][k] for k in best}, "best vs step 2")
    assert any(not torch.equal(best[k], weights[4][k]) for k in best)  # not the last step's weights
    assert ckpt.read_trainer_state(out / "best")["step"] == 2  # resumable: the state of step 2
    model = AutoModelForCausalLM.from_pretrained(out / "best")  # an HF directory
    tensors_equal(model.model.embed_tokens.weight.detach(), weights[2]["model.embed_tokens.weight"])
    # auto-resume never takes best/ for the newest checkpoint
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-4"
    assert ckpt.resolve_auto(str(out), True, False) == out / "checkpoint-4"


def test_resume_keeps_a_better_best_and_replaces_it_only_with_a_better_one(linked, tmp_path, capsys):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(linked[0], out)
    before = digest(out / "best")
    run([f"output_dir={out}", "save_steps=1", "save_total_limit=1", "resume_from_checkpoint=auto", "max_steps=5"])
    assert "holds eval_accuracy = 0.75 (step 2)" in capsys.readouterr().out
    assert digest(out / "best") == before  # step 5's 0.5 is worse than the 0.75 of step 2
    weights: dict = {}
    run([f"output_dir={out}", "save_steps=1", "save_total_limit=1", "resume_from_checkpoint=auto", "max_steps=6"],
        weights)
    assert best_record(out)["step"] == 6 and best_record(out)["value"] == 0.9
    best = load_file(str(out / "best" / "model.safetensors"))
    tensors_equal(best, {k: weights[6][k] for k in best}, "best vs step 6")


def test_best_at_a_step_without_checkpoint_is_saved_on_its_own(tmp_path, capsys):
    from grpo_dist import checkpoint as ckpt
    out = tmp_path / "run"
    weights: dict = {}
    run([f"output_dir={out}", "save_steps=0"], weights)  # checkpoint-4 only (save_final)
    printed = capsys.readouterr().out
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["checkpoint-4"]
    assert best_record(out)["step"] == 2
    assert ckpt.verify_checkpoint(out / "best", check_hashes=True) is None
    best = load_file(str(out / "best" / "model.safetensors"))
    tensors_equal(best, {k: weights[2][k] for k in best}, "best vs step 2")
    assert not list(out.glob(".tmp-checkpoint-*")) and not (out / ".old-best").exists()
    assert "save_best: eval_accuracy = 0.75 at step 2, the best so far" in printed


def test_a_crash_while_swapping_leaves_the_previous_best(linked, tmp_path):
    import shutil

    from grpo_dist import checkpoint as ckpt
    out = tmp_path / "run"
    shutil.copytree(linked[0], out)
    before = digest(out / "best")
    os.replace(out / "best", out / ".old-best")  # killed between the two renames of a swap
    (out / ".tmp-checkpoint-best").mkdir()  # and the half-written new one
    record = ckpt.read_best(out, "eval_accuracy", "max", check_hashes=True)
    assert record is not None and record["step"] == 2
    assert digest(out / "best") == before and not (out / ".old-best").exists()
    assert ckpt.read_best(out, "eval_accuracy", "min") is None  # judged another way: not comparable


def test_a_metric_the_run_never_logs_is_refused_at_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                        f"output_dir={tmp_path}/o", "save_best=eval_accuracy"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["grpo_dist: config error: command line: config key 'save_best' = eval_accuracy is never "
                     "logged: eval_steps = 0 (no evaluation); set eval_steps=N, or save_best=null"], r.stderr
    from grpo_dist.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="'save_best' = 'accuracy' is not a metric the evaluation logs"):
        load_config("configs/smoke_cpu.yaml", ["save_best=accuracy", "eval_steps=1"])


def test_demo_configs_keep_the_best_and_the_summary_reports_last_and_best(tmp_path, capsys):
    from grpo_dist.config import load_config
    from grpo_dist.tools.demo import write_summary
    for name in ("demo_cpu.yaml", "demo_real_cpu.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.save_best == "eval_accuracy" and cfg.eval_steps > 0, name
    for script in ("launch/demo.sh", "launch/demo_real.sh"):  # the final evaluation covers best/ too
        text = (ROOT / script).read_text()
        assert '"$OUT/best"' in text and "--best-eval" in text and '"$OUT"/best' in text, script
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(json.dumps({"metric": "eval_accuracy", "mode": "max",
                                                             "value": 0.8, "step": 100}))
    evals = {"base": 0.4, "final": 0.7, "best": 0.8}
    for when, acc in evals.items():
        model = str(tmp_path / ("best" if when == "best" else "checkpoint-150"))
        (tmp_path / f"{when}.json").write_text(json.dumps({"accuracy": acc, "num_examples": 80, "model": model,
                                                           "truncated_fraction": 0.0}))
    summary = write_summary(tmp_path / "base.json", tmp_path / "final.json", tmp_path / "s.json", 1.0,
                            best_eval=tmp_path / "best.json")
    assert (summary["final_accuracy"], summary["best_accuracy"], summary["best_step"]) == (0.7, 0.8, 100)
    assert json.loads((tmp_path / "s.json").read_text())["best_step"] == 100
    assert "best checkpoint (step 100" in capsys.readouterr().out


def test_a_lora_run_keeps_the_adapter_as_best(tmp_path):
    from grpo_dist import checkpoint as ckpt
    out = tmp_path / "run"
    weights: dict = {}
    run([f"output_dir={out}", "save_steps=0", "lora.r=4"], weights)  # best at step 2: a save of its own
    assert best_record(out)["step"] == 2
    assert ckpt.verify_checkpoint(out / "best", check_hashes=True) is None
    names = {p.name for p in (out / "best").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names


def test_a_damaged_best_is_moved_aside_and_a_fresh_run_does_not_take_its_folder(linked, tmp_path):
    import shutil

    from grpo_dist import checkpoint as ckpt
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.preflight import check_previous_run
    out = tmp_path / "run"
    shutil.copytree(linked[0], out)
    with open(out / "best" / "model.safetensors", "r+b") as f:  # same size: only the checksum can tell
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    assert ckpt.read_best(out, "eval_accuracy", "max", check_hashes=True) is None
    assert not (out / "best").exists() and (out / "damaged" / "best" / "best.json").is_file()
    only_best = tmp_path / "only_best"
    only_best.mkdir()
    shutil.copytree(linked[0] / "best", only_best / "best")
    with pytest.raises(ConfigError, match="already holds a run"):  # best/ is a run's output like checkpoint-N
        check_previous_run(load_config(None, BASE + [f"output_dir={only_best}"]))


def _two_ranks(rank, world, out):
    weights: dict = {}
    tr = run([f"output_dir={out}", "save_steps=2", "max_steps=3", "prompts_per_rank=1", "distributed.timeout_s=60"],
             weights)
    return tr.checkpointer.best, weights[2] if rank == 0 else None


@pytest.mark.slow
def test_two_ranks_agree_on_the_best(tmp_path):
    """2 gloo ranks: step 1 is best by a save of its own, step 2 (a save_steps step) by links; both verify."""
    from dist_utils import run_ranks

    from grpo_dist import checkpoint as ckpt
    out = tmp_path / "run"
    results = run_ranks(_two_ranks, 2, tmp_path, out)
    assert results[0][0] == results[1][0] == {"metric": "eval_accuracy", "mode": "max", "value": 0.75, "step": 2}
    assert ckpt.verify_checkpoint(out / "best", check_hashes=True) is None
    assert {"rng_state_0.pt", "rng_state_1.pt"} <= {p.name for p in (out / "best").iterdir()}
    best = load_file(str(out / "best" / "model.safetensors"))
    tensors_equal(best, {k: results[0][1][k] for k in best}, "best vs step 2")
