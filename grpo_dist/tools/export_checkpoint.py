"""Turn a sharded (save_format=sharded, torch.distributed.checkpoint) checkpoint into a Hugging Face directory.

    python -m grpo_dist.tools.export_checkpoint OUTPUT_DIR/checkpoint-<step> OUT_DIR [--dtype bfloat16] \\
        [--max-shard-size 5GB]

No torchrun and no GPU: DCP is read in a single process. The weights are read one safetensors shard at a time
(at most --max-shard-size in memory besides the DCP metadata), so a 30B+ model exports on an ordinary host.
OUT_DIR gets model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json), config.json,
generation_config.json and the tokenizer files: `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it. The
optimizer state is not exported.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

import torch

from grpo_dist.checkpoint import MANIFEST, SHARDED_DIR, verify_checkpoint, write_hf_weights

MODEL_PREFIX = "model."  # DCP keys are flattened: {"model": {name: tensor}} is stored as "model.<name>"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a checkpoint that are not weights, optimizer, RNG or trainer state: copied as they are.
_SKIP = {MANIFEST, "trainer_state.json", "optimizer.pt"}


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for u, f in units.items():
        if t.endswith(u):
            return int(float(t[:-len(u)]) * f)
    return int(t)


def _model_tensors(sharded: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(str(sharded)).read_metadata()
    return {k[len(MODEL_PREFIX):]: (m.size, m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}


def _read(sharded: Path, specs: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    tensors = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in specs.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load({"model": tensors}, checkpoint_id=str(sharded), no_dist=True)  # reads only these keys
    return tensors


def export(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
           max_shard_size: str | int = "5GB") -> Path:
    from transformers import AutoConfig

    ckpt, out = Path(checkpoint), Path(out_dir)
    sharded = ckpt / SHARDED_DIR
    if not sharded.is_dir():
        if (ckpt / "model.safetensors").is_file() or (ckpt / "model.safetensors.index.json").is_file():
            raise ValueError(f"{ckpt} is a full-state checkpoint: it already is an HF directory "
                             f"(AutoModelForCausalLM.from_pretrained loads it as it is)")
        raise FileNotFoundError(f"{ckpt} has no {SHARDED_DIR}/ directory (not a sharded grpo_dist checkpoint)")
    problem = verify_checkpoint(ckpt)
    if problem:
        raise ValueError(f"{ckpt} is not a complete checkpoint: {problem}")
    if out.resolve() == ckpt.resolve():
        raise ValueError("OUT_DIR must differ from the checkpoint directory")
    config = AutoConfig.from_pretrained(ckpt)
    specs = _model_tensors(sharded)
    if not specs:
        raise ValueError(f"{sharded} holds no model tensors (no '{MODEL_PREFIX}*' keys)")
    if getattr(config, "tie_word_embeddings", False):
        specs.pop("lm_head.weight", None)  # tied to the input embedding; from_pretrained re-ties it
    target = _DTYPES[dtype] if dtype else None
    if target is not None:
        config.dtype = target  # recorded in config.json, as save_pretrained would

    out.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    out_specs = {k: (shape, target or dt) for k, (shape, dt) in specs.items()}

    def read(names):
        tensors = _read(sharded, {k: specs[k] for k in names})
        return {k: v.to(target) for k, v in tensors.items()} if target is not None else tensors
    write_hf_weights(out, out_specs, read, max_shard_size=limit)
    config.save_pretrained(out)
    for p in ckpt.iterdir():  # generation config and tokenizer files
        if p.is_file() and p.name not in _SKIP and p.name != "config.json" and not p.name.startswith("rng_state_"):
            shutil.copy2(p, out / p.name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_dist.tools.export_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a sharded checkpoint directory: OUTPUT_DIR/checkpoint-<step>")
    p.add_argument("out_dir", help="where to write the Hugging Face directory")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="convert the weights (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"grpo_dist.tools.export_checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
