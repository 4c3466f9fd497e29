"""Checkpoints: output_dir/checkpoint-<step>/ as a Hugging Face model directory plus what exact resume needs.

Layout of checkpoint-<step>/:
    config.json, model.safetensors, generation_config.json, tokenizer files   <- AutoModelForCausalLM.from_pretrained
    optimizer.pt          full (FQN-keyed) optimizer state, from FSDP.optim_state_dict
    trainer_state.json    step, data position, LR scheduler, world size, the resolved config
    rng_state_<rank>.pt   torch / python / numpy RNG of every rank
    deepspeed/            (backend=deepspeed) DeepSpeed's own partitioned checkpoint: fp32 masters + optimizer
    manifest.json         file sizes and sha256; written last: a checkpoint without it is incomplete

A checkpoint is written into `.tmp-checkpoint-<step>` and renamed into place only once complete, so a crash while
saving never leaves a half-written `checkpoint-<step>` and never touches the previous one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from grpo_dist import distributed as gdist

MANIFEST = "manifest.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path) -> None:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[str(p.relative_to(ckpt))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, ckpt / MANIFEST)


def verify_checkpoint(ckpt: Path, check_hashes: bool = False) -> str | None:
    """None when complete, else what is wrong."""
    m = ckpt / MANIFEST
    if not m.is_file():
        return "no manifest.json (incomplete save)"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest: {e}"
    for name, info in files.items():
        p = ckpt / name
        if not p.is_file() or p.stat().st_size != info["size"]:
            return f"{name} is missing or has the wrong size"
        if check_hashes and _sha256(p) != info["sha256"]:
            return f"{name} has the wrong checksum"
    return None


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (partial ones are skipped)."""
    for _, p in reversed(list_checkpoints(output_dir)):
        if verify_checkpoint(p) is None:
            return p
    return None


def resolve_resume_path(value: str | None, output_dir: str) -> Path | None:
    if not value:
        return None
    if value == "auto":
        return latest_checkpoint(output_dir)
    p = Path(value)
    problem = verify_checkpoint(p) if p.is_dir() else "not a directory"
    if problem:
        raise FileNotFoundError(f"resume_from_checkpoint={value}: {problem}")
    return p


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str, step: int, engine, hf_model, tokenizer, trainer_state: dict, ctx,
                    save_total_limit: int | None = None, keep: Path | None = None) -> Path:
    """Collective: every rank calls it. Rank 0 writes the model, optimizer and trainer state; each rank its RNG."""
    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f".tmp-checkpoint-{step}"
    model_sd, optim_sd = engine.gather_full_state()
    if ctx.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    gdist.barrier()
    if hasattr(engine, "save_engine_state"):  # backend-specific state for exact resume (DeepSpeed: deepspeed/)
        engine.save_engine_state(tmp)
    torch.save(rng_state(), tmp / f"rng_state_{ctx.rank}.pt")
    if ctx.is_main:
        hf_model.save_pretrained(tmp, state_dict=model_sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(optim_sd, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=str))
    gdist.barrier()  # all RNG files are written
    if ctx.is_main:
        write_manifest(tmp)
        if final.exists():  # a stale copy of this very step (re-run after a crash): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(out)
        if save_total_limit:
            prune_checkpoints(out, save_total_limit, keep)
    gdist.barrier()
    return final


def prune_checkpoints(output_dir: Path, limit: int, keep: Path | None = None) -> None:
    """Keep the newest `limit` complete checkpoints (and `keep`, the one a run resumed from)."""
    complete = [p for _, p in list_checkpoints(output_dir) if verify_checkpoint(p) is None]
    for p in complete[:-limit]:
        if keep is not None and p.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, engine, ctx) -> dict:
    """Collective: loads model + optimizer into the engine (rank 0 reads, the others receive), restores this rank's
    RNG, and returns the trainer state."""
    from safetensors.torch import load_file

    state = json.loads((path / "trainer_state.json").read_text())
    saved_world = state.get("world_size")
    model_sd = optim_sd = None
    if ctx.is_main:
        files = sorted(path.glob("*.safetensors"))
        model_sd = {}
        for f in files:
            model_sd.update(load_file(str(f)))
        optim_sd = torch.load(path / "optimizer.pt", weights_only=False)
    engine.load_full_state(model_sd, optim_sd)
    if hasattr(engine, "load_engine_state"):
        engine.load_engine_state(path)
    engine.load_scheduler_state(state["scheduler"])
    rng_file = path / f"rng_state_{ctx.rank}.pt"
    if saved_world == ctx.world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
