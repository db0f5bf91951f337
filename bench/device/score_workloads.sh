#!/usr/bin/env bash
# The scorer's classification workloads on the GPU machine, in one call (bench/README.md, "Saturation scorer"):
#   here:  bash bench/device/module.sh pack build          (puts build/bin/pacer in .device/bin)
#   there: OUT=DIR bash bench/device/score_workloads.sh    (carry .device; needs torch with CUDA)
# Runs every GPU workload of bench/score_workloads.py (gemm, memory, input, idle, prep, tiny) under
# `pacer monitor` with NVML and GPM, scores each and prints verdict against expected; then the CPU
# ones (prep, threads) on the same host. Leaves in $OUT: score_workloads-{cuda,cpu}.json (with every
# score document), the printed tables (*.txt), the catalogs packed in catalogs.tgz, machine.txt.
# Exit code 0 even when a verdict is wrong (the tables say FAILED), so that everything comes back.
# Environment: SECONDS_PER_RUN (default 20), PYTHON (default python3), PACER (default .device/bin/pacer).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
python=${PYTHON:-python3}
pacer=${PACER:-$PWD/.device/bin/pacer}
seconds=${SECONDS_PER_RUN:-20}
work=$(mktemp -d)
{ date -u; uptime; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$python" -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'; } > "$OUT/machine.txt" 2>&1
"$python" bench/score_workloads.py --device cuda --seconds "$seconds" --out "$work/cuda" --pacer "$pacer" --python "$python" \
  2>&1 | tee "$OUT/score_workloads-cuda.txt"
echo "rc=${PIPESTATUS[0]} cuda" | tee -a "$OUT/steps.txt"
"$python" bench/score_workloads.py --device cpu --only prep,threads --seconds "$seconds" --out "$work/cpu" --pacer "$pacer" \
  --python "$python" 2>&1 | tee "$OUT/score_workloads-cpu.txt"
echo "rc=${PIPESTATUS[0]} cpu" | tee -a "$OUT/steps.txt"
cp "$work/cuda/score_workloads.json" "$OUT/score_workloads-cuda.json" 2>/dev/null
cp "$work/cpu/score_workloads.json" "$OUT/score_workloads-cpu.json" 2>/dev/null
tar -C "$work" -czf "$OUT/catalogs.tgz" --exclude='*.db-wal' --exclude='*.db-shm' . 2>/dev/null
{ date -u; uptime; } >> "$OUT/machine.txt"
rm -rf "$work"
exit 0
