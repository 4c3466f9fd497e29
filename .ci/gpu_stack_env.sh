#!/usr/bin/env bash
# The lent GPU machine's stack, on a CPU: Python 3.12 + PyPI's torch 2.11.0 (the CUDA build; it runs on a CPU) +
# transformers 5.17.0 + accelerate + peft + safetensors, and none of datasets / pyarrow / vllm / deepspeed.
# grpo_dist is NOT installed into it (setup.cfg asks for a newer torch, as on the lent machine): the code runs from
# the source tree on PYTHONPATH. Built once into $GPUSTACK_VENV, then reused while the stamp file records the same
# recipe (CI caches can keep the directory between runs). Prints what it cost.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUSTACK_VENV=${GPUSTACK_VENV:-.venv-gpustack}
# a pyenv shim named python3.12 may exist and still refuse to run: take the first that runs
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  for c in /root/.pyenv/versions/3.12.1/bin/python3.12 python3.12; do
    if "$c" -c pass 2>/dev/null; then PY312=$c; break; fi
  done
fi
RECIPE="python3.12 torch==2.11.0 transformers==5.17.0 accelerate peft safetensors pytest"
t0=$(date +%s)
if [ "$(cat "$GPUSTACK_VENV/.grpo_dist_recipe" 2>/dev/null)" != "$RECIPE" ]; then
  rm -rf "$GPUSTACK_VENV"
  "$PY312" -m venv "$GPUSTACK_VENV"
  pip() { "$GPUSTACK_VENV/bin/python" -m pip "$@"; }
  pip install -q --upgrade pip
  # PyPI's torch 2.11.0 (CUDA 13 build, a few GB with its nvidia-* wheels): the index, not a local CPU wheel
  pip install -q --no-cache-dir --no-input torch==2.11.0
  pip install -q transformers==5.17.0 accelerate peft safetensors pytest
  echo "$RECIPE" > "$GPUSTACK_VENV/.grpo_dist_recipe"
fi
"$GPUSTACK_VENV/bin/python" -c "import torch, transformers, sys; print('[ci] gpu stack: python', sys.version.split()[0],
      'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "[ci] gpu stack environment: $(( $(date +%s) - t0 )) s"
