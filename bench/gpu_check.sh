#!/usr/bin/env bash
# GPU check of grpo_dist's CUDA paths on ONE GPU, with no download: random-init models of real shapes.
#
#   bash bench/gpu_check.sh                      # on a GPU machine, from the repository root: ~5-7 min on an H200 (the learn stage estimated)
#   GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh    # tiny shapes on a CPU (gloo): the same stages in about a minute
#
# Stages (each its own process and time limit; a failing stage does not stop the next ones):
#   env            the interpreter, nvidia-smi, torch / transformers / NCCL versions
#   build          random-init Qwen2.5-0.5B (24 layers, vocab 151,936, tied embeddings) and 4-layer slices of it,
#                  tied and untied, saved as HF directories with a tokenizer whose every id decodes to text
#   meta           the real trainer as rank 1 of a pretend 2-rank world (one process) on the 4-layer model: the
#                  meta-device build that FSDP fills (param_init_fn + sync_module_states on CUDA), which no 1-rank
#                  stage takes; lists every tensor not on the device (models.misplaced_tensors) and runs one step
#   decode         the lean decoder on random bf16 weights at the 0.5B shape (64 and 256 rows), the 1.5B shape (64)
#                  and the 7B shape (32 and 128 rows), eager and from CUDA graphs (lean_cuda_graphs): ms per decode
#                  step against the weight-bandwidth floor (GPU_CHECK_HBM_GBPS, default 4800, an H200's), and the
#                  graphs' greedy tokens and logits against the eager step's
#   train_sharded  torchrun, 1 GPU, FSDP with bf16 mixed precision, Qwen2.5-0.5B, the 0.5B config's per-rank work
#                  (8 prompts x 8 completions, 256 new tokens, beta 0.04): 3 steps with an evaluation at step 2,
#                  a sharded (torch.distributed.checkpoint) save at step 2, then a fresh trainer resumes from it
#                  and runs step 3; its weights are compared with the uninterrupted run's
#   train_full     the same on the tied 4-layer model with save_format=full (gathered HF safetensors + optimizer)
#   train_untied   save_format=full on the untied 4-layer model
#   evaluate       python -m grpo_dist.tools.evaluate's code on the full checkpoint (generation in the compute dtype)
#   cli            torchrun -m grpo_dist.train end to end, 2 steps + a save (nccl group creation, the entry point)
#   learn          the built-in demo (configs/demo_cpu.yaml, the shipped base model) trained on the device: 1 rank,
#                  bf16 mixed precision, 150 steps of 32 prompts x 8; held-out greedy accuracy before and after (fails
#                  when it does not gain; smoke: 3 steps that only have to run)
#   long           issue 29's long-completion step: one GRPO step of the real trainer on the 4-layer 0.5B-shape model,
#                  64 rows (8 prompts x 8) of bench/long_cot.py's long-tailed lengths (lognormal median 200, p95 900,
#                  cap 1024, forced by EOS placement), every lever on (padding_free, max_tokens_per_micro_batch 8192,
#                  decode_compaction_threshold at its default), num_iterations 2: per phase time, tokens computed vs
#                  needed per pass (decode, reference, old, train), tokens/s and MFU of the update and log-prob
#                  passes, peak GPU memory (peak RSS on a CPU)
#   long_24l       the long stage on the whole 24-layer 0.5B model (what issue 37's update / log-prob bars are for)
#   async          issue 23's asynchronous mode: bench/async.py's torchrun jobs on the 4-layer model in bf16, 8 prompts x
#                  8 per step, long_cot.py's lengths capped at 256, 4 steps: a 1-process colocated reference, then
#                  1 trainer + 1 rollout rank on the one GPU (GRPO_DIST_SHARE_GPU=1: both on cuda:0, gloo groups,
#                  since NCCL refuses two ranks on one GPU) at max_staleness 0 and 1: completion tokens/s, idle
#                  fractions (all steps and steps >= k + 1), weight-broadcast ms and bytes, lag; fails when a lag
#                  is not min(step, k) or a version's bytes are not the parameters in bf16
# Printed per step: step time and its split (rollout, log-probs, update), rollout and training tokens/s, peak GPU
# memory; per phase (rollout, learn, save, evaluate): median time and peak memory; per resume: loss equality and
# the largest weight difference. $OUT (default /tmp/gpu_check) gets two files, since a lent machine returns at most
# 8: summary.txt (each stage's verdict, the CHECK lines, the figures) and gpu_check.tgz (every stage's log and
# results.jsonl, one JSON object per measurement; `python bench/gpu_check.py summary $OUT` reads it from there).
# Every stage runs with one interpreter, chosen once: $PYTHON, else the first python3 whose torch sees a GPU, else
# python3. grpo_dist runs from this source tree on PYTHONPATH (nothing is installed). The work folder (models,
# checkpoints) is removed when every stage passed and kept, with its path printed, when one failed. Stages are
# skipped once GPU_CHECK_BUDGET_S (default 420) seconds have passed, so the run stays under 8 minutes.
# Exit code: the number of stages that failed or were skipped (0: all passed).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${OUT:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
SMOKE=${GPU_CHECK_SMOKE:-0}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else  # the interpreter whose torch sees a GPU (a lent machine may have several python3), else python3
  PY=python3
  for c in $(command -v python3) /opt/*/.venv/bin/python3 /usr/local/bin/python3 /usr/bin/python3; do
    if [ -x "$c" ] && "$c" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PY=$c
      break
    fi
  done
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
RES="$WORK/gpu_check"  # logs, results.jsonl, figures: archived into $OUTDIR at the end
mkdir -p "$OUTDIR" "$RES"
rm -f "$OUTDIR/summary.txt" "$OUTDIR/gpu_check.tgz" "$OUTDIR/results.jsonl"
: >"$RES/summary.txt"
: >"$RES/results.jsonl"
# the reward module lives in $WORK; grpo_dist is imported from this checkout
export PYTHONPATH="$REPO:$WORK${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$SMOKE" = 1 ] && echo 1 || echo 8)}
T0=$(date +%s)
FAILED=0
FINISHED=0

figures() { "$PY" "$REPO/bench/gpu_check.py" summary "$RES/results.jsonl" >"$RES/figures.txt" 2>&1; }

finish() { # the summary and the archive, also when killed (a timeout around this script); the work folder
  [ "$FINISHED" = 1 ] && return
  FINISHED=1
  [ -f "$RES/figures.txt" ] || figures
  { cat "$RES/summary.txt"; echo; echo "=== CHECK lines"; cat "$RES/checks.txt" 2>/dev/null; echo
    echo "=== figures"; cat "$RES/figures.txt"
    echo; echo "interpreter $PY, smoke=$SMOKE, $(($(date +%s) - T0)) s, $FAILED failed or skipped"; } >"$OUTDIR/summary.txt"
  tar czf "$OUTDIR/gpu_check.tgz" -C "$WORK" gpu_check
  if [ "$FAILED" = 0 ]; then
    rm -rf "$WORK"
  else
    echo "work folder kept (a stage failed): $WORK" | tee -a "$OUTDIR/summary.txt"
  fi
}
trap 'FAILED=$((FAILED + 1)); echo "killed at $(($(date +%s) - T0))s" >>"$RES/summary.txt"; finish; exit 124' TERM INT

# each stage's time limit is for a GPU; the CPU smoke run (a shared CI box) gets GPU_CHECK_LIMIT_SCALE (3) times it
LIMIT_SCALE=${GPU_CHECK_LIMIT_SCALE:-$([ "$SMOKE" = 1 ] && echo 3 || echo 1)}

stage() { # stage NAME LIMIT_S CMD...
  local name=$1 limit=$(($2 * LIMIT_SCALE)) rc t
  shift 2
  if [ $(($(date +%s) - T0)) -gt "$BUDGET" ]; then
    echo "$name: SKIPPED (budget of ${BUDGET}s spent)" | tee -a "$RES/summary.txt"
    FAILED=$((FAILED + 1))
    return
  fi
  echo "=== $name (limit ${limit}s, at $(($(date +%s) - T0))s)"
  t=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$RES/$name.log" 2>&1
  rc=$?
  grep '^RESULT ' "$RES/$name.log" | sed 's/^RESULT //' >>"$RES/results.jsonl"
  grep '^CHECK' "$RES/$name.log" | cut -c1-400 | tee -a "$RES/checks.txt"
  if [ $rc -ne 0 ]; then
    FAILED=$((FAILED + 1))
    grep -v '^RESULT' "$RES/$name.log" | grep -vi warn | tail -n 15
  fi
  echo "$name: $([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc"), $(($(date +%s) - t))s" | tee -a "$RES/summary.txt"
}

cat >"$WORK/gpu_check_rewards.py" <<'EOF'
def char_parity(completion: str, reference: str) -> float:
    """Differs between completions of random text, so groups are not flat and every update has a signal."""
    return float(sum(map(ord, completion)) % 2)
EOF

D=("$PY" "$REPO/bench/gpu_check.py")
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$REPO/bench/gpu_check.py")
M="$WORK/models"
stage env 60 bash -c "echo interpreter $PY; nvidia-smi || true; $PY -c 'import torch, transformers; print(\"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None, \
\"gpus\", torch.cuda.device_count(), \"transformers\", transformers.__version__)'"
stage build 150 "${D[@]}" build --root "$M"
stage meta 120 "${D[@]}" meta --model "$M/qwen05_4l" --out "$WORK/meta"
stage decode 240 "${D[@]}" decode
stage train_sharded 240 "${TR[@]}" train --model "$M/qwen05" --out "$WORK/sharded" --format sharded --eval-steps 2
stage train_full 120 "${TR[@]}" train --model "$M/qwen05_4l" --out "$WORK/full" --format full
stage train_untied 120 "${TR[@]}" train --model "$M/qwen05_4l_untied" --out "$WORK/untied" --format full
stage evaluate 90 "${D[@]}" evaluate --model "$WORK/full/run/checkpoint-2" --out "$WORK/full"
stage cli 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m grpo_dist.train \
  --config "$WORK/full/run/gpu_check_config.yaml" output_dir="$WORK/cli" max_steps=2 save_steps=2 save_format=sharded
stage learn 150 "${D[@]}" learn --out "$WORK/learn"  # ~30-60 s on an H200: an estimate, not measured
stage long 120 "${D[@]}" long --model "$M/qwen05_4l" --out "$WORK/long"
# the same step on all 24 layers: issue 37's bars (update <= 1.2 s, log-probs <= 0.4 s, update MFU >= 15 %) are
# for this model (2026-12-03: rollout 17.0 s, log-probs 1.9 s, update 5.3 s); skipped once the budget is spent
stage long_24l 150 "${D[@]}" long --model "$M/qwen05" --out "$WORK/long_24l"
stage async 240 "${D[@]}" async --model "$M/qwen05_4l"  # ~150-200 s alone on an H200: 120 cut it

figures
echo
echo "=== figures"
cat "$RES/figures.txt"
echo
echo "=== summary ($(($(date +%s) - T0)) s, smoke=$SMOKE, interpreter $PY)"
cat "$RES/summary.txt"
finish  # removes the work folder when every stage passed
echo "summary: $OUTDIR/summary.txt, logs and results.jsonl: $OUTDIR/gpu_check.tgz"
exit "$FAILED"
