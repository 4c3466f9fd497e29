"""A full disk while saving, on a real small filesystem: a tmpfs mounted by the test (root only; CI runs as root, so
there a failed mount fails the test). Every write error of the save path (weights, optimizer, DCP shards) is a
CheckpointError naming the last good checkpoint, on every rank, exit code 2 with one line; the partial copy is
removed and the earlier checkpoints are untouched. The tiny smoke model: model.safetensors ~350 KB, optimizer.pt
~720 KB, a full checkpoint ~1.1 MB.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import fill, tmpfs

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["-m", "grpo_dist.train", "--config", "configs/smoke_cpu.yaml", "progress_bar=false", "reward_workers=0",
         "max_steps=1", "log_completions=0"]
TINY = ["model.tiny={architecture: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 128, tokenizer: char}",
        "data.limit=8", "prompts_per_rank=2", "num_generations=2", "max_completion_length=4", "reward_workers=0",
        "beta=0", "progress_bar=false", "report_to=[]", "log_completions=0"]


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _trainer(overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, TINY + overrides)
    return GRPOTrainer(cfg, init_distributed(60))


def _assert_failed_cleanly(err, out, good):
    from grpo_dist.checkpoint import verify_checkpoint
    msg = str(err.value)
    assert f"writing checkpoint-2 in {out} failed: rank 0: " in msg, msg
    assert f"the last good checkpoint is {good}" in msg, msg
    assert not list(out.glob(".tmp-checkpoint-*")), "the partial copy is left"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert verify_checkpoint(good, check_hashes=True) is None
    return msg


def test_full_disk_during_full_save_weights_then_optimizer(tmp_path, one_thread):
    """Before: safetensors' SafetensorError and torch.save's RuntimeError escaped as tracebacks (exit 1)."""
    with tmpfs(tmp_path / "fs", "4m") as fs:
        out = fs / "run"
        tr = _trainer([f"output_dir={out}", "save_format=full"])
        tr.train_step()
        good = tr.save()
        before = digest(good)
        weights = (good / "model.safetensors").stat().st_size
        tr.train_step()
        filler = fill(fs, 64 << 10)  # room for config.json, not for the weights
        from grpo_dist.checkpoint import CheckpointError
        with pytest.raises(CheckpointError) as err:
            tr.save()
        msg = _assert_failed_cleanly(err, out, good)
        assert "No space left on device" in msg and "model.safetensors" in msg, msg
        filler.unlink()
        filler = fill(fs, weights + (128 << 10))  # the weights fit, the optimizer state does not
        with pytest.raises(CheckpointError) as err:
            tr.save()
        msg = _assert_failed_cleanly(err, out, good)
        assert "optimizer.pt" in msg and "model.safetensors" not in msg, msg
        assert digest(good) == before
        filler.unlink()  # space again: the next save works
        assert tr.save().name == "checkpoint-2"


def test_full_disk_during_sharded_save(tmp_path, one_thread):
    """save_format=sharded: torch.distributed.checkpoint's own errors (on one process)."""
    with tmpfs(tmp_path / "fs", "4m") as fs:
        out = fs / "run"
        tr = _trainer([f"output_dir={out}", "save_format=sharded"])
        tr.train_step()
        good = tr.save()
        before = digest(good)
        tr.train_step()
        fill(fs, 16 << 10)
        from grpo_dist.checkpoint import CheckpointError
        with pytest.raises(CheckpointError) as err:
            tr.save()
        msg = _assert_failed_cleanly(err, out, good)
        assert "No space left on device" in msg and "sharded" in msg, msg
        assert digest(good) == before


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRPO_DIST_FAULT"):
        env.pop(k, None)
    return env


def test_full_disk_exits_2_with_one_line(tmp_path):
    """The entry point: a tmpfs the weights fit on but not the optimizer state."""
    with tmpfs(tmp_path / "fs", "640k") as fs:
        r = subprocess.run([sys.executable, *TRAIN, f"output_dir={fs / 'run'}", "save_format=full"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("grpo_dist: ")]
        assert line.startswith(f"grpo_dist: rank 0: CheckpointError: writing checkpoint-1 in {fs / 'run'} failed: "
                               f"rank 0: "), line
        assert "optimizer.pt" in line and "the last good checkpoint is none" in line, line
        assert not list((fs / "run").glob("*checkpoint-*"))


def test_full_disk_sharded_two_ranks_every_rank_exits_2(tmp_path):
    """2 ranks under torchrun, save_format=sharded: each rank writes its own shards; every rank stops with 2."""
    codes = tmp_path / "codes"
    with tmpfs(tmp_path / "fs", "640k") as fs:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend",
                            "c10d", "--rdzv-endpoint", "localhost:0", *TRAIN, f"output_dir={fs / 'run'}",
                            "save_format=sharded", "distributed.timeout_s=60"], cwd=ROOT,
                           env=_env(GRPO_DIST_EXIT_CODE_DIR=str(codes)), capture_output=True, text=True, timeout=300)
        assert sorted(p.read_text().strip() for p in codes.iterdir()) == ["2", "2"], r.stderr[-3000:]
        lines = [ln for ln in r.stderr.splitlines() if "CheckpointError" in ln]
        assert len(lines) == 1 and "the last good checkpoint is none" in lines[0], r.stderr[-3000:]
        # which writer hits the full disk first varies: Python's own (ENOSPC) or torch.save's stream writer,
        # recognised by the filesystem having no room left
        assert "No space left on device" in lines[0] or " bytes free on its filesystem" in lines[0], lines[0]
        assert not list((fs / "run").glob("*checkpoint-*"))


def test_write_errors_are_told_from_programming_errors(tmp_path):
    """No mount needed: what counts as a failed write. A bug (TypeError, a KeyError) on a disk with room is not
    one and must propagate as itself."""
    import errno

    from grpo_dist.write_errors import WriteFailed, describe_write_failure, writing
    where = tmp_path / "x.pt"
    assert "No space left" in describe_write_failure(OSError(errno.ENOSPC, "No space left on device"), where)
    for text in ["Error while serializing: I/O error: No space left on device (os error 28)",
                 "basic_ios::clear: iostream error", "[enforce fail at inline_container.cc:603] . PytorchStreamWriter "
                 "failed writing file data/0: file write failed"]:
        assert text in describe_write_failure(RuntimeError(text), where), text
    assert describe_write_failure(TypeError("unsupported operand"), where) is None
    assert describe_write_failure(KeyError("model.embed_tokens.weight"), where) is None
    with pytest.raises(WriteFailed, match=r"iostream error \(writing .*x.pt\)"), writing(where):
        raise RuntimeError("basic_ios::clear: iostream error")
    with pytest.raises(TypeError), writing(where):
        raise TypeError("a bug")


def test_a_bug_in_the_save_path_is_not_reported_as_a_full_disk(tmp_path, monkeypatch, one_thread):
    tr = _trainer([f"output_dir={tmp_path / 'run'}", "save_format=full"])
    tr.train_step()

    def bug(*a, **k):
        raise TypeError("a programming error")
    monkeypatch.setattr(tr.engine, "save_engine_state", bug)
    with pytest.raises(TypeError, match="a programming error"):
        tr.save()
