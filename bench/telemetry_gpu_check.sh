#!/usr/bin/env bash
# On a GPU node: runs pacer monitor for a few seconds (with a CUDA load when
# torch has CUDA) and checks that NVML and, on Hopper, GPM metrics reached the
# catalog with sane values. Prints the per-metric summary; exit 1 on a problem.
# Usage: bash bench/telemetry_gpu_check.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
load='import time
try:
    import torch
    assert torch.cuda.is_available()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + 8
    while time.time() < end:
        b = a @ a
    torch.cuda.synchronize()
except Exception as e:
    print("no CUDA load:", e); time.sleep(8)'
"$BUILD/bin/pacer" monitor --interval 500ms --db "$work/g.db" --json -- /usr/bin/python3 -c "$load" > "$work/summary.json"
cat "$work/summary.json"
"$BUILD/bin/pacer" query "$work/g.db" "SELECT metric, unit, count(*) AS n, min(value) AS min, avg(value) AS mean, max(value) AS max FROM samples_named WHERE gpu_index IS NOT NULL GROUP BY metric ORDER BY metric"
"$BUILD/bin/pacer" query "$work/g.db" "SELECT
  (SELECT count(*) FROM samples_named WHERE metric LIKE 'gpu.%') AS nvml_values,
  (SELECT count(*) FROM samples_named WHERE metric LIKE 'gpm.%') AS gpm_values,
  (SELECT count(*) FROM samples_named WHERE metric IN ('gpm.sm_util','gpm.tensor_util','gpm.dram_bw_util','gpu.util') AND (value < 0 OR value > 1)) AS ratios_out_of_range,
  (SELECT count(*) FROM samples_named WHERE metric='gpu.temperature_c' AND (value < 5 OR value > 120)) AS temps_out_of_range" --json > "$work/check.json"
cat "$work/check.json"
/usr/bin/python3 - "$work/check.json" <<'PY'
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
problems = []
if row["nvml_values"] == 0: problems.append("no NVML values")
if row["gpm_values"] == 0: problems.append("no GPM values (expected on Hopper)")
if row["ratios_out_of_range"]: problems.append(f"{row['ratios_out_of_range']} ratios outside [0, 1]")
if row["temps_out_of_range"]: problems.append(f"{row['temps_out_of_range']} implausible temperatures")
print("FAILED: " + "; ".join(problems) if problems else "OK: NVML and GPM metrics recorded and in range")
sys.exit(1 if problems else 0)
PY
