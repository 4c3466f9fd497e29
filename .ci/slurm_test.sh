#!/usr/bin/env bash
# CI: submit launch/slurm/*.sbatch for real to a throw-away SLURM cluster on this machine
# (slurmctld + two slurmd posing as nodes n1 and n2, 8 fake GPUs each; torch sees no GPU,
# so the scripts fall back to CPU + gloo) and check what the jobs did.
#
#   bash .ci/slurm_test.sh
#
#   1. argument errors: jobs given a missing config, an override without '=', and an
#      unknown config key fail with a message that names the problem
#   2. train_1node.sbatch: 1 node x 2 processes
#   3. train_multinode.sbatch -N 2: 2 nodes x 1 process, preempted once: SIGUSR1 to the
#      batch script (what its --signal=B:USR1@600 line makes SLURM do) -> the trainer
#      checkpoints and stops -> the script requeues the job -> it resumes from the
#      checkpoint and completes
#   Each training job must end COMPLETED 0:0 with metrics.jsonl up to max_steps,
#   config.yaml, and a final checkpoint that transformers loads.
#
# Needs root on Debian (slurm_up.sh installs slurmctld slurmd slurm-client munge if missing).
# Environment:
#   PYTHON or VENV  python with grpo_dist's dependencies (default: .venv/bin/python)
#   SLURM_CI_DIR    work dir (default: a new /tmp/grpo-slurm-ci.*; removed on success)
#   CONFIG          training config (default: configs/smoke_cpu.yaml)
#   PREEMPT_STEPS   max_steps of the preempted run (default 20; it must outlast the signal)
# Every daemon it started is stopped by PID and its /etc/hosts line removed, also on failure.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
T0=$EPOCHREALTIME
since() { # seconds since an $EPOCHREALTIME value, to 0.1 s
  local us=$((${EPOCHREALTIME/./} - ${1/./}))
  printf '%d.%d' $((us / 1000000)) $((us / 100000 % 10))
}
say() { echo "[slurm_test $(since "$T0")s] $*"; }

PYTHON=${PYTHON:-${VENV:+$VENV/bin/python}}
PYTHON=${PYTHON:-.venv/bin/python}
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; *) PYTHON=$(command -v "$PYTHON") ;; esac
"$PYTHON" -c 'import torch, transformers' || { echo "slurm_test: $PYTHON lacks torch/transformers; set PYTHON or VENV" >&2; exit 1; }
CONFIG=${CONFIG:-configs/smoke_cpu.yaml}
PREEMPT_STEPS=${PREEMPT_STEPS:-20}

# clusters left by earlier runs that died without cleaning up (their owner PID is gone)
for old in /tmp/grpo-slurm-ci.*; do
  [ -f "$old/owner.pid" ] || continue
  kill -0 "$(cat "$old/owner.pid")" 2>/dev/null && continue
  echo "slurm_test: cleaning up after an earlier run in $old"
  "$REPO/.ci/slurm_down.sh" "$old/cluster"
  rm -rf "$old"
done
W=${SLURM_CI_DIR:-$(mktemp -d /tmp/grpo-slurm-ci.XXXXXX)}
mkdir -p "$W"
W=$(cd "$W" && pwd)
echo $$ >"$W/owner.pid"
CL=$W/cluster JOBS=$W/jobs OUT=$W/out
rm -rf "$JOBS" "$OUT"
mkdir -p "$JOBS" "$OUT"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  if [ "$rc" != 0 ] && [ -d "$JOBS" ]; then
    for f in "$JOBS"/*.out; do [ -f "$f" ] && { echo "----- $f (last 40 lines)"; tail -n 40 "$f"; }; done
    [ -f "$CL/log/slurmctld.log" ] && { echo "----- slurmctld.log (last 20 lines)"; tail -n 20 "$CL/log/slurmctld.log"; }
  fi
  "$REPO/.ci/slurm_down.sh" "$CL"
  if [ "$rc" = 0 ] && [ -z "${SLURM_CI_DIR:-}" ]; then rm -rf "$W"; else echo "slurm_test: files kept in $W"; fi
  say "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (exit $rc)"): SLURM launch test"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$REPO/.ci/slurm_up.sh" "$CL"
export SLURM_CONF=$CL/slurm.conf
say "cluster up"

# jobs see the python of the submitting shell through PATH (sbatch exports the environment)
SUBMIT_ENV=(env -u PYTHON -u VENV "PATH=$(dirname "$PYTHON"):$PATH" OMP_NUM_THREADS=1)
submit() { # NAME [sbatch options and script args...]
  local name=$1
  shift
  "${SUBMIT_ENV[@]}" sbatch --parsable --job-name="$name" --output="$JOBS/%x-%j.out" \
    --time=00:10:00 --signal=B:USR1@60 "$@"
}
field() { scontrol show job "$1" -o | grep -o " $2=[^ ]*" | cut -d= -f2; }
log_of() { echo "$JOBS/$(field "$1" JobName)-$1.out"; }
fail() { echo "slurm_test: FAIL: $*" >&2; exit 1; }
# wait for a job to end. SLURM holds a requeued job for ~2 min (BeginTime); release it
# after a few seconds (at once, slurmd may still see the old run's revoked credential)
waitjob() { # JOBID [TIMEOUT_S]
  local jid=$1 limit=${2:-420} t=$SECONDS st held=
  while :; do
    st=$(field "$jid" JobState)
    case $st in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED) return 0 ;;
      PENDING)
        if [ "$(field "$jid" Reason)" = BeginTime ]; then
          held=${held:-$SECONDS}
          [ $((SECONDS - held)) -ge 5 ] && scontrol update JobId="$jid" StartTime=now
        fi
        ;;
    esac
    [ $((SECONDS - t)) -lt "$limit" ] || { scancel "$jid"; fail "job $jid still $st after ${limit}s"; }
    sleep 1
  done
}
expect_job() { # JOBID STATE EXITCODE
  local st ec
  st=$(field "$1" JobState) ec=$(field "$1" ExitCode)
  [ "$st $ec" = "$2 $3" ] || fail "job $1 ($(field "$1" JobName)) ended $st $ec, expected $2 $3; log: $(log_of "$1")"
}
expect_log() { # JOBID TEXT
  grep -qF -- "$2" "$(log_of "$1")" || fail "job $1 log $(log_of "$1") lacks: $2"
}
check_runs() { # OUTPUT_DIR MAX_STEPS [OUTPUT_DIR MAX_STEPS ...]
  "$PYTHON" - "$@" <<'PY'
import json, sys
from pathlib import Path
from transformers import AutoModelForCausalLM
args = sys.argv[1:]
for out, max_steps in zip(map(Path, args[::2]), map(int, args[1::2])):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(1, max_steps + 1)), f"{out}/metrics.jsonl steps {steps}, expected 1..{max_steps}"
    assert (out / "config.yaml").is_file(), f"{out}/config.yaml missing"
    ckpt = out / f"checkpoint-{max_steps}"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    n = sum(p.numel() for p in model.parameters())
    print(f"  {out.name}: steps 1..{max_steps} in metrics.jsonl, {ckpt.name} loads ({type(model).__name__}, {n} parameters)")
PY
}

# --- 1 + 2: argument errors and the single-node script (these jobs run side by side)
t=$EPOCHREALTIME
j_cfg=$(submit bad-config launch/slurm/train_1node.sbatch configs/no_such_config.yaml)
j_kv=$(submit bad-override launch/slurm/train_multinode.sbatch "$CONFIG" max_steps)
j_key=$(submit bad-key launch/slurm/train_1node.sbatch "$CONFIG" no_such_key=1)
j_one=$(NPROC_PER_NODE=2 submit one-node launch/slurm/train_1node.sbatch "$CONFIG" output_dir="$OUT/one-node" max_steps=2)
for j in "$j_cfg" "$j_kv" "$j_key" "$j_one"; do waitjob "$j"; done
expect_job "$j_cfg" FAILED 2:0
expect_log "$j_cfg" "config file not found: configs/no_such_config.yaml"
expect_job "$j_kv" FAILED 2:0
expect_log "$j_kv" "bad override 'max_steps': expected key=value"
expect_job "$j_key" FAILED 2:0  # the workers' exit code 2 (bad config) passes through torchrun
expect_log "$j_key" "no_such_key"
say "argument errors: missing config, override without '=', unknown key -> jobs FAILED with the reason in the log"
expect_job "$j_one" COMPLETED 0:0
expect_log "$j_one" "1 node x 2 process(es)"
say "train_1node.sbatch: COMPLETED 0:0 ($(since "$t")s for this batch of jobs)"

# --- 3: multi-node, preempted once, requeued, resumed
t=$EPOCHREALTIME
j_multi=$(submit multi-node -N 2 launch/slurm/train_multinode.sbatch "$CONFIG" output_dir="$OUT/multi-node" max_steps="$PREEMPT_STEPS")
for _ in $(seq 600); do
  [ -s "$OUT/multi-node/metrics.jsonl" ] && break
  [ "$(field "$j_multi" JobState)" = RUNNING ] || [ "$(field "$j_multi" JobState)" = PENDING ] || break
  sleep 0.5
done
[ -s "$OUT/multi-node/metrics.jsonl" ] || fail "multi-node job $j_multi logged no step; log: $(log_of "$j_multi")"
say "multi-node job $j_multi logged step $(tail -n 1 "$OUT/multi-node/metrics.jsonl" | grep -o '"step": *[0-9]*' | grep -o '[0-9]*$'); sending SIGUSR1 to its batch script"
scancel --signal=USR1 --batch "$j_multi"
waitjob "$j_multi"
expect_job "$j_multi" COMPLETED 0:0
[ "$(field "$j_multi" Restarts)" = 1 ] ||
  fail "job $j_multi restarted $(field "$j_multi" Restarts) times, expected 1 (if it finished before the signal took effect, raise PREEMPT_STEPS)"
expect_log "$j_multi" "2 node(s) x 1 process(es)"
expect_log "$j_multi" "requeueing job $j_multi"
expect_log "$j_multi" "(restart 1)"
grep -q "resumed from .*checkpoint-" "$(log_of "$j_multi")" || fail "job $j_multi did not resume from a checkpoint; log: $(log_of "$j_multi")"
say "  $(grep -o 'resumed from .*checkpoint-[0-9]*.*' "$(log_of "$j_multi")" | head -n 1)"
say "train_multinode.sbatch: 2 nodes, preempted, requeued, resumed, COMPLETED 0:0 ($(since "$t")s)"
check_runs "$OUT/one-node" 2 "$OUT/multi-node" "$PREEMPT_STEPS" 2>&1 | grep -v '^\[transformers\]\|Loading weights'
say "outputs checked: metrics, config.yaml, final checkpoints load with transformers"
