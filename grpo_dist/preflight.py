"""Checks that run before any model is loaded: each mistake found here ends the run with exit code 2 and one line
naming the key, file or path, instead of a traceback minutes later.

Rank 0 checks (and takes the output_dir lock, see runlock.py); every rank gets its verdict by broadcast, so all ranks
stop together and the message is printed once.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

from grpo_dist.config.checks import context_problems
from grpo_dist.config.errors import ConfigError

# What a previous run leaves in output_dir (metrics.py, checkpoint.py): a fresh run there needs consent.
# metrics.jsonl.N, completions.jsonl.N: the rows a resume replaced, kept (metrics.drop_steps_after)
RUN_OUTPUTS = ("checkpoint-*", ".tmp-checkpoint-*", "best", ".old-best", "metrics.jsonl", "tensorboard",
               "metrics.jsonl.*", "completions.jsonl.*")
# "name" or "org/name": what from_pretrained may look up on the Hugging Face Hub
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class AgreedError(ConfigError):
    """A preflight error every rank raises (printed by rank 0 only)."""


def run(cfg, ctx):
    """Rank 0 runs every check and takes the output_dir lock; all ranks raise AgreedError on a problem. Returns the
    held lock on rank 0 (None elsewhere); it must stay referenced for the life of the run."""
    from grpo_dist import distributed as gdist  # here: `python -m grpo_dist.config --check` imports no torch
    from grpo_dist.runlock import OutputDirInUse, OutputDirLock
    error, lock = None, None
    if ctx.is_main:
        try:
            check_output_dir(cfg.output_dir)
            lock = OutputDirLock(cfg.output_dir)
            note = lock.acquire()
            if note:
                print(f"[grpo_dist] {note}", flush=True)
            check_previous_run(cfg)
            check_resume_path(cfg.resume_from_checkpoint)
            check_rewards(cfg.rewards)
            check_model_source("model.name_or_path", cfg.model.name_or_path)
            check_model_source("model.tokenizer", cfg.model.tokenizer)
            check_context_length(cfg)
            check_dtype_device(cfg, ctx.device)
            slow = cpu_half_precision_note(cfg, ctx.device)
            if slow:
                print(f"[grpo_dist] {slow}", flush=True)
            check_cuda_graphs(cfg, ctx.device)
            for key in ("path", "eval_path"):
                check_data_file(f"data.{key}", getattr(cfg.data, key))
        except (ConfigError, OutputDirInUse) as e:
            error = str(e)
            if lock is not None:
                lock.release()
                lock = None
    error = gdist.broadcast_object(error)
    if error:
        raise AgreedError(error)
    return lock


def check_cuda_graphs(cfg, device) -> None:
    """CUDA graphs capture CUDA kernels: on any other device lean_cuda_graphs cannot do anything; lean_compile is for
    CUDA too (inductor on a CPU took minutes to compile here)."""
    if cfg.lean_cuda_graphs is True and getattr(device, "type", str(device)) != "cuda":
        raise ConfigError(f"config key 'lean_cuda_graphs' = true needs a CUDA device, and this run's device is "
                          f"{device}; set lean_cuda_graphs=false")
    if cfg.lean_compile and getattr(device, "type", str(device)) != "cuda":
        raise ConfigError(f"config key 'lean_compile' = true needs a CUDA device (torch.compile of the decode step is "
                          f"measured nowhere else), and this run's device is {device}; set lean_compile=false")


def check_output_dir(output_dir: str) -> None:
    p = Path(output_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"config key 'output_dir' = {output_dir} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".grpo_dist-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config key 'output_dir' = {output_dir} is not writable: {e.strerror}") from None


def check_previous_run(cfg) -> None:
    """A fresh run in a used output_dir would append to the old metrics and a later auto-resume would continue the
    old run: refuse, unless resuming, or overwrite_output_dir (the old checkpoints and metrics are deleted). What a
    start that failed before step 1 left is cleared without asking (clear_failed_start)."""
    out = Path(cfg.output_dir)
    found = sorted({q.name for pattern in RUN_OUTPUTS for q in out.glob(pattern)})
    if not found or cfg.resume_from_checkpoint:
        return
    if clear_failed_start(out, found):
        return
    if not cfg.overwrite_output_dir:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(f"output_dir {out} already holds a run ({shown}): set resume_from_checkpoint=auto to "
                          f"continue it, overwrite_output_dir=true to start over (deletes its checkpoints and "
                          f"metrics), or choose another output_dir")
    for name in found:
        q = out / name
        shutil.rmtree(q) if q.is_dir() else q.unlink()
    print(f"[grpo_dist] overwrite_output_dir: deleted {', '.join(found)} from {out}", flush=True)


def clear_failed_start(out: Path, found: list[str]) -> bool:
    """What a start that failed before its first step left (an empty metrics.jsonl, a tensorboard folder without
    a step, an empty completions.jsonl; no checkpoint) is not another run: remove it, say so in one line and return
    True. False when output_dir holds a completed step (a line in metrics.jsonl or completions.jsonl) or a
    checkpoint, finished or not. A tensorboard folder with no metrics.jsonl beside it counts as a run (its events
    are not read here)."""
    if any(name.startswith(("checkpoint-", ".tmp-checkpoint-", "best", ".old-best", "metrics.jsonl.",
                            "completions.jsonl.")) for name in found):
        return False
    logs = [out / "metrics.jsonl", out / "completions.jsonl"]
    if any(q.is_file() and q.read_text(errors="replace").strip() for q in logs):
        return False
    if "tensorboard" in found and not logs[0].is_file():
        return False
    left = [q for q in [*logs, out / "tensorboard"] if q.exists()]
    for q in left:
        shutil.rmtree(q) if q.is_dir() else q.unlink()
    print(f"[grpo_dist] output_dir {out}: removed what a start that failed before step 1 left "
          f"({', '.join(q.name for q in left)}: no step, no checkpoint)", flush=True)
    return True


def check_resume_path(value) -> None:
    if value and value != "auto" and not Path(value).is_dir():
        what = "is not a directory" if Path(value).exists() else "does not exist"
        raise ConfigError(f"config key 'resume_from_checkpoint' = {value} {what}")


def check_rewards(rewards: list) -> None:
    from grpo_dist.rewards import resolve_reward_function
    for i, spec in enumerate(rewards):
        if "model" in spec:  # a reward model: a local directory, or a Hub id reachable (its kind: when it loads)
            check_model_source(f"rewards[{i}].model", spec["model"])
        if "function" not in spec:
            continue
        try:
            resolve_reward_function(spec["function"])
        except ValueError as e:
            raise ConfigError(f"config key 'rewards[{i}].function': {e}") from None


def check_model_source(key: str, value) -> None:
    """A local directory must exist; a Hub id must be reachable: in the local cache when offline."""
    if value is None:
        return
    p = Path(value).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"config key '{key}' = {value} is a file; give the model directory")
        return
    if not _HUB_ID.match(value) or value.startswith((".", "~")):
        raise ConfigError(f"config key '{key}' = {value}: no such directory")
    if _offline() and not _in_hub_cache(value):
        raise ConfigError(f"config key '{key}' = {value}: no such local directory, and not in the Hugging Face "
                          f"cache while offline (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set): download it first or "
                          f"give a local path")


def _offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str) or \
            isinstance(try_to_load_from_cache(repo_id, "tokenizer_config.json"), str)
    except Exception:  # noqa: BLE001 - an id the hub library rejects is not cached either
        return False


def check_context_length(cfg) -> None:
    """A prompt and its completion must fit the pretrained model's positions: data.max_prompt_length +
    max_completion_length against its config.json (a local directory, or the Hugging Face cache: nothing is
    downloaded, no weights are read). Also run by `python -m grpo_dist.config --check`. (model.tiny:
    GRPOConfig.problems checks model.tiny.max_position_embeddings.)"""
    path = model_config_file(cfg.model.name_or_path) if cfg.model.name_or_path else None
    if path is None:
        return  # a Hub model not cached yet: nothing to read without downloading; loading it is the check
    try:
        found = context_limit(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config.json: loading the model names it
    if found is None:
        return
    limit, how = found
    bad = context_problems(cfg.data.max_prompt_length, cfg.max_completion_length, limit, f"{how}, {path}")
    max_model_len = cfg.vllm.max_model_len
    if cfg.rollout_engine == "vllm" and max_model_len is not None and max_model_len > limit:
        bad.append(f"config key 'vllm.max_model_len' = {max_model_len} exceeds the model's {limit} positions "
                   f"({how}, {path}); lower it")
    if bad:
        raise ConfigError(bad[0], bad)


def model_config_file(source: str) -> Path | None:
    """The config.json of model.name_or_path: in the directory, or in the Hugging Face cache (never fetched)."""
    p = Path(source).expanduser()
    if p.is_dir():
        return p / "config.json" if (p / "config.json").is_file() else None
    if not _HUB_ID.match(source) or source.startswith((".", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(source, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library rejects is not cached either
        return None
    return Path(found) if isinstance(found, str) else None


def context_limit(conf: dict) -> tuple[int, str] | None:
    """(positions, how they were read) from a model's config.json: max_position_embeddings (n_positions in GPT-2
    style configs; text_config's in multimodal ones), or more where RoPE scaling (rope_scaling, transformers 5's
    rope_parameters) stretches the model's original context by `factor` (linear, dynamic, yarn, longrope, llama3):
    configs disagree on whether max_position_embeddings already holds the stretched length, so the larger counts.
    None when the config names no length."""
    sub = conf.get("text_config")
    text: dict = sub if isinstance(sub, dict) and "max_position_embeddings" not in conf else conf
    found = [(k, v) for k, v in ((k, text.get(k)) for k in ("max_position_embeddings", "n_positions"))
             if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not found:
        return None
    key, n = found[0]
    how = f"{key} = {n}"
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict):
        kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
        if kind not in (None, "default") and isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1:
            original = rope.get("original_max_position_embeddings") or text.get("original_max_position_embeddings")
            original = original if isinstance(original, int) and original > 0 else n
            if int(original * factor) > n:
                return int(original * factor), f"{how}, rope scaling {kind} x{factor:g} of {original}"
    return n, how


def check_dtype_device(cfg, device) -> None:
    """float64 is a CPU dtype here: GPUs run it at a small fraction of their speed, and nccl runs have bf16."""
    if cfg.model.dtype == "float64" and device.type != "cpu":
        raise ConfigError(f"config key 'model.dtype' = float64 runs on the CPU only (this run is on {device.type}); "
                          f"use float32 or bfloat16")


def _matmul_seconds(dtype) -> float:
    """The best of 5 timings of a [128, 512] x [512, 512] matmul (a small layer's shape): about a millisecond."""
    import time

    import torch
    a, b = torch.ones(128, 512, dtype=dtype), torch.ones(512, 512, dtype=dtype)
    a @ b  # the first call pays one-time setup
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def cpu_half_precision_note(cfg, device, seconds=_matmul_seconds, limit: float = 2.0) -> str | None:
    """16-bit floats on a CPU: fast where the CPU has bf16/fp16 matrix instructions (AMX, AVX512-BF16), emulated and
    several times slower than float32 where it has not. Measured here, once, on rank 0 before the model loads, so
    the warning is about this CPU, not a guess from its name; None when no 16-bit dtype is asked for on a CPU or it
    is less than `limit` times slower. Not an error: a run may want bf16 numerics on a CPU on purpose."""
    import torch
    if getattr(device, "type", str(device)) != "cpu":
        return None
    asked = {cfg.model.dtype, {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.distributed.mixed_precision or "")}
    half = [d for d in ("bfloat16", "float16") if d in asked]
    if not half:
        return None
    base = seconds(torch.float32)
    slow = {d: seconds(getattr(torch, d)) / base for d in half}
    slow = {d: r for d, r in slow.items() if r >= limit}
    if not slow:
        return None
    what = ", ".join(f"{d} {r:.1f}x" for d, r in slow.items())
    return (f"warning: 16-bit floats are slow on this CPU (a matmul measured at start, against float32: {what}): "
            f"a CPU run is faster with model.dtype=float32 distributed.mixed_precision=null")


def check_data_file(key: str, value) -> None:
    if not value or value.startswith("hf:"):
        return
    p = Path(value)
    if not p.exists():
        raise ConfigError(f"config key '{key}' = {value}: no such file")
    if p.is_file():
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"config key '{key}' = {value} cannot be read: {e.strerror}") from None
