"""Checkpoints: output_dir/checkpoint-<step>/, a Hugging Face model directory plus what an exact resume needs.

Layout of checkpoint-<step>/ (save_format=full, the default below FULL_STATE_MAX_PARAMS parameters):
    config.json, model.safetensors, generation_config.json, tokenizer files   <- AutoModelForCausalLM.from_pretrained
    optimizer.pt          full (FQN-keyed) optimizer state, gathered on rank 0
    trainer_state.json    step, data position (epoch, step in epoch), LR scheduler, world size, the resolved config
    rng_state_<rank>.pt   torch / python / numpy (/ cuda) RNG of every rank
    deepspeed/            (backend=deepspeed) DeepSpeed's own partitioned checkpoint: fp32 masters + optimizer
    manifest.json         size and sha256 of every other file; written last: a checkpoint without it is incomplete

save_format=sharded replaces model.safetensors + optimizer.pt with sharded/, a torch.distributed.checkpoint (DCP)
directory in which every rank writes its own shards of the model and optimizer state: nothing is gathered on one
rank. config.json and the tokenizer are still written, so `python -m grpo_dist.tools.export_checkpoint` can turn it
into an HF safetensors directory.

A checkpoint is written into `.tmp-checkpoint-<step>` and renamed into place only once the manifest is written, so a
crash while saving never leaves a half-written `checkpoint-<step>` and never touches the previous one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from grpo_dist import distributed as gdist
from grpo_dist import faults
from grpo_dist.engines import Engine

MANIFEST = "manifest.json"
LORA_ADAPTER_FILE = "adapter_model.safetensors"
SHARDED_DIR = "sharded"
TMP_PREFIX = ".tmp-checkpoint-"
# save_format=auto writes full-state checkpoints up to this many parameters, sharded (DCP) ones above. A full-state
# save holds the fp32 weights and both AdamW moments (12 bytes per parameter, ~48 GB at 4B) in rank 0's host memory
# and writes them from that one process; beyond this it is slow and the first thing to run out of memory.
FULL_STATE_MAX_PARAMS = 4_000_000_000
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
# Files hashed at once when verifying: hashlib releases the GIL, so threads overlap reading and hashing (one big
# file still takes one core: ~1.5 GB/s of sha256 with SHA-NI).
_HASH_THREADS = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete, corrupted, another model) or cannot be written."""


def resolve_save_format(save_format: str, num_params: int, engine: Engine) -> str:
    """'full' or 'sharded' for save_format full | sharded | auto (by model size; full where the engine has no
    sharded format)."""
    if save_format == "auto":
        return "sharded" if num_params > FULL_STATE_MAX_PARAMS and engine.supports_sharded() else "full"
    return save_format


# ------------------------------------------------------------------------------------------------------ manifest
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


def _describe(ckpt: Path, names: list[str]) -> dict:
    """fsync, size and sha256 of each file (the manifest entries)."""
    out = {}
    for name in names:
        p = ckpt / name
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        out[name] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return out


def _files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest_file(ckpt: Path, files: dict) -> None:
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"files": dict(sorted(files.items()))}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def _write_manifest_collective(ckpt: Path, ctx) -> None:
    """Every rank fsyncs and hashes a share of the files (a sharded checkpoint can be hundreds of GB); rank 0
    writes the manifest."""
    names = gdist.broadcast_object(_files(ckpt) if ctx.is_main else None)
    mine = _describe(ckpt, names[ctx.rank::ctx.world_size])
    parts = gdist.gather_object(mine)
    if ctx.is_main:
        assert parts is not None  # gather_object returns the list on rank 0
        _write_manifest_file(ckpt, {k: v for part in parts for k, v in part.items()})


def verify_checkpoint(ckpt: Path, check_hashes: bool = False) -> str | None:
    """None when complete, else what is wrong. Sizes always; sha256 only with check_hashes (reads every byte,
    files hashed in parallel threads)."""
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
    if check_hashes:
        names = sorted(files, key=lambda n: -files[n]["size"])  # biggest first: the pool finishes together
        with ThreadPoolExecutor(min(_HASH_THREADS, max(1, len(names)))) as pool:
            digests = dict(zip(names, pool.map(lambda n: _sha256(ckpt / n), names)))
        for name in sorted(files):
            if digests[name] != files[name]["sha256"]:
                return f"{name} has the wrong checksum (sha256 differs from manifest.json): the file is corrupted"
    return None


def checkpoint_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------- discovery
def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path, check_hashes: bool = False) -> Path | None:
    """The newest complete checkpoint (partial ones are skipped; with check_hashes also corrupted ones, each named
    in a warning)."""
    for _, p in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(p, check_hashes)
        if problem is None:
            return p
        if check_hashes:
            print(f"[grpo_dist] warning: skipping {p}: {problem}; trying the previous checkpoint", file=sys.stderr,
                  flush=True)
    return None


def resolve_resume_path(value: str | None, output_dir: str, check_hashes: bool = False) -> Path | None:
    """'auto': the newest complete (and, with check_hashes, intact) checkpoint in output_dir, or None (start fresh)
    when there is none. A named checkpoint must exist and be intact (CheckpointError otherwise)."""
    if not value:
        return None
    if value == "auto":
        return latest_checkpoint(output_dir, check_hashes)
    p = Path(value)
    if not p.exists():
        raise CheckpointError(f"config key 'resume_from_checkpoint' = {value}: no such directory")
    problem = verify_checkpoint(p, check_hashes) if p.is_dir() else "not a directory"
    if problem:
        raise CheckpointError(f"config key 'resume_from_checkpoint' = {value}: {problem}")
    return p


def resolve_and_verify(value: str | None, output_dir: str, check_hashes: bool) -> tuple[Path | None, str]:
    """resolve_resume_path plus a note of what the verification cost (for the log)."""
    t0 = time.perf_counter()
    path = resolve_resume_path(value, output_dir, check_hashes)
    if path is None or not check_hashes:
        return path, ""
    mb = checkpoint_bytes(path) / 1e6
    dt = time.perf_counter() - t0
    return path, f"sha256 of {mb:.1f} MB verified in {dt:.2f} s ({mb / max(dt, 1e-9):.0f} MB/s)"


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "head_dim", "tie_word_embeddings")


def check_model_shape(path: Path, hf_config) -> None:
    """CheckpointError naming the first architecture setting in which the checkpoint's config.json differs from
    the model built from this run's config (loading it would fail deep in a state-dict load, or worse, half-work)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return
    saved, now = json.loads(f.read_text()), hf_config.to_dict()
    for key in _SHAPE_KEYS:
        if key in saved and key in now and saved[key] != now[key]:
            raise CheckpointError(f"config key 'resume_from_checkpoint' = {path}: the checkpoint is of another model "
                                  f"({key} = {saved[key]} there, {now[key]} in this run's model section)")


def read_trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / "trainer_state.json").read_text())


# --------------------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------- HF weights
def write_hf_weights(out: Path, specs: dict, read, tie_word_embeddings: bool = False,
                     max_shard_size: int = 5 * 10**9) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index, as from_pretrained expects them.
    specs: name -> (shape, dtype) in file order; read(names) -> {name: tensor} (called once per file, so at most
    one file's tensors need to be in memory). Written directly rather than through save_pretrained, whose
    unwrap_model imports deepspeed (seconds) when it is installed, on the first save of every run."""
    from safetensors.torch import save_file
    if tie_word_embeddings:
        specs = {k: v for k, v in specs.items() if k != "lm_head.weight"}  # from_pretrained re-ties it
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n, weight_map, total = len(groups), {}, 0
    for i, names in enumerate(groups, 1):
        fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {k: v.contiguous() for k, v in read(names).items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o666 & ~_umask())  # safetensors creates it 0600: colleagues could not read it
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map.update({k: fname for k in names})
        del tensors
    if n > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def tied_aliases(model) -> dict[str, str]:
    """{second name: first name} of parameters registered under more than one name (tied embeddings: lm_head.weight
    -> model.embed_tokens.weight). A saved HF directory stores such a tensor once, under its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _save_hf_config(hf_model, out: Path) -> None:
    hf_model.config.save_pretrained(out)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(out)


# --------------------------------------------------------------------------------------------------- save, load
def save_checkpoint(output_dir: str, step: int, engine: Engine, hf_model, tokenizer, trainer_state: dict, ctx,
                    save_total_limit: int | None = None, keep: Path | None = None,
                    save_format: str = "full", lora_cfg=None, base_name: str | None = None) -> Path:
    """Collective: every rank calls it. full: rank 0 writes the gathered model and optimizer; sharded: every rank
    writes its shards. Rank 0 writes the trainer state, every rank its RNG; then manifest, rename, prune.
    A write error on any rank (a full disk) raises CheckpointError on every rank, naming the last good checkpoint;
    the partial copy is removed and the previous checkpoints are untouched."""
    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"{TMP_PREFIX}{step}"
    error = None
    if ctx.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for stale in out.glob(TMP_PREFIX + "*"):  # left by a crash during an earlier save; never complete
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = _write_error(e, ctx.rank)
    _agree_on_write(error, tmp, out, step, ctx)
    if save_format == "sharded":
        engine.save_sharded(tmp / SHARDED_DIR)
        model_sd = optim_sd = None
    else:
        model_sd, optim_sd = engine.gather_full_state()
    try:
        _write_main_files(tmp, save_format, hf_model, ctx, model_sd, optim_sd, lora_cfg, base_name,
                          tokenizer)
    except OSError as e:
        error = _write_error(e, ctx.rank)
    del model_sd, optim_sd
    # backend-specific state for an exact resume (DeepSpeed: deepspeed/); collective: every rank, whatever happened
    engine.save_engine_state(tmp)
    try:
        torch.save(rng_state(), tmp / f"rng_state_{ctx.rank}.pt")
        if ctx.is_main:
            tokenizer.save_pretrained(tmp)
            (tmp / "trainer_state.json").write_text(
                json.dumps(dict(trainer_state, save_format=save_format), indent=1, default=str))
    except OSError as e:
        error = error or _write_error(e, ctx.rank)
    faults.inject("kill_save", step, ctx.rank)
    _agree_on_write(error, tmp, out, step, ctx)  # every rank's files are written
    _write_manifest_collective(tmp, ctx)
    if ctx.is_main:
        if final.exists():  # a stale copy of this very step (re-run after a crash): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(out)
        if save_total_limit:
            prune_checkpoints(out, save_total_limit, keep)
    gdist.barrier()
    return final


def _write_main_files(tmp: Path, save_format: str, hf_model, ctx, model_sd, optim_sd, lora_cfg=None,
                      base_name=None, tokenizer=None) -> None:
    """Rank 0's HF files (config.json, and for save_format=full the weights, or the LoRA adapter) and the gathered
    optimizer state."""
    if not ctx.is_main:
        return
    _save_hf_config(hf_model, tmp)  # what from_pretrained / an export needs besides the weights
    if save_format != "sharded" and lora_cfg is not None:
        _save_lora(tmp, model_sd, lora_cfg, base_name, hf_model, tokenizer)
        torch.save(optim_sd, tmp / "optimizer.pt")
    elif save_format != "sharded":
        write_hf_weights(tmp, {k: (v.shape, v.dtype) for k, v in model_sd.items()},
                         lambda names: {k: model_sd[k] for k in names},
                         getattr(hf_model.config, "tie_word_embeddings", False))
        torch.save(optim_sd, tmp / "optimizer.pt")


def _write_error(e: OSError, rank: int) -> str:
    return f"rank {rank}: {e.strerror or e} ({e.filename or 'while writing'})"


def _agree_on_write(error: str | None, tmp: Path, out: Path, step: int, ctx) -> None:
    """Barrier that also shares write errors: every rank raises the first one (rank 0 removes the partial copy)."""
    errors = gdist.gather_object(error) or []  # rank 0 gets the list; the others None
    first = gdist.broadcast_object(next((e for e in errors if e), None) if ctx.is_main else None)
    if first is None:
        return
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    last = latest_checkpoint(out)
    raise CheckpointError(f"writing checkpoint-{step} in {out} failed: {first}; the last good checkpoint is "
                          f"{last if last else 'none (no complete checkpoint in output_dir)'}")


def _save_lora(out: Path, model_sd: dict, lora_cfg, base_name, hf_model, tokenizer) -> None:
    """LoRA: the adapter in peft's format (the base weights are the model's own, never changed), and with
    lora.save_merged an HF directory merged/ of the base model with the adapter merged in."""
    from grpo_dist import lora
    lora.save_adapter(out, model_sd, lora_cfg, base_name)
    if lora_cfg.save_merged:
        merged = lora.merged(model_sd, lora.scaling(lora_cfg))
        (out / "merged").mkdir()
        _save_hf_config(hf_model, out / "merged")
        tie = getattr(hf_model.config, "tie_word_embeddings", False)
        if tie and lora.adapted_tied_weights(hf_model):  # an adapted tied head: merged, it has weights of its own
            tie = False
            path = out / "merged" / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "tie_word_embeddings": False}, indent=2))
        write_hf_weights(out / "merged", {k: (v.shape, v.dtype) for k, v in merged.items()},
                         lambda names: {k: merged[k] for k in names}, tie)
        tokenizer.save_pretrained(out / "merged")


def prune_checkpoints(output_dir: Path, limit: int, keep: Path | None = None) -> None:
    """Keep the newest `limit` complete checkpoints (and `keep`, the one a run resumed from)."""
    complete = [p for _, p in list_checkpoints(output_dir) if verify_checkpoint(p) is None]
    for p in complete[:-limit]:
        if keep is not None and p.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, engine: Engine, ctx, hf_model=None, tied: dict[str, list[str]] | None = None) -> dict:
    """Collective: loads model + optimizer into the engine, the LR schedule, and this rank's RNG (when the world
    size is unchanged). Returns the trainer state, with `rng_restored` set. The entries a full-state file stores
    only once (tied embeddings) are named by `tied` ({name: [its other names]}, read from the unwrapped model), or
    found from hf_model, a plain copy of the model."""
    path = Path(path)
    state = read_trainer_state(path)
    if (path / SHARDED_DIR).is_dir():
        if not engine.supports_sharded():
            raise ValueError(f"{path} is a sharded (DCP) checkpoint, which this distributed.backend cannot load; "
                             f"export it with `python -m grpo_dist.tools.export_checkpoint {path} OUT_DIR` and start "
                             f"from model.name_or_path=OUT_DIR (the optimizer state is then fresh)")
        engine.load_sharded(path / SHARDED_DIR)  # DCP reshards to this world size
    else:
        from safetensors.torch import load_file
        model_sd = optim_sd = None
        adapter = path / LORA_ADAPTER_FILE
        if adapter.is_file():  # LoRA: the base weights as built at start, the adapter from the checkpoint
            model_sd, _ = engine.gather_full_state()
        if ctx.is_main:
            if model_sd is not None:  # LoRA (adapter file present)
                from grpo_dist.lora import adapter_to_model_names
                model_sd.update(adapter_to_model_names(load_file(str(adapter))))
            else:
                model_sd = {}
                for f in sorted(path.glob("*.safetensors")):
                    model_sd.update(load_file(str(f)))
                aliases = {a: n for n, others in tied.items() for a in others} if tied is not None else \
                    tied_aliases(hf_model) if hf_model is not None else {}
                for alias, source in aliases.items():
                    if alias not in model_sd and source in model_sd:  # the engines' strict loads want both names
                        model_sd[alias] = model_sd[source]
            optim_sd = torch.load(path / "optimizer.pt", weights_only=False)
        engine.load_full_state(model_sd, optim_sd)
        del model_sd, optim_sd
    engine.load_engine_state(path)
    engine.load_scheduler_state(state["scheduler"])
    rng_file = path / f"rng_state_{ctx.rank}.pt"
    state["rng_restored"] = state.get("world_size") == ctx.world_size and rng_file.is_file()
    if state["rng_restored"]:
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
