#!/usr/bin/env bash
# vet's GPU error and topology checks on the real GPUs (the 2-GPU H200 machine), beside
# nvidia-smi's own view of the same links, in one call:
#   here:  bash bench/device/module.sh pack build
#   there: OUT=DIR bash bench/device/nvlink_counters.sh      (carry .device)
# Records the NVLink state and CRC/replay/recovery counters vet reads, the Xid and NUMA
# checks, and nvidia-smi nvlink -s / -e / topo -m for comparison, so that the h200 profile's
# NVLink limits can come from measured links. Exit code 0 even when a step fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
checks=gpu.xid,gpu.xid_new,gpu.retired_pages,gpu.nvlink_down,gpu.nvlink_active,gpu.nvlink_crc,gpu.nvlink_replay
checks=$checks,gpu.nvlink_recovery,gpu.nvlink_rise,gpu.numa_node,gpu.nic_numa,gpu.hmm,gpu.c2c_bandwidth,gpu.remap
{ date -u; uptime; nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv; } > "$OUT/machine.txt" 2>&1
for profile in h200 default; do
  .device/bin/pacer vet --profile $profile --only "$checks" --json-file "$OUT/vet-gpu-errors-$profile.json" \
    > "$OUT/vet-gpu-errors-$profile.txt" 2>&1
  echo "rc=$? vet $profile" >> "$OUT/steps.txt"
done
nvidia-smi nvlink -s > "$OUT/nvlink-status.txt" 2>&1
nvidia-smi nvlink -e > "$OUT/nvlink-errors.txt" 2>&1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
{ date -u; uptime; } >> "$OUT/machine.txt"
exit 0
