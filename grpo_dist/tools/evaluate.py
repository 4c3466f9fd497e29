"""Command line of the evaluation (grpo_dist.evaluation): accuracy of a model on a prompt set, greedy pass@1 and
pass@k from K samples per problem.

    python -m grpo_dist.tools.evaluate --model DIR --data FILE [--num-samples K] [--config YAML] [key=value ...]
    torchrun --nproc_per_node 2 -m grpo_dist.tools.evaluate --model DIR --data FILE

--model is an HF model directory, a checkpoint, or a training output_dir (its newest intact checkpoint is used, and
named). A checkpoint is verified as a resume verifies it (manifest.json, sizes, sha256: about 1 GB/s): a damaged one
named directly stops with one line and exit 2; damaged ones newer than an output_dir's newest intact checkpoint are
named and left in place. A model directory without a manifest has its safetensors files checked for truncation.
A LoRA checkpoint (adapter files) is evaluated as its merged/ model when the run wrote one (lora.save_merged), else
as the run's base model with the adapter merged in; its merged/ given directly is evaluated with the run's config.
--data is a .jsonl/.json/.parquet file read with the config's data fields (e.g. data.prompt_field=problem); without
it the config's held-out split is used (data.eval_path, or the preset's eval split: GSM8K test, MATH-500, or the
held-out arithmetic problems). --config supplies the prompt template, reward functions and sampling settings
(default: the run's own config when --model is a training output_dir or a checkpoint in one, else the trainer's
defaults); trailing key=value pairs override it like in training.

Scoring (the first reward function's full marks, ranks splitting the problems, the pass@k estimator) is
grpo_dist.evaluation's. The last line printed is one JSON object with "accuracy" (= greedy pass@1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from grpo_dist import distributed as gdist
from grpo_dist.evaluation import evaluate, k_values
from grpo_dist.manifest import MANIFEST
from grpo_dist.rollout_engines import RolloutEngine


def generation_dtype(cfg, device) -> torch.dtype | None:
    """On a GPU, the compute dtype of training (distributed.mixed_precision) for the parameters, as the trainer's
    generation replica uses; None (the model's own dtype) on a CPU or without mixed precision."""
    from grpo_dist.models import MIXED_PRECISION_DTYPES
    if torch.device(device).type != "cuda":
        return None
    return MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision)


def resolve_model_dir(path: str) -> str:
    """An HF model dir as is (its safetensors files checked for truncation); a checkpoint verified as a resume
    verifies it (manifest, sizes, sha256); a training output_dir -> its newest intact checkpoint, named, the damaged
    newer ones named and left in place. CheckpointError (one line) when what was named cannot be trusted."""
    from grpo_dist.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
    p = Path(path)
    if not p.is_dir():
        return path  # a hub id (or a path that does not exist: the loader says so)
    ckpt = _checkpoint_of(path)
    if (ckpt / MANIFEST).is_file() or (ckpt / "trainer_state.json").is_file():
        problem = verify_checkpoint(ckpt, check_hashes=True)
        if problem:
            raise CheckpointError(f"--model {path}: checkpoint {ckpt} is damaged: {problem}; not evaluated")
        return path
    if (p / "config.json").is_file():
        problem = weights_problem(p)
        if problem:
            raise CheckpointError(f"--model {path}: {problem}; not evaluated")
        return path
    found = list_checkpoints(p)
    if not found:
        raise FileNotFoundError(f"--model {path}: no config.json and no complete checkpoint-<step>/ inside")
    damaged: list[tuple[Path, str]] = []
    for _, ck in reversed(found):
        problem = verify_checkpoint(ck, check_hashes=True)
        if problem is None:
            if os.environ.get("RANK", "0") == "0":  # every rank verifies (the same verdict), rank 0 says so
                for d, why in damaged:
                    print(f"grpo_dist.tools.evaluate: warning: {d}: {why}; skipped (left in place)", file=sys.stderr)
                print(f"grpo_dist.tools.evaluate: evaluating {ck}, the newest intact checkpoint in {path} (sha256 "
                      f"verified)", file=sys.stderr, flush=True)
            return str(ck)
        damaged.append((ck, problem))
    listing = "; ".join(f"{d.name}: {why}" for d, why in damaged)
    raise CheckpointError(f"--model {path}: no intact checkpoint ({listing}); nothing evaluated")


def weights_problem(model_dir: Path) -> str | None:
    """A model directory without a manifest: each *.safetensors file must hold what its header says (an 8-byte
    header length, the JSON header, every tensor's bytes): a cut file is named before anything loads."""
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 + n:
                    return f"{f.name} is truncated ({size} bytes, its header alone needs {8 + n})"
                header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
            return f"{f.name} is not a readable safetensors file ({type(e).__name__})"
        need = 8 + n + max(ends, default=0)
        if size < need:
            return f"{f.name} is truncated ({size} bytes, its header needs {need})"
    return None


def lora_model(model_dir: str) -> tuple[str | None, Path | None]:
    """What to load for a LoRA checkpoint (adapter files, no model weights): (its merged/, None) when the run wrote
    one (lora.save_merged), else (None, the adapter directory): the run's base model with the adapter merged in.
    (model_dir, None) for anything else."""
    from grpo_dist.lora import is_adapter_dir
    if not is_adapter_dir(model_dir):
        return model_dir, None
    merged = Path(model_dir) / "merged"
    return (str(merged), None) if (merged / "config.json").is_file() else (None, Path(model_dir))


# Keys of a training config that mean nothing to an evaluation and could only get in its way.
_RUN_ONLY_KEYS = ("resume_from_checkpoint", "overwrite_output_dir", "output_dir")


def _checkpoint_of(model_dir: str) -> Path:
    """The checkpoint a model directory belongs to: itself, or for a LoRA checkpoint's merged/ its parent."""
    from grpo_dist.lora import is_adapter_dir
    p = Path(model_dir)
    return p.parent if p.name == "merged" and is_adapter_dir(p.parent) else p


def run_config(model_arg: str, model_dir: str) -> tuple[dict | None, str | None]:
    """The config a model was trained with, when --model is a training output_dir or a checkpoint in one (or a
    LoRA checkpoint's merged/): the checkpoint's own trainer_state.json (what trained these weights), else the
    run's config.yaml. (None, None) for a plain model directory or a hub id."""
    from grpo_dist.config import load_yaml
    ckpt = _checkpoint_of(model_dir)
    state = ckpt / "trainer_state.json"
    if state.is_file():
        cfg = json.loads(state.read_text()).get("config")
        if isinstance(cfg, dict):
            return cfg, str(state)
    for folder in (Path(model_arg), ckpt.parent):
        f = folder / "config.yaml"
        if f.is_file():
            return load_yaml(f.read_text(), str(f)) or {}, str(f)
    return None, None


def _write_completions(path: str, records: list, ctx) -> None:
    """Every rank's greedy completion records, gathered on rank 0 and written in problem order."""
    if ctx.world_size > 1:
        gathered: list = [None] * ctx.world_size
        torch.distributed.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    if ctx.is_main:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["index"])))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m grpo_dist.tools.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model dir, checkpoint dir, or training output_dir")
    p.add_argument("--data", help="prompt file (.jsonl/.json/.parquet/hf:NAME); default: the config's eval split")
    p.add_argument("--config", help="YAML config for prompt template, rewards and sampling (default: the training "
                   "run's own config when --model is an output_dir or a checkpoint, else the defaults)")
    p.add_argument("--num-samples", type=int, default=0, help="K sampled completions per problem for pass@k")
    p.add_argument("--limit", type=int, help="evaluate only the first N problems")
    p.add_argument("--batch-size", type=int, default=64, help="problems generated at once per rank (greedy)")
    p.add_argument("--output", help="also write the JSON result to this file (rank 0)")
    p.add_argument("--completions", help="write every greedy completion to this JSON-lines file (rank 0; problem, "
                   "reference, completion, correct, truncated), in problem order")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. temperature=0.6")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from grpo_dist.checkpoint import CheckpointError
    from grpo_dist.config import ConfigError, load_config
    from grpo_dist.data import DataError, load_examples, truncate_long_prompts
    from grpo_dist.models import load_tokenizer
    from grpo_dist.rewards import RewardComputer

    if args.num_samples < 0 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        print("grpo_dist.tools.evaluate: --num-samples must be >= 0, --batch-size and --limit >= 1", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if args.data:
        overrides.append(f"data.eval_path={args.data}")
    try:
        model_dir = resolve_model_dir(args.model)
        run_cfg, source = (None, None) if args.config else run_config(args.model, model_dir)
        if source and run_cfg is not None:
            print(f"grpo_dist.tools.evaluate: using the training run's config from {source} (--config to override)",
                  file=sys.stderr)
            run_cfg = {k: v for k, v in run_cfg.items() if k not in _RUN_ONLY_KEYS}
        weights, adapter = lora_model(model_dir)
        if adapter is None:
            cfg = load_config(args.config, overrides + [f"model.name_or_path={weights}"], base=run_cfg)
            cfg.model.tiny = None
        else:  # the base model as the run (or --config / overrides) names it, the adapter merged in after loading
            cfg = load_config(args.config, overrides, base=run_cfg)
            _check_base(cfg, adapter, run_cfg is not None)
        if weights != model_dir:
            what = weights if adapter is None else \
                f"its base model ({cfg.model.name_or_path or 'model.tiny'}) with the adapter merged in"
            print(f"grpo_dist.tools.evaluate: LoRA checkpoint {model_dir}: evaluating {what}", file=sys.stderr)
    except (ConfigError, FileNotFoundError, CheckpointError) as e:
        print(f"grpo_dist.tools.evaluate: {e}", file=sys.stderr)
        return 2

    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no 'Loading weights' bar per model: the load is one line before and after
    ctx = gdist.init_distributed(cfg.distributed.timeout_s, cfg.distributed.num_threads)
    rewards = model = None
    try:
        examples = load_examples(cfg.data, "eval")
        if not examples:
            raise DataError("no evaluation problems: pass --data FILE, or use a config whose data preset has a "
                            "held-out split (gsm8k, math, arithmetic) or sets data.eval_path")
        examples = examples[:args.limit] if args.limit else examples
        examples = truncate_long_prompts(examples, cfg.data.max_prompt_length, "evaluation data", ctx.is_main)
        torch.manual_seed(cfg.seed + ctx.rank)  # pass@k with sampling_noise=rank (per_prompt seeds each row)
        tokenizer = load_tokenizer(cfg.model)
        t0 = time.perf_counter()
        if ctx.is_main:
            print(f"grpo_dist.tools.evaluate: loading model {model_dir} ...", file=sys.stderr, flush=True)
        model = _rollout_model(cfg, ctx, tokenizer, adapter, args.batch_size)
        if ctx.is_main:
            print(f"grpo_dist.tools.evaluate: loading model {model_dir} ... done in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        rewards = RewardComputer(cfg.rewards, num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,
                                 device=ctx.device, conversational=cfg.data.use_chat_template)
        records: list | None = [] if args.completions else None
        result = evaluate(model, tokenizer, examples, cfg, ctx, rewards, args.num_samples, args.batch_size,
                          progress=True, records=records)
        result["model"] = model_dir
        if records is not None:
            _write_completions(args.completions, records, ctx)
        if ctx.is_main:
            print(f"greedy pass@1: {result['accuracy']:.4f} on {result['num_examples']} problems; "
                  f"{result['truncated_fraction']:.1%} cut off at max_completion_length={cfg.max_completion_length}; "
                  f"evaluated in {result['eval_time_s']:.1f} s")
            for k in (k_values(args.num_samples) if args.num_samples else []):
                print(f"pass@{k}: {result[f'pass@{k}']:.4f} ({args.num_samples} samples per problem, "
                      f"temperature {cfg.temperature})")
            if args.output:
                Path(args.output).parent.mkdir(parents=True, exist_ok=True)
                Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result), flush=True)
        code = 0
    except (ConfigError, DataError) as e:
        print(f"grpo_dist.tools.evaluate: rank {ctx.rank}: {e}", file=sys.stderr)
        code = 2
    finally:
        if rewards is not None:
            rewards.close()
        if isinstance(model, RolloutEngine):
            model.close()  # vLLM shuts down before the process group goes
        gdist.cleanup()
    return code


def _check_base(cfg, adapter: Path, from_run: bool) -> None:
    """A LoRA checkpoint without merged/ needs its base model: the run's, or one named on the command line."""
    from grpo_dist.config import ConfigError
    if not (cfg.model.name_or_path or cfg.model.tiny):
        where = "the run's config names none" if from_run else "no training config found next to it"
        raise ConfigError(f"--model {adapter} is a LoRA adapter without merged/ and {where}: pass its base model "
                          f"as model.name_or_path=BASE (or train with lora.save_merged=true)")
    if cfg.rollout_engine == "vllm":
        raise ConfigError(f"config key 'rollout_engine' = vllm needs a model directory: {adapter} is a LoRA adapter "
                          f"without merged/ (train with lora.save_merged=true, or use rollout_engine=lean)")


def _rollout_model(cfg, ctx, tokenizer, adapter: Path | None = None, batch_size: int = 64):
    """rollout_engine=vllm: a vLLM engine on the model directory (no transformers copy is loaded); lean / hf: the
    model (a LoRA adapter merged into it: W + (alpha / r) B A), with q|k|v and gate|up fused for the lean decoder
    (generation only, never saved)."""
    from grpo_dist.decoder import prepare_replica
    from grpo_dist.models import load_model
    if cfg.rollout_engine == "vllm":
        from grpo_dist.rollout_engines import build_rollout_engine, require_vllm
        require_vllm()
        return build_rollout_engine(cfg, ctx, None, tokenizer, rows=batch_size)  # weights from the directory
    from grpo_dist.models import cast_parameters_
    model = load_model(cfg.model, tokenizer)
    if adapter is not None:  # merged in the model's own dtype, before any cast to the generation dtype
        from grpo_dist.lora import merge_saved_adapter
        merge_saved_adapter(model, adapter)
    model = cast_parameters_(model, generation_dtype(cfg, ctx.device)).to(ctx.device)
    prepare_replica(model)
    return model


if __name__ == "__main__":
    exit_code = main()  # the process group is destroyed and every result written by now
    # Leave without the interpreter's teardown: under torchrun it sometimes aborted a rank after its result was
    # written ("terminate called without an active exception", SIGABRT: a C++ thread meeting a finalizing
    # interpreter, as tests/dist_utils.py records), turning a finished evaluation into a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
