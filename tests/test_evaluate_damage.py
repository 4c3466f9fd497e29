"""`python -m grpo_dist.tools.evaluate` on damaged checkpoints (issue 39, case 1): a checkpoint is verified by its
manifest's sha256 as a resume verifies it; a damaged one named directly stops with one line and exit 2, an
output_dir's newest intact checkpoint is evaluated and named (the damaged newer ones are named and left in place),
and truncated weights without a manifest stop with one line and exit 2, not a SafetensorError traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import flip

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRPO_DIST_FAULT"):
        env.pop(k, None)
    return env


def evaluate(model, *extra):
    return subprocess.run([sys.executable, "-m", "grpo_dist.tools.evaluate", "--model", str(model), "--limit", "2",
                           "reward_workers=0", *extra], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)


def evaluate_here(capsys, model, *extra):
    """main() in this process, for the cases that stop before any model loads: (exit code, stderr)."""
    from grpo_dist.tools.evaluate import main
    code = main(["--model", str(model), "--limit", "2", *extra, "reward_workers=0"])
    return code, capsys.readouterr().err


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("grpo_dist.tools.evaluate: ") and "warning" not in ln
             and "using the training run's config" not in ln]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_damage") / "run"
    r = subprocess.run([sys.executable, "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml",
                        f"output_dir={out}", "max_steps=2", "save_steps=1", "reward_workers=0", "progress_bar=false"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_damaged_checkpoints(run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    flip(out / "checkpoint-2" / "model.safetensors")
    # named directly: one line naming the file, exit 2 (on the code before: evaluated, accuracy printed, exit 0)
    code, err = evaluate_here(capsys, out / "checkpoint-2")
    assert code == 2, (code, err[-3000:])
    line = one_line(err)
    assert "checkpoint-2" in line and "model.safetensors has the wrong checksum" in line, line
    # the output_dir: its newest intact checkpoint, named, the damaged one named and left where it is (on the code
    # before: checkpoint-2 was evaluated)
    r = evaluate(out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["model"] == str(out / "checkpoint-1")
    assert f"{out / 'checkpoint-2'}: model.safetensors has the wrong checksum" in r.stderr, r.stderr[-3000:]
    assert f"evaluating {out / 'checkpoint-1'}, the newest intact checkpoint in {out}" in r.stderr, r.stderr[-3000:]
    assert (out / "checkpoint-2").is_dir() and not (out / "damaged").exists()  # evaluation changes nothing
    # none intact: one line naming each, exit 2
    flip(out / "checkpoint-1" / "optimizer.pt")
    code, err = evaluate_here(capsys, out)
    assert code == 2, err[-3000:]
    line = one_line(err)
    assert "no intact checkpoint" in line and "checkpoint-1: optimizer.pt" in line and "checkpoint-2:" in line, line


def test_truncated_weights_without_a_manifest(run, tmp_path, capsys):
    """A checkpoint whose manifest is gone is an incomplete save; an HF directory (no manifest at all) with cut
    weights is named with the file before anything loads (on the code before: SafetensorError traceback, exit 1)."""
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(run / "checkpoint-1", ckpt)
    (ckpt / "manifest.json").unlink()
    code, err = evaluate_here(capsys, ckpt)
    assert code == 2 and "no manifest.json" in one_line(err), err[-3000:]
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (run / "checkpoint-1").iterdir():
        if f.is_file() and f.name not in ("manifest.json", "trainer_state.json", "optimizer.pt") and \
                not f.name.startswith("rng_state"):
            shutil.copy(f, hf / f.name)
    weights = hf / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    code, err = evaluate_here(capsys, hf, "--config", str(ROOT / "configs/smoke_cpu.yaml"))
    assert code == 2, (code, err[-3000:])
    line = one_line(err)
    assert "model.safetensors" in line and "truncated" in line, line
