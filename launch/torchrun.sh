#!/usr/bin/env bash
# Start grpo_dist with torchrun on this machine.
#
#   launch/torchrun.sh CONFIG [key=value ...]
#   launch/torchrun.sh configs/smoke_cpu.yaml output_dir=outputs/smoke max_steps=2
#
# One process per visible CUDA GPU; with no GPU visible it runs on the CPU with
# gloo (1 process unless NPROC_PER_NODE says otherwise). The trainer itself picks
# nccl or gloo. Run it from the repository root, or anywhere once grpo_dist is
# pip-installed (CONFIG is then any YAML file).
#
# Environment (all optional):
#   PYTHON          interpreter to use (default: `python` on PATH, else `python3`);
#                   torchrun is run as "$PYTHON -m torch.distributed.run"
#   NPROC_PER_NODE  processes on this node (default: number of visible GPUs, 1 on CPU)
#   NNODES          >1 for a multi-node run without SLURM: start this script on every
#   MASTER_ADDR       node with the same NNODES, MASTER_ADDR (a host every node can
#   MASTER_PORT       reach; default port 29500) and RDZV_ID (default grpo_dist)
#   RDZV_ID
#   TORCHRUN_ARGS   extra torchrun options, split on spaces
#   DRY_RUN=1       print the command instead of running it
set -euo pipefail

PROG=torchrun.sh
usage() {
  sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}
die() {
  echo "$PROG: error: $*" >&2
  echo "usage: $PROG CONFIG [key=value ...]   ($PROG --help for more)" >&2
  exit 2
}

# --- arguments: CONFIG first, then key=value overrides (the trainer checks the keys)
[ $# -ge 1 ] || die "missing CONFIG (a YAML file, e.g. configs/smoke_cpu.yaml)"
case $1 in -h | --help) usage; exit 0 ;; esac
CONFIG=$1
shift
case $CONFIG in
  *=*) die "the first argument must be the CONFIG file, got the override '$CONFIG'" ;;
  -*) die "unknown option '$CONFIG' (options go in environment variables; see --help)" ;;
esac
[ -f "$CONFIG" ] || die "config file not found: $CONFIG (relative paths are taken from $PWD)"
value_next=0  # the word after a bare --key is its value (or the next flag); the trainer reads both
for kv in "$@"; do
  if [ "$value_next" = 1 ] && [[ $kv != --* ]]; then value_next=0; continue; fi
  value_next=0
  if [[ $kv =~ ^--[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*(=|$) ]]; then
    [[ $kv == *=* ]] || value_next=1
    continue
  fi
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*= ]] ||
    die "bad override '$kv': expected key=value, --key value or --key=value, e.g. max_steps=10 or --model.dtype bfloat16"
done

# --- python: the one the user activated, or $PYTHON
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python || command -v python3 || true)
  [ -n "$PYTHON" ] || die "no python on PATH: activate the environment that has grpo_dist, or set PYTHON=/path/to/python"
fi

# --- processes per node: GPUs if any, else CPU
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') ||
    die "$PYTHON could not import torch: activate the environment that has grpo_dist, or set PYTHON"
  NPROC_PER_NODE=1
  [ "$NGPU" -gt 0 ] && NPROC_PER_NODE=$NGPU
fi
[[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'"

# --- environment for the workers (only where the user has not set it)
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  OMP_NUM_THREADS=$(($(nproc) / NPROC_PER_NODE))
  [ "$OMP_NUM_THREADS" -ge 1 ] || OMP_NUM_THREADS=1
  export OMP_NUM_THREADS
fi
# torchrun passes these signals on to the workers (SIGUSR1 is not in its default list);
# the trainer answers SIGTERM/SIGUSR1 with a checkpoint and exit code 75.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE

NNODES=${NNODES:-1}
if [ "$NNODES" = 1 ]; then
  RDZV=(--standalone --nnodes=1)
else
  [[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
  [ -n "${MASTER_ADDR:-}" ] || die "NNODES=$NNODES needs MASTER_ADDR (the host of the rendezvous, reachable from every node)"
  RDZV=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id="${RDZV_ID:-grpo_dist}")
fi
read -r -a EXTRA <<<"${TORCHRUN_ARGS:-}"

CMD=("$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node="$NPROC_PER_NODE" --max_restarts=0
  ${EXTRA[@]+"${EXTRA[@]}"} -m grpo_dist.train --config "$CONFIG" "$@")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
echo "$PROG: $NNODES node(s) x $NPROC_PER_NODE process(es): ${CMD[*]}" >&2

# torchrun exits 1 whenever a worker fails, whatever the worker returned. Each worker writes its own exit code
# into GRPO_DIST_EXIT_CODE_DIR (grpo_dist.train); pass on the lowest rank's non-zero code: 2 bad config or data,
# 3 non-finite loss, 5 cannot learn (health.stop_on, --dry-run), 75 preempted (torchrun's own status when no
# worker wrote one, e.g. all were killed).
worker_code() { # worker_code DIR TORCHRUN_STATUS
  local f c
  if [ "$2" != 0 ]; then
    for f in $(ls "$1" 2>/dev/null | sort -V); do
      c=$(cat "$1/$f" 2>/dev/null || true)
      if [[ $c =~ ^[0-9]+$ ]] && [ "$c" != 0 ]; then
        echo "$c"
        return
      fi
    done
  fi
  echo "$2"
}
GRPO_DIST_EXIT_CODE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/grpo_dist-exit.XXXXXX")
export GRPO_DIST_EXIT_CODE_DIR
trap 'rm -rf "$GRPO_DIST_EXIT_CODE_DIR"' EXIT
# torchrun's stderr goes through a filter that drops torchrun's own traceback when a signal stops it (and a logging
# error it can print then), so the trainer's one line stays last (grpo_dist/tools/torchrun_stderr.py); the filter
# ignores the stop signals and ends when torchrun's stderr closes.
exec 3> >("$PYTHON" -m grpo_dist.tools.torchrun_stderr >&2)
FILTER_PID=$!
# torchrun in a process group of its own (set -m): a terminal's Ctrl-C reaches this script's group only, and the
# trap below passes it on once. In one group, torchrun got it twice (from the terminal and from the trap), took the
# second for a second Ctrl-C and sent SIGTERM to the workers: they aborted without the checkpoint of a first Ctrl-C.
set -m
"${CMD[@]}" 2>&3 &
PID=$!
set +m
exec 3>&-
# pass signals on to torchrun (which passes them to the workers: SIGTERM/SIGUSR1 -> checkpoint, exit 75)
for sig in TERM INT HUP QUIT USR1; do
  # shellcheck disable=SC2064
  trap "kill -$sig $PID 2>/dev/null || true" "$sig"
done
while :; do
  rc=0
  wait "$PID" || rc=$?
  # wait returns early (status > 128) when a trapped signal arrives; torchrun may still run
  if [ "$rc" -gt 128 ] && kill -0 "$PID" 2>/dev/null; then continue; fi
  break
done
wait "$FILTER_PID" 2>/dev/null || true  # the filter's last lines before the exit
exit "$(worker_code "$GRPO_DIST_EXIT_CODE_DIR" "$rc")"
