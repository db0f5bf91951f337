#!/usr/bin/env bash
# Runs the scorer's classification workloads and keeps the result in bench/results/.
#   bench/score_workloads.sh            GPU: gemm, memory, input, idle (torch with CUDA)
#   bench/score_workloads.sh cpu        CPU: gemm, input, idle
# Environment: PYTHON (a python with torch; default python3), SECONDS_PER_RUN (default 30), PACER.
set -euo pipefail
cd "$(dirname "$0")/.."
device=${1:-cuda}
out=.score-workloads-$device
python=${PYTHON:-python3}
status=0
"$python" bench/score_workloads.py --device "$device" --seconds "${SECONDS_PER_RUN:-30}" --out "$out" \
  --pacer "${PACER:-build/bin/pacer}" --python "$python" || status=$?
mkdir -p bench/results
machine=$(hostname -s)
cp "$out/score_workloads.json" "bench/results/score_workloads-$device-$machine-$(date -u +%F).json"
exit $status
