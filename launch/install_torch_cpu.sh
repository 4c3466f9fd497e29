#!/usr/bin/env bash
# Install torch 2.13.0, CPU build, into the interpreter $1 (used by launch/demo.sh and .ci/run).
#
#   bash launch/install_torch_cpu.sh PYTHON
#
# A local wheel when pip is configured with one (find-links, as on the project's CI machines), else PyTorch's CPU
# wheel index (TORCH_INDEX_URL overrides it): on Linux, PyPI's own torch wheel is the multi-GB CUDA build.
set -euo pipefail
PY=${1:?usage: install_torch_cpu.sh PYTHON}
if "$PY" -m pip install -q --no-index --no-deps torch==2.13.0 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0                # its dependencies, from the package index
else
  "$PY" -m pip install -q torch==2.13.0 --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
