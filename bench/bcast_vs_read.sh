#!/usr/bin/env bash
# pacer bcast against every rank reading the source itself: bytes read from
# the source and time. Writes bench/results/bcast-<host>-<date>.json.
#   bash bench/bcast_vs_read.sh [BUILD] ; RANKS=8 SIZE=1GiB SRC=/lustre/file bash bench/bcast_vs_read.sh
# Under Slurm across nodes, run the same pacer command with srun instead:
#   srun -N 4 --ntasks-per-node=8 build/bin/pacer bcast SRC /local/copy --compare --json
set -euo pipefail
BUILD=${1:-build}
RANKS=${RANKS:-4}
SIZE=${SIZE:-512MiB}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${BENCH_DIR:-$here/..}/.bcast-bench-XXXXXX")
trap 'rm -rf "$work"' EXIT
src=${SRC:-}
if [ -z "$src" ]; then
  src=$work/src.bin
  bytes=$(python3 -c "import sys; u={'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}; s=sys.argv[1]; print(int(s[:-3])*u[s[-3:]])" "$SIZE")
  head -c "$bytes" /dev/urandom > "$src"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
out=$here/results/bcast-$(hostname -s)-$(date -u +%F).json
mpirun --oversubscribe -np "$RANKS" "$BUILD/bin/pacer" bcast "$src" "$work/dst" --compare --json > "$work/report.json"
python3 - "$work/report.json" "$out" <<'PY'
import json, sys, platform, datetime
r = json.load(open(sys.argv[1]))
r["machine"] = platform.node()
r["date"] = datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
json.dump(r, open(sys.argv[2], "w"), indent=2)
e = r["every_rank_reads"]
print(f"pacer bcast: read {r['bytes_read']} B in {r['seconds']:.3f} s; every rank reads: {e['bytes_read']} B in {e['seconds']:.3f} s ({r['ranks']} ranks, {r['nodes']} node(s))")
PY
echo "wrote $out"
