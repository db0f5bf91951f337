#!/usr/bin/env bash
# pacer's GradientReducer against PyTorch DDP (gloo) on the same synthetic backward, CPU ranks under mpirun.
# Usage: bash bench/comm_overlap.sh [BUILD_DIR]   (ROUNDS=7 by default)
# Writes bench/results/comm_overlap-DATE.json and .md (rename them -runN to keep several runs of a day).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${ROUNDS:-7}
DATE=$(date -u +%F)
OUT=bench/results/comm_overlap-$DATE
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm=isolated \
  OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
cmake --build "$BUILD" -j2 --target pacer_comm pacer_cli >/dev/null
mpicxx -O2 -std=c++20 -Iinclude -I"$BUILD"/generated bench/comm_overlap.cpp "$BUILD"/lib/libpacer_comm.a \
  "$BUILD"/lib/libpacer_hw.a "$BUILD"/lib/libpacer_core.a -lfmt -ldl -lpthread -o "$BUILD"/comm_overlap
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# 16 layers x 4 MiB = 64 MiB of fp32 gradients; 8 ms of compute per layer
# (compute > communication here) and 2 ms (communication dominates).
for np in 2 4; do
  for kind in sleep spin; do
    for ms in 8 2; do
      for bucket in 25 4; do
        mpirun --oversubscribe -np $np "$BUILD"/comm_overlap 16 4 $ms $kind "$ROUNDS" $bucket >>"$tmp/pacer.jsonl"
      done
      /usr/bin/python3 bench/comm_overlap_ddp.py $np 16 4 $ms $kind "$ROUNDS" 25 >>"$tmp/ddp.jsonl"
    done
  done
done
mpirun --oversubscribe -np 2 "$BUILD"/bin/pacer comm bench --max-size 64MiB --output "$tmp/bench.json" >/dev/null
/usr/bin/python3 bench/comm_overlap_report.py "$tmp" "$OUT"
