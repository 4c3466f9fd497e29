#!/usr/bin/env bash
# Stop the cluster that .ci/slurm_up.sh started in DIR: cancel its jobs, stop every
# daemon by the PID it recorded, kill leftover job processes of this cluster (found
# by SLURM_CONF=DIR/slurm.conf in their environment), remove its /etc/hosts line.
# Safe to run twice, or on a half-started cluster.
set -uo pipefail
[ $# = 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
D=$(realpath -m "$1")
CONF=$D/slurm.conf

# a PID is ours only if it still runs a program that names our DIR (PIDs get reused)
ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$D"; }
stop_pid() { # PID [check]
  local p=$1
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 0
  kill "$p" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$p" 2>/dev/null
}

if [ -f "$CONF" ] && [ -f "$D/pids/slurmctld.bg" ] && ours "$(cat "$D/pids/slurmctld.bg")"; then
  jobs=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    SLURM_CONF=$CONF scancel $jobs 2>/dev/null
    for _ in $(seq 60); do [ -z "$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
for f in "$D"/pids/slurmd-*.bg "$D/pids/slurmctld.bg"; do
  [ -f "$f" ] || continue
  p=$(cat "$f")
  ours "$p" && stop_pid "$p"
  rm -f "$f"
done
# job processes (slurmstepd, srun, torchrun, workers) that outlived their slurmd;
# not this script or its callers, which may have SLURM_CONF set too
keep=" "
a=$$
while [ "$a" -gt 1 ] 2>/dev/null; do
  keep="$keep$a "
  a=$(sed 's/.*) //' "/proc/$a/stat" 2>/dev/null | cut -d' ' -f2)
done
[ -f "$D/pids/munged.bg" ] && keep="$keep$(cat "$D/pids/munged.bg") "
for e in /proc/[0-9]*/environ; do
  p=${e#/proc/}; p=${p%/environ}
  case $keep in *" $p "*) continue ;; esac
  if { tr '\0' '\n' <"$e" | grep -qxF "SLURM_CONF=$CONF"; } 2>/dev/null; then
    echo "slurm_down: killing leftover job process $p: $({ tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | cut -c1-80)"
    kill -9 "$p" 2>/dev/null
  fi
done
if [ -f "$D/pids/munged.bg" ]; then
  p=$(cat "$D/pids/munged.bg")
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = munged ] && stop_pid "$p"
  rm -f "$D/pids/munged.bg"
fi
if [ -f "$D/pids/created-munge-key" ]; then
  rm -f /etc/munge/munge.key "$D/pids/created-munge-key"
fi
# remove our /etc/hosts line in place (the file may be a bind mount)
MARK="# grpo-slurm-ci $D"
if grep -qF -- "$MARK" /etc/hosts; then
  grep -vxF "127.0.0.1 n1 n2 $MARK" /etc/hosts >"$D/hosts.new"
  cat "$D/hosts.new" >/etc/hosts
  rm -f "$D/hosts.new"
fi
exit 0
