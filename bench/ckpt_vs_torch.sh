#!/usr/bin/env bash
# Side-by-side: pacer checkpoints (save, time save() blocks, cold load) next to
# torch.save/torch.load and dd's write speed, on the same tensors in the same
# directory, in one run.
#
#   bash bench/ckpt_vs_torch.sh [BUILD_DIR]     (default BUILD_DIR: build)
#
# Environment:
#   ROUNDS=3              rounds; the order of the tools rotates each round
#   CKPT_BENCH_BYTES=N    total tensor bytes (default 2147483648 = 2 GiB)
#   CKPT_BENCH_TENSORS=N  number of float32 tensors (default 8)
#   CKPT_BENCH_SETTLE_S=S idle seconds (after a sync) before every timed step (default 3)
#   CKPT_BENCH_STAGING=N  pacer's staging budget in bytes (default: the tensors plus a chunk each,
#                         so save() never waits for the disk; smaller measures a checkpoint larger
#                         than the pool)
#   CKPT_BENCH_OVERFLOW=N pacer's overflow_bytes: ordinary memory staging may take beyond the
#                         budget, so that save() need not wait for the disk (default 0)
#   CKPT_BENCH_NAME=NAME  result file names, NAME.json and NAME.md (default ckpt_vs_torch-DAY)
#   BENCH_DIR=DIR         where the files are written (default: a temporary
#                         directory under the repository root, removed at exit)
#   PACER_PYTHON=PATH     python with numpy and torch that the module was built
#                         for (default /usr/bin/python3)
#
# Writes bench/results/ckpt_vs_torch-YYYY-MM-DD.{json,md}; every other file it
# creates is removed on exit. See bench/README.md.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-build}
case $BUILD in
  /*) ;;
  *) if [[ -d $BUILD ]]; then BUILD=$(cd "$BUILD" && pwd); else BUILD=$REPO/$BUILD; fi ;;
esac
PY=${PACER_PYTHON:-/usr/bin/python3}
ROUNDS=${ROUNDS:-3}
BYTES=${CKPT_BENCH_BYTES:-2147483648}
TENSORS=${CKPT_BENCH_TENSORS:-8}
SETTLE=${CKPT_BENCH_SETTLE_S:-3}
STAGING=${CKPT_BENCH_STAGING:-0}
OVERFLOW=${CKPT_BENCH_OVERFLOW:-0}
RESULTS=$REPO/bench/results
DAY=$(date -u +%Y-%m-%d)
NAME=${CKPT_BENCH_NAME:-ckpt_vs_torch-$DAY}
OUT_JSON=$RESULTS/$NAME.json
OUT_MD=$RESULTS/$NAME.md

die() { echo "ckpt_vs_torch: $*" >&2; exit 1; }
[[ -f $BUILD/python/pacer/__init__.py ]] || die "no pacer Python module in $BUILD/python (build first: make build, or pass the build directory)"
[[ -x $PY ]] || die "no python at $PY (set PACER_PYTHON)"
for tool in dd fincore findmnt; do command -v "$tool" >/dev/null || die "$tool not found"; done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
[[ $BYTES =~ ^[1-9][0-9]*$ ]] || die "CKPT_BENCH_BYTES must be a positive number of bytes"
[[ $TENSORS =~ ^[1-9][0-9]*$ ]] || die "CKPT_BENCH_TENSORS must be a positive integer"
[[ $SETTLE =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "CKPT_BENCH_SETTLE_S must be a number of seconds"
[[ $STAGING =~ ^[0-9]+$ ]] || die "CKPT_BENCH_STAGING must be a number of bytes"
[[ $OVERFLOW =~ ^[0-9]+$ ]] || die "CKPT_BENCH_OVERFLOW must be a number of bytes"
[[ $NAME =~ ^[A-Za-z0-9._-]+$ ]] || die "CKPT_BENCH_NAME must be letters, digits, '.', '_' and '-'"
PYTHONPATH=$BUILD/python "$PY" -c 'import numpy, torch, pacer' || die "$PY cannot import numpy, torch and pacer from $BUILD/python"

if [[ -n ${BENCH_DIR:-} ]]; then
  mkdir -p "$BENCH_DIR"
  SCRATCH=$(mktemp -d "$BENCH_DIR/ckpt_vs_torch.XXXXXX")
else
  SCRATCH=$(mktemp -d "$REPO/.ckpt_vs_torch-scratch.XXXXXX")
fi
cleanup() { rm -rf -- "$SCRATCH"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# Room for the tensors, pacer's staging copy and one loaded copy, plus the
# files (dd source, one checkpoint per tool) on disk.
need_mem=$(( BYTES * 4 / 1024 ))
avail_mem=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
(( avail_mem > need_mem )) || die "needs about $(( need_mem / 1048576 )) GiB of available memory, $(( avail_mem / 1048576 )) GiB available"
need_disk=$(( BYTES * 4 / 1024 ))
avail_disk=$(df -Pk "$SCRATCH" | awk 'NR == 2 {print $4}')
(( avail_disk > need_disk )) || die "needs about $(( need_disk / 1048576 )) GiB free in $SCRATCH"

PACER_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$REPO" diff --quiet HEAD -- src include apps python 2>/dev/null || PACER_COMMIT="$PACER_COMMIT (+ uncommitted changes)"
SCRATCH_DESC=$([[ -n ${BENCH_DIR:-} ]] && echo "$BENCH_DIR/ckpt_vs_torch.XXXXXX" || echo "$REPO/.ckpt_vs_torch-scratch.XXXXXX")
FACTS=$("$PY" - "$SCRATCH" "$PACER_COMMIT" "$SCRATCH_DESC" <<'PY'
import json, subprocess, sys
scratch, commit, desc = sys.argv[1:4]
def sh(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""
def first(path):
    try:
        return open(path).read().strip()
    except OSError:
        return ""
cpu = next((l.split(":", 1)[1].strip() for l in sh("lscpu").splitlines() if l.startswith("Model name:")), "")
mem_kib = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal:")), 0)
source = sh("findmnt", "-no", "SOURCE", "-T", scratch)
dev = source.rsplit("/", 1)[-1]
print(json.dumps({
    "cpu_model": cpu, "mem_total": f"{mem_kib / 1048576:.1f} GiB", "pacer_commit": commit,
    "path": desc, "fs_type": sh("findmnt", "-no", "FSTYPE", "-T", scratch), "device": source,
    "device_rotational": first(f"/sys/block/{dev}/queue/rotational"),
    "device_scheduler": first(f"/sys/block/{dev}/queue/scheduler"),
    "mount_options": sh("findmnt", "-no", "OPTIONS", "-T", scratch),
    "vm_dirty_ratio": first("/proc/sys/vm/dirty_ratio"),
    "vm_dirty_background_ratio": first("/proc/sys/vm/dirty_background_ratio"),
    "thp_enabled": first("/sys/kernel/mm/transparent_hugepage/enabled"),
}))
PY
)

mkdir -p "$RESULTS"
PYTHONPATH=$BUILD/python "$PY" "$REPO/bench/ckpt_vs_torch.py" --scratch "$SCRATCH/run" --bytes "$BYTES" \
  --tensors "$TENSORS" --rounds "$ROUNDS" --settle "$SETTLE" --staging "$STAGING" --overflow "$OVERFLOW" --out-json "$OUT_JSON" --out-md "$OUT_MD" --facts "$FACTS" \
  --command "ROUNDS=$ROUNDS CKPT_BENCH_BYTES=$BYTES CKPT_BENCH_TENSORS=$TENSORS CKPT_BENCH_SETTLE_S=$SETTLE CKPT_BENCH_STAGING=$STAGING CKPT_BENCH_OVERFLOW=$OVERFLOW bash bench/ckpt_vs_torch.sh ${1:-}"
echo "ckpt_vs_torch: wrote $OUT_JSON and $OUT_MD"
