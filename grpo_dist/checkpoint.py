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
crash while saving never leaves a half-written `checkpoint-<step>` and never touches the previous one. A write that
fails (a full disk, on any rank) stops every rank with CheckpointError naming the last good checkpoint.

What counts as intact is manifest.py's: the manifest lists exactly the files on disk, and every file the format
needs. A damaged checkpoint is never resumed from, counted by pruning, deleted or overwritten: auto-resume,
pruning and a save of the same step move it to output_dir/damaged/ (one line each). When auto-resume finds
checkpoints but none intact, the run stops unless start_over_if_no_intact_checkpoint is set.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_dist import distributed as gdist
from grpo_dist import faults, manifest
from grpo_dist.engines import Engine
from grpo_dist.manifest import LORA_ADAPTER_FILE, LORA_CONFIG_FILE, MANIFEST, SHARDED_DIR
from grpo_dist.write_errors import describe_write_failure, writing

TMP_PREFIX = ".tmp-checkpoint-"
DAMAGED_DIR = "damaged"  # output_dir/damaged/: checkpoints found damaged, moved aside (never deleted by a run)
START_OVER_KEY = "start_over_if_no_intact_checkpoint"
# save_format=auto writes full-state checkpoints up to this many parameters, sharded (DCP) ones above. A full-state
# save holds the fp32 weights and both AdamW moments (12 bytes per parameter, ~48 GB at 4B) in rank 0's host memory
# and writes them from that one process; beyond this it is slow and the first thing to run out of memory.
FULL_STATE_MAX_PARAMS = 4_000_000_000
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete, corrupted, another model) or cannot be written."""


def resolve_save_format(save_format: str, num_params: int, engine: Engine) -> str:
    """'full' or 'sharded' for save_format full | sharded | auto (by model size; full where the engine has no
    sharded format)."""
    if save_format == "auto":
        return "sharded" if num_params > FULL_STATE_MAX_PARAMS and engine.supports_sharded() else "full"
    return save_format


# ------------------------------------------------------------------------------------------------------ manifest
_sha256 = manifest.sha256_file  # bench/verify.py


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


def _write_manifest_file(ckpt: Path, files: dict) -> None:
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"files": dict(sorted(files.items()))}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def _write_manifest_collective(ckpt: Path, ctx) -> str | None:
    """Every rank fsyncs and hashes a share of the files (a sharded checkpoint can be hundreds of GB); rank 0
    writes the manifest. Returns this rank's write error (None when it went well)."""
    names = gdist.broadcast_object(manifest.files_on_disk(ckpt) if ctx.is_main else None)
    mine: dict = {}
    error = _attempt(ckpt, ctx.rank, lambda: mine.update(_describe(ckpt, names[ctx.rank::ctx.world_size])))
    parts = gdist.gather_object(mine)
    if ctx.is_main and error is None:
        assert parts is not None  # gather_object returns the list on rank 0
        error = _attempt(ckpt / MANIFEST, ctx.rank, _write_manifest_file, ckpt,
                         {k: v for part in parts for k, v in part.items()})
    return error


def verify_checkpoint(ckpt: Path, check_hashes: bool = False) -> str | None:
    """None when intact, else what is wrong (manifest.verify: manifest, required files, sizes, with check_hashes
    sha256)."""
    return manifest.verify(Path(ckpt), check_hashes)


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
    """The newest intact checkpoint (damaged ones are passed over; nothing is printed or moved)."""
    for _, p in reversed(list_checkpoints(output_dir)):
        if verify_checkpoint(p, check_hashes) is None:
            return p
    return None


def move_aside(ckpt: Path, problem: str) -> Path:
    """Move a damaged checkpoint into output_dir/damaged/ (no run resumes from, prunes or overwrites it there) and
    say so in one line. CheckpointError if it cannot be moved: the run must not go on deleting around it."""
    dest_dir = ckpt.parent / DAMAGED_DIR
    dest = dest_dir / ckpt.name
    n = 1
    while dest.exists():  # an earlier run moved a checkpoint of this step already: keep both
        n += 1
        dest = dest_dir / f"{ckpt.name}.{n}"
    try:
        dest_dir.mkdir(exist_ok=True)
        os.replace(ckpt, dest)
    except OSError as e:
        raise CheckpointError(f"{ckpt} is damaged ({problem}) and could not be moved to {dest}: {e.strerror}; "
                              f"move or delete it by hand") from None
    print(f"[grpo_dist] warning: {ckpt}: {problem}; moved it to {dest} (kept; runs never resume from, prune or "
          f"overwrite it there)", file=sys.stderr, flush=True)
    return dest


def resolve_auto(output_dir: str, check_hashes: bool, start_over: bool) -> Path | None:
    """resume_from_checkpoint=auto: the newest intact checkpoint in output_dir, or None (start at step 0) when
    there is none at all. Damaged ones newer than it are moved aside, each named. When there are checkpoints but
    none is intact: CheckpointError naming each (nothing moved), unless start_over (then all are moved aside)."""
    damaged, chosen = [], None
    for _, p in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(p, check_hashes)
        if problem is None:
            chosen = p
            break
        damaged.append((p, problem))
    if damaged and chosen is None and not start_over:
        listing = "; ".join(f"{p.name}: {problem}" for p, problem in damaged)
        raise CheckpointError(f"config key 'resume_from_checkpoint' = auto: no intact checkpoint in {output_dir} "
                              f"({listing}); nothing was changed. To start over from step 0 instead, set "
                              f"{START_OVER_KEY}=true (the damaged checkpoints are then moved to "
                              f"{Path(output_dir) / DAMAGED_DIR}, not deleted)")
    for p, problem in damaged:
        move_aside(p, problem)
    if damaged and chosen is not None:
        print(f"[grpo_dist] warning: auto-resume: the newest checkpoint {damaged[0][0]} is damaged; resuming from "
              f"the older {chosen}", file=sys.stderr, flush=True)
    elif damaged:
        print(f"[grpo_dist] warning: auto-resume: no intact checkpoint in {output_dir}; {START_OVER_KEY}=true: "
              f"starting over from step 0", file=sys.stderr, flush=True)
    return chosen


def resolve_resume_path(value: str | None, output_dir: str, check_hashes: bool = False,
                        start_over: bool = False) -> Path | None:
    """'auto': resolve_auto. A named checkpoint must exist and be intact (CheckpointError otherwise; it is the
    user's to fix, so it is never moved)."""
    if not value:
        return None
    if value == "auto":
        return resolve_auto(output_dir, check_hashes, start_over)
    p = Path(value)
    if not p.exists():
        raise CheckpointError(f"config key 'resume_from_checkpoint' = {value}: no such directory")
    problem = verify_checkpoint(p, check_hashes) if p.is_dir() else "not a directory"
    if problem:
        raise CheckpointError(f"config key 'resume_from_checkpoint' = {value}: {problem}")
    return p


def resolve_and_verify(value: str | None, output_dir: str, check_hashes: bool,
                       start_over: bool = False) -> tuple[Path | None, str]:
    """resolve_resume_path plus a note of what the verification cost (for the log)."""
    t0 = time.perf_counter()
    path = resolve_resume_path(value, output_dir, check_hashes, start_over)
    if path is None or not check_hashes:
        return path, ""
    mb = checkpoint_bytes(path) / 1e6
    dt = time.perf_counter() - t0
    return path, f"sha256 of {mb:.1f} MB verified in {dt:.2f} s ({mb / max(dt, 1e-9):.0f} MB/s)"


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "head_dim", "tie_word_embeddings")


def check_model_shape(path: Path, hf_config, lora_cfg=None) -> None:
    """CheckpointError naming the first setting in which the checkpoint differs from the model this run builds:
    an architecture setting of its config.json, or its kind (a LoRA adapter, or full weights) and the adapter's
    r, alpha and target modules. Loading it would fail deep in a state-dict load, or worse, half-work."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return
    try:
        saved, now = json.loads(f.read_text()), hf_config.to_dict()
        for key in _SHAPE_KEYS:
            if key in saved and key in now and saved[key] != now[key]:
                _other_model(path, f"{key} = {saved[key]} there, {now[key]} in this run's model section")
        difference = _adapter_difference(Path(path), lora_cfg)
    except (ValueError, TypeError, AttributeError) as e:  # CheckpointError is a ValueError: raised as it is
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config key 'resume_from_checkpoint' = {path}: config.json or adapter_config.json "
                              f"is unreadable: {e}") from None
    if difference:
        _other_model(path, difference)


def _other_model(path, what: str):
    raise CheckpointError(f"config key 'resume_from_checkpoint' = {path}: the checkpoint is of another model "
                          f"({what})")


def _adapter_difference(path: Path, lora_cfg) -> str | None:
    """How the checkpoint's LoRA adapter (adapter_config.json), or its lack of one, differs from this run's lora
    section; None when they match."""
    run_r = lora_cfg.r if lora_cfg is not None else 0
    f = path / LORA_CONFIG_FILE
    if not f.is_file():
        return None if not run_r else f"full model weights there, a LoRA adapter (lora.r = {run_r}) in this run; " \
                                      f"set lora.r=0 to resume it"
    saved = json.loads(f.read_text())
    if not run_r:
        return f"a LoRA adapter (r = {saved.get('r')}) there, full fine-tuning (lora.r = 0) in this run; set " \
               f"lora.r={saved.get('r')} to resume it"
    pairs = [("lora.r", saved.get("r"), run_r), ("lora.alpha", saved.get("lora_alpha"), lora_cfg.alpha),
             ("lora.target_modules", sorted(saved.get("target_modules") or []), sorted(lora_cfg.target_modules))]
    for key, there, here in pairs:
        if there != here:
            return f"{key} = {there} there, {here} in this run"
    return None


def rollout_mode_change(saved_config: dict, rollout_ranks: int, trainers: int, name: str) -> str | None:
    """The line a resume prints when it changes how rollouts are made (async_rollout.py): a checkpoint of an
    asynchronous run (rollout_ranks > 0) resumed without rollout ranks goes on colocated, or the other way round.
    Both resume (the checkpoint is the trainers' state; batches in flight are sampled again), but the run is not
    the one that wrote it: say so rather than switch silently. trainers: this run's training ranks."""
    before = int(saved_config.get("rollout_ranks") or 0)
    if bool(before) == bool(rollout_ranks):
        return None
    if before:
        k = saved_config.get("max_staleness", 0)
        return (f"[grpo_dist] resume: {name} was written by an asynchronous run (rollout_ranks={before}, "
                f"max_staleness={k}); this run has no rollout ranks, so it goes on colocated: each of its "
                f"{trainers} rank(s) samples its own batch with the current policy (set rollout_ranks={before} to "
                f"go on asynchronously)")
    return (f"[grpo_dist] resume: {name} was written by a colocated run; this run goes on asynchronously "
            f"(rollout_ranks={rollout_ranks}): {trainers} rank(s) train, the rollout ranks sample")


def read_trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / "trainer_state.json").read_text())


# --------------------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def seed_everything(seed: int) -> None:
    """python, numpy and torch RNG from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
        with writing(out / fname):
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
@dataclass(frozen=True)
class Target:
    """What every save of a run has in common: where it goes, the engine and model it reads, the format, and the
    keeping rules. save_format: full or sharded (resolve_save_format); lora_cfg: the adapter's settings when the
    run trains a LoRA adapter (the checkpoint holds the adapter only); base_name: the base model's name for the
    adapter's config; check_hashes: pruning verifies the checkpoints it keeps by sha256."""
    output_dir: str | Path
    engine: Engine
    hf_model: Any
    tokenizer: Any
    ctx: Any
    save_format: str = "full"
    save_total_limit: int | None = None
    lora_cfg: Any = None
    base_name: str | None = None
    check_hashes: bool = False


def save_checkpoint(target: Target, step: int, trainer_state: dict, rng: dict | None = None, keep: Path | None = None,
                    name: str | None = None, extra_files: dict[str, str] | None = None, background=None) -> Path:
    """Collective: every rank calls it. full: rank 0 writes the gathered model and optimizer; sharded: every rank
    writes its shards. Rank 0 writes the trainer state, every rank its RNG (rng: this rank's, rng_state() by
    default); then manifest, rename, prune (never `keep`, the checkpoint the run resumed from).
    A write error on any rank (a full disk: write_errors.py) raises CheckpointError on every rank, naming the last
    good checkpoint; the partial copy is removed and the previous checkpoints are untouched.
    name: write output_dir/<name>/ instead of checkpoint-<step> (the best checkpoint: swapped in for the previous
    one, never pruned); extra_files: {file name: text} rank 0 writes into it too (listed in the manifest).
    background: an async_save.BackgroundSaver: first wait for its save in flight (raising its error), then copy the
    state here and leave the writing, manifest and rename to its thread (engines without supports_async_save:
    written here, after the wait). Returns the checkpoint's final path (in place once the save is done)."""
    out, ctx = Path(target.output_dir), target.ctx
    final = out / (name or f"checkpoint-{step}")
    tmp = out / f"{TMP_PREFIX}{name or step}"
    if background is not None:
        background.wait()  # one save at a time; the previous one's error is raised here if nothing raised it yet
        if not target.engine.supports_async_save:
            background = None
    started = time.perf_counter()  # this save's own time (time_save_s) starts after that wait
    error = _attempt(tmp, ctx.rank, _make_tmp, out, tmp) if ctx.is_main else None
    _agree_on_write(error, tmp, out, final.name, ctx)
    snap = _Snapshot(target, trainer_state, rng_state() if rng is None else rng, staged=background is not None)
    job = _SaveJob(target, step, final, tmp, keep, name, extra_files or {}, snap)
    if background is None:
        job.run()
    else:
        background.start(job.run, final, started)
    return final


def _owned_copy(obj, engine: Engine):
    """obj with every tensor that shares memory with the engine's live parameters, buffers or optimizer state (a
    one-process engine's state dicts are its live tensors) copied into host memory of its own: the training thread
    changes those while the copy is written. The tensors FSDP gathered into host memory are copies already."""
    live = {_storage_ptr(t) for t in _live_tensors(engine)} - {None}

    def own(t: torch.Tensor) -> torch.Tensor:
        ptr = _storage_ptr(t)
        shared = t.device.type != "cpu" or ptr is None or ptr in live
        return t.detach().to("cpu", copy=True) if shared else t
    return torch.utils._pytree.tree_map_only(torch.Tensor, own, obj)


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where t's memory starts (a DTensor's: its local shard's); None where it has no storage of its own."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.to_local()
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass without storage, or one FSDP freed
        return None


def _live_tensors(engine: Engine):
    module, optimizer = getattr(engine, "module", None), getattr(engine, "optimizer", None)
    if isinstance(module, torch.nn.Module):
        yield from module.parameters()
        yield from module.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


class _Snapshot:
    """What a checkpoint holds, taken on the training thread (collective: the engine's gathers): the full state
    (rank 0) or this rank's sharded state (staged: copies in host memory), this rank's RNG, the trainer state."""

    def __init__(self, target: Target, trainer_state: dict, rng: dict, staged: bool):
        engine = target.engine
        self.model_sd = self.optim_sd = self.sharded = None
        if target.save_format == "sharded":
            self.sharded = engine.sharded_state_to_save(staged)
        else:
            self.model_sd, self.optim_sd = engine.gather_full_state()
            if staged and target.ctx.is_main:
                self.model_sd, self.optim_sd = _owned_copy((self.model_sd, self.optim_sd), engine)
        self.rng = rng
        self.state_text = json.dumps(dict(trainer_state, save_format=target.save_format), indent=1, default=str)


class _SaveJob:
    """The writing part of a save: files, manifest, rename, prune. Runs on the training thread, or on the saver's
    (async_save.py) with its collectives in the saver's own group: the same steps in the same order either way."""

    def __init__(self, target: Target, step: int, final: Path, tmp: Path, keep: Path | None, name: str | None,
                 extra_files: dict[str, str], snap: _Snapshot):
        self.target, self.step, self.final, self.tmp, self.keep = target, step, final, tmp, keep
        self.name, self.extra_files, self.snap = name, extra_files, snap

    def run(self) -> None:
        t, final, tmp, snap, label = self.target, self.final, self.tmp, self.snap, self.final.name
        out, ctx, engine = Path(t.output_dir), t.ctx, t.engine
        error = None
        if snap.sharded is not None:  # collective: DCP raises its CheckpointException on every rank alike
            error = _attempt(tmp / SHARDED_DIR, ctx.rank, engine.write_sharded, snap.sharded, tmp / SHARDED_DIR)
        if error is None:
            error = _attempt(tmp, ctx.rank, _write_main_files, tmp, t, snap.model_sd, snap.optim_sd)
        snap.model_sd = snap.optim_sd = snap.sharded = None  # the memory goes back as soon as it is written
        # backend-specific state for an exact resume (DeepSpeed: deepspeed/); collective: every rank, whatever happened
        error = _attempt(tmp, ctx.rank, engine.save_engine_state, tmp) or error
        if error is None:
            error = _attempt(tmp, ctx.rank, _write_rank_files, tmp, ctx, t.tokenizer, snap)
        if error is None and ctx.is_main and self.extra_files:
            error = _attempt(tmp, ctx.rank, _write_texts, tmp, self.extra_files)
        faults.inject("kill_save", self.step, ctx.rank)
        _agree_on_write(error, tmp, out, label, ctx)  # every rank's files are written
        _agree_on_write(_write_manifest_collective(tmp, ctx), tmp, out, label, ctx)
        if not ctx.is_main:
            error = None
        elif self.name:
            error = _attempt(final, ctx.rank, _swap_in, tmp, final)
        else:
            error = _attempt(final, ctx.rank, _publish, tmp, final, t.save_total_limit, self.keep, t.check_hashes)
        _agree_on_write(error, tmp, out, label, ctx)  # also the barrier: the checkpoint is in place for every rank


def _write_texts(folder: Path, files: dict[str, str]) -> None:
    for fname, text in files.items():
        with writing(folder / fname):
            (folder / fname).write_text(text)


def _make_tmp(out: Path, tmp: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(TMP_PREFIX + "*"):  # left by a crash during an earlier save; never complete
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def _write_rank_files(tmp: Path, ctx, tokenizer, snap: _Snapshot) -> None:
    """Every rank its RNG state; rank 0 the tokenizer and trainer_state.json (both as the snapshot took them)."""
    with writing(tmp / f"rng_state_{ctx.rank}.pt"):
        torch.save(snap.rng, tmp / f"rng_state_{ctx.rank}.pt")
    if ctx.is_main:
        tokenizer.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(snap.state_text)


def _publish(tmp: Path, final: Path, save_total_limit: int | None, keep: Path | None, check_hashes: bool) -> None:
    """Rank 0: rename the finished checkpoint into place, remember it as intact, prune."""
    if final.exists():
        # A copy of this very step: left by a run that crashed after writing it and resumed from an older one, or
        # that a run named an older checkpoint to resume from. Replaced when intact; a damaged one is evidence and
        # is kept, moved aside.
        problem = verify_checkpoint(final, check_hashes)
        if problem:
            move_aside(final, problem)
        else:
            shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    manifest.remember_intact(final)
    if save_total_limit:
        prune_checkpoints(final.parent, save_total_limit, keep, check_hashes)


def _attempt(where: Path, rank: int, write, *args) -> str | None:
    """Run write(*args); None when it worked, else the one-line reason of a failed write ("rank R: ..."). Any other
    exception is a bug and propagates."""
    try:
        write(*args)
        return None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; the rest re-raised
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, CheckpointError):  # a damaged checkpoint that could not be moved aside: agreed on too
            return f"rank {rank}: {e}"
        reason = describe_write_failure(e, where)
        if reason is None:
            raise
        return f"rank {rank}: {reason}"


def _write_main_files(tmp: Path, target: Target, model_sd, optim_sd) -> None:
    """Rank 0's HF files (config.json, and for save_format=full the weights, or the LoRA adapter) and the gathered
    optimizer state."""
    if not target.ctx.is_main:
        return
    hf_model = target.hf_model
    _save_hf_config(hf_model, tmp)  # what from_pretrained / an export needs besides the weights
    if target.save_format != "sharded" and target.lora_cfg is not None:
        _save_lora(tmp, model_sd, target.lora_cfg, target.base_name, hf_model, target.tokenizer)
        _save_optimizer(optim_sd, tmp)
    elif target.save_format != "sharded":
        write_hf_weights(tmp, {k: (v.shape, v.dtype) for k, v in model_sd.items()},
                         lambda names: {k: model_sd[k] for k in names},
                         getattr(hf_model.config, "tie_word_embeddings", False))
        _save_optimizer(optim_sd, tmp)


def _save_optimizer(optim_sd: dict, tmp: Path) -> None:
    with writing(tmp / "optimizer.pt"):
        torch.save(optim_sd, tmp / "optimizer.pt")


def _agree_on_write(error: str | None, tmp: Path, out: Path, label: str, ctx) -> None:
    """Barrier that also shares write errors: every rank raises the first one (rank 0 removes the partial copy and
    names the last good checkpoint)."""
    errors = gdist.gather_object(error) or []  # rank 0 gets the list; the others None
    first = gdist.broadcast_object(next((e for e in errors if e), None) if ctx.is_main else None)
    if first is None:
        return
    last = None
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(out)  # remembered verdicts: the checkpoints already hashed are not read again
    last = gdist.broadcast_object(str(last) if last else None)
    raise CheckpointError(f"writing {label} in {out} failed: {first}; the partial copy was removed; the "
                          f"last good checkpoint is {last or 'none (no intact checkpoint in output_dir)'}")


def _save_lora(out: Path, model_sd: dict, lora_cfg, base_name, hf_model, tokenizer) -> None:
    """LoRA: the adapter in peft's format (the base weights are the model's own, never changed), and with
    lora.save_merged an HF directory merged/ of the base model with the adapter merged in."""
    from grpo_dist import lora
    with writing(out / LORA_ADAPTER_FILE):
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


def prune_checkpoints(output_dir: Path, limit: int, keep: Path | None = None, check_hashes: bool = False) -> None:
    """Keep the newest `limit` intact checkpoints (and `keep`, the one a run resumed from); delete the older intact
    ones. Only intact checkpoints count: a damaged one is moved aside, never kept as "the newest" nor deleted.
    The ones kept are verified as resume would (sha256 with check_hashes; each checkpoint once per process); the
    ones about to be deleted by sizes and manifest only, as reading them all would cost more than they are worth."""
    kept = 0
    keep_path = Path(keep).resolve() if keep is not None else None
    for _, p in reversed(list_checkpoints(output_dir)):
        is_keep = p.resolve() == keep_path
        problem = verify_checkpoint(p, check_hashes and (kept < limit or is_keep))
        if problem:
            move_aside(p, problem)
        elif kept < limit:
            kept += 1
        elif not is_keep:
            shutil.rmtree(p, ignore_errors=True)


def _rank0_reads(ctx, read):
    """Collective: read() on rank 0, its result (or its failure, raised as CheckpointError) on every rank."""
    result, error = None, None
    if ctx.is_main:
        try:
            result = read()
        except (OSError, ValueError) as e:  # a missing or unreadable trainer_state.json (JSONDecodeError too)
            error = f"{type(e).__name__}: {e}"
    result, error = gdist.broadcast_object((result, error))
    if error:
        raise CheckpointError(f"reading the checkpoint failed on rank 0: {error}")
    return result


def load_checkpoint(path: Path, engine: Engine, ctx, hf_model=None, tied: dict[str, list[str]] | None = None) -> dict:
    """Collective: loads model + optimizer into the engine (load_weights), the LR schedule, and this rank's RNG
    (when the world size is unchanged). Returns the trainer state, with `rng_restored` set. (The trainer resumes
    through checkpointer.Checkpointer, which restores the same parts in the same order.)"""
    state = load_weights(path, engine, ctx, hf_model, tied)
    engine.load_scheduler_state(state["scheduler"])
    rng = saved_rng(path, ctx, state)
    state["rng_restored"] = rng is not None
    if rng is not None:
        set_rng_state(rng)
    return state


def saved_rng(path: Path, ctx, state: dict) -> dict | None:
    """This rank's RNG state from the checkpoint; None when it does not map onto this run (another world size) or
    this rank has no file of its own (node-local disk)."""
    rng_file = Path(path) / f"rng_state_{ctx.rank}.pt"
    if state.get("world_size") != ctx.world_size or not rng_file.is_file():
        return None
    return torch.load(rng_file, weights_only=False)


def load_weights(path: Path, engine: Engine, ctx, hf_model=None, tied: dict[str, list[str]] | None = None) -> dict:
    """Collective: loads model + optimizer (full, sharded or LoRA adapter) and the engine's own state (DeepSpeed)
    into the engine; returns the trainer state (rank 0's read). The entries a full-state file stores only once
    (tied embeddings) are named by `tied` ({name: [its other names]}, read from the unwrapped model), or found
    from hf_model, a plain copy of the model."""
    path = Path(path)
    # Rank 0 reads the layout and the trainer state for every rank: a rank's own view of the directory (node-local
    # disk, a lagging network file system) must not make it skip a collective the others run (the LoRA gather).
    state, sharded, has_adapter = _rank0_reads(ctx, lambda: (read_trainer_state(path), (path / SHARDED_DIR).is_dir(),
                                                             (path / LORA_ADAPTER_FILE).is_file()))
    if sharded:
        if not engine.supports_sharded():
            raise ValueError(f"{path} is a sharded (DCP) checkpoint, which this distributed.backend cannot load; "
                             f"export it with `python -m grpo_dist.tools.export_checkpoint {path} OUT_DIR` and start "
                             f"from model.name_or_path=OUT_DIR (the optimizer state is then fresh)")
        engine.load_sharded(path / SHARDED_DIR)  # DCP reshards to this world size
    else:
        from safetensors.torch import load_file
        model_sd = optim_sd = None
        adapter = path / LORA_ADAPTER_FILE
        if has_adapter:  # LoRA: the base weights as built at start, the adapter from the checkpoint
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
    return state


# ------------------------------------------------------------------------------------------------------- best
# output_dir/best/: the checkpoint of the best evaluation so far (config key save_best), complete like checkpoint-N
# (resumable, verified by the same manifest) plus best.json {metric, mode, value, step}. Its name never matches
# checkpoint-N, so auto-resume and pruning never see it. A new best is built aside (.tmp-checkpoint-best, or hard
# links of the checkpoint-N just written) and swapped in by two renames: best/ -> .old-best, the new one -> best/;
# a crash between them leaves .old-best, which the next start renames back (recover_best).
BEST_DIR = "best"
BEST_FILE = "best.json"
OLD_BEST = ".old-best"


def improves(value, best: dict | None, mode: str) -> bool:
    """Whether value beats the recorded best (None: there is none yet). NaN never improves; a tie does not."""
    if value is None or value != value:
        return False
    if best is None:
        return True
    return value > best["value"] if mode == "max" else value < best["value"]


def recover_best(output_dir: str | Path) -> None:
    """Rank 0: finish a swap a crash interrupted (see above)."""
    out = Path(output_dir)
    best, old = out / BEST_DIR, out / OLD_BEST
    if old.is_dir() and not best.exists():
        os.replace(old, best)
        print(f"[grpo_dist] {best}: restored the previous best checkpoint (a crash interrupted replacing it)",
              flush=True)
    elif old.exists():
        shutil.rmtree(old, ignore_errors=True)


def read_best(output_dir: str | Path, metric: str, mode: str, check_hashes: bool = False) -> dict | None:
    """Rank 0: the record of output_dir/best/ (best.json) when it is intact and judged by the same metric and
    mode, else None (one line says why; a damaged one is moved to output_dir/damaged/)."""
    out = Path(output_dir)
    recover_best(out)
    best = out / BEST_DIR
    if not best.exists():
        return None
    problem = verify_checkpoint(best, check_hashes)
    if problem is None:
        try:
            record = json.loads((best / BEST_FILE).read_text())
            if not isinstance(record, dict) or not isinstance(record.get("value"), (int, float)):
                raise ValueError("no value")
        except (OSError, ValueError) as e:
            problem = f"{BEST_FILE} is unreadable: {e}"
    if problem is not None:
        move_aside(best, problem)
        return None
    if record.get("metric") != metric or record.get("mode") != mode:
        print(f"[grpo_dist] warning: {best} holds the best {record.get('metric')} ({record.get('mode')}); this run "
              f"keeps the best {metric} ({mode}): its first evaluation replaces it", file=sys.stderr, flush=True)
        return None
    return record


def best_json(record: dict) -> str:
    return json.dumps(record, indent=1) + "\n"


def link_best(src: Path, output_dir: str | Path, record: dict, ctx) -> Path:
    """Collective (rank 0 works, every rank agrees on the outcome): output_dir/best/ from the intact checkpoint
    src just written, by hard links (a copy where the file system has none) plus best.json and a manifest that
    lists it; then swapped in for the previous best."""
    out = Path(output_dir)
    final, tmp = out / BEST_DIR, out / f"{TMP_PREFIX}{BEST_DIR}"
    error = _attempt(tmp, ctx.rank, _link_into, Path(src), tmp, record) if ctx.is_main else None
    if error is None and ctx.is_main:
        error = _attempt(final, ctx.rank, _swap_in, tmp, final)
    _agree_on_write(error, tmp, out, BEST_DIR, ctx)
    return final


def _link_into(src: Path, tmp: Path, record: dict) -> None:
    files, problem = manifest.read_manifest(src)
    if files is None:
        raise CheckpointError(f"{src}: {problem}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for fname in files:
        dest = tmp / fname
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / fname, dest)
        except OSError:
            shutil.copy2(src / fname, dest)
    _write_texts(tmp, {BEST_FILE: best_json(record)})
    _write_manifest_file(tmp, {**files, **_describe(tmp, [BEST_FILE])})


def _swap_in(tmp: Path, final: Path) -> None:
    """Rank 0: the finished tmp replaces final (best/); the previous one stays whole until the new one is in."""
    old = final.parent / OLD_BEST
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    manifest.remember_intact(final)
