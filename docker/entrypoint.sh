#!/usr/bin/env bash
# Entry point of the grpo_dist image.
#   CONFIG [key=value ...]   torchrun -m grpo_dist.train over every visible GPU (CPU + gloo
#                            without one), via launch/torchrun.sh; its environment variables
#                            (NPROC_PER_NODE, NNODES, MASTER_ADDR, MASTER_PORT, ...) apply
#   --help                   this text and torchrun.sh's
#   any other command        run as given, e.g. bash, python -m grpo_dist.config
set -euo pipefail
LAUNCH=${GRPO_DIST_LAUNCH:-/opt/grpo_dist/launch/torchrun.sh}
case ${1:---help} in
  -h | --help)
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    echo
    exec "$LAUNCH" --help
    ;;
  *.yaml | *.yml | *=*) exec "$LAUNCH" "$@" ;;
esac
if command -v "$1" >/dev/null 2>&1; then exec "$@"; fi
exec "$LAUNCH" "$@"
