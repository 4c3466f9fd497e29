"""A wrong data path or missing preset data stops every rank at once, naming the file, before any model loads."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_dist import build as build_mod
from grpo_dist import trainer as trainer_mod
from grpo_dist.config import load_config
from grpo_dist.data import DataError
from grpo_dist.distributed import DistContext

ROOT = Path(__file__).resolve().parents[1]


def _no_model(*args, **kwargs):
    raise AssertionError("a model or tokenizer was loaded before the data was checked")


@pytest.mark.parametrize("override", ["data.path={missing}", "data.preset=gsm8k"])
def test_data_is_checked_before_any_model_loads(tmp_path, monkeypatch, override):
    monkeypatch.setenv("GRPO_DIST_DATA_DIR", str(tmp_path))  # an empty mirror: the preset's files are missing
    monkeypatch.setattr(trainer_mod, "load_tokenizer", _no_model)
    monkeypatch.setattr(build_mod, "load_model", _no_model)  # models are built in build.py
    missing = tmp_path / "nope" / "train.jsonl"
    cfg = load_config("configs/smoke_cpu.yaml" if (ROOT / "configs").is_dir() else None,
                      [f"output_dir={tmp_path / 'out'}", override.format(missing=missing)])
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    expected = str(missing) if "path" in override else str(tmp_path / "gsm8k" / "train.jsonl")
    with pytest.raises(DataError, match=expected.replace("\\", "\\\\")):
        trainer_mod.GRPOTrainer(cfg, ctx)


def test_wrong_data_path_fails_on_every_rank_with_the_file_named(tmp_path):
    missing = tmp_path / "missing.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0",
           "-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", f"output_dir={tmp_path / 'out'}",
           "data.preset=null", f"data.path={missing}", "progress_bar=false"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(__import__("os").environ, OMP_NUM_THREADS="1"))
    assert r.returncode != 0
    # The preflight checks the path on every rank before anything loads; the ranks agree on one verdict, which
    # rank 0 prints once (the other ranks exit with the same code without repeating it).
    lines = [x for x in r.stderr.splitlines() if x.startswith("grpo_dist: rank ")]
    assert len(lines) == 1 and str(missing) in lines[0] and "data.path" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in "\n".join(x for x in r.stderr.splitlines() if "grpo_dist" in x)
