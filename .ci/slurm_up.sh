#!/usr/bin/env bash
# Start a throw-away SLURM cluster on this machine: slurmctld plus two slurmd that pose
# as nodes n1 and n2 (8 fake GPUs each; torch sees none, so jobs run on CPU + gloo).
#
#   .ci/slurm_up.sh DIR        then: export SLURM_CONF=DIR/slurm.conf
#   .ci/slurm_down.sh DIR      stops it (by PID) and undoes the /etc/hosts line
#
# Everything lives in DIR (config, state, logs, PID files). Needs root; installs
# slurmctld slurmd slurm-client munge from Debian if they are missing. Safe to re-run:
# a cluster left over in DIR is stopped first. munged is started only if none answers.
set -euo pipefail
[ $# = 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
D=$(realpath -m "$1")
[ "$(id -u)" = 0 ] || { echo "$0: needs root (starts munged, slurmctld, slurmd)" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  echo "installing slurmctld slurmd slurm-client munge" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi

# stale cluster from an earlier run in the same DIR
[ -d "$D/pids" ] && "$HERE/slurm_down.sh" "$D"
rm -rf "$D/state" "$D/spool" "$D/log" "$D/pids"
mkdir -p "$D"/{state,log,spool/n1,spool/n2,pids}

# free TCP ports: slurmctld on P, slurmd n1/n2 on P+1, P+2 (others may run clusters here too)
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
P=${SLURM_CI_PORT:-6817}
while port_busy "$P" || port_busy $((P + 1)) || port_busy $((P + 2)); do P=$((P + 10)); done

# fake GPUs: character devices (/dev/null's numbers) that slurmd accepts for gres/gpu
for i in 0 1 2 3 4 5 6 7; do [ -c "$D/fakegpu$i" ] || mknod "$D/fakegpu$i" c 1 3; done
echo "Name=gpu File=$D/fakegpu[0-7]" >"$D/gres.conf"
NCPU=$(nproc)
cat >"$D/slurm.conf" <<CONF
ClusterName=grpoci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPort=$P
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/pids/slurmctld.pid
SlurmdPidFile=$D/pids/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
Waittime=0
GresTypes=gpu
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((P + 1)) CPUs=$NCPU RealMemory=4000 Gres=gpu:8 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((P + 2)) CPUs=$NCPU RealMemory=4000 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$D/slurm.conf

# the node names must resolve (the rendezvous host is the first node's name)
MARK="# grpo-slurm-ci $D"
grep -qxF "127.0.0.1 n1 n2 $MARK" /etc/hosts || echo "127.0.0.1 n1 n2 $MARK" >>/etc/hosts

# munge: the Debian package made /etc/munge/munge.key; make one if it is missing
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 600 /etc/munge/munge.key
  touch "$D/pids/created-munge-key"
fi
if ! munge -n >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge /var/lib/munge /var/log/munge
  env -u SLURM_CONF setpriv --reuid=munge --regid=munge --clear-groups /usr/sbin/munged -F >"$D/log/munged.out" 2>&1 &
  echo $! >"$D/pids/munged.bg"
  for _ in $(seq 100); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n >/dev/null || { echo "munged did not start" >&2; cat "$D/log/munged.out" >&2; exit 1; }

# foreground daemons (-D), so $! is their PID; started in DIR so no job inherits a stray cwd
cd "$D"
slurmctld -D -f "$SLURM_CONF" >"$D/log/slurmctld.out" 2>&1 &
echo $! >"$D/pids/slurmctld.bg"
for n in n1 n2; do
  slurmd -D -N "$n" -f "$SLURM_CONF" >"$D/log/slurmd-$n.out" 2>&1 &
  echo $! >"$D/pids/slurmd-$n.bg"
done
for _ in $(seq 300); do
  [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle)" = 2 ] && break
  sleep 0.2
done
if [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle)" != 2 ]; then
  echo "slurm did not come up" >&2
  tail -n 20 "$D"/log/* >&2 || true
  exit 1
fi
sinfo -N -o '%N %T %c %G' | sed 's/^/  /'
echo "cluster up: SLURM_CONF=$SLURM_CONF (slurmctld port $P)"
