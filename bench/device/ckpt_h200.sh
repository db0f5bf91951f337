#!/usr/bin/env bash
# Checkpoints of a GPU training state on the H200 machine (bench/README.md, "A GPU training state"),
# in one call: one rank, then RANKS ranks under torchrun. With fewer GPUs than ranks the ranks share
# the GPUs and talk over gloo (the checkpoint issue's "2 ranks" when only one GPU is lent); with a
# GPU each they use NCCL.
#   here:  bash bench/device/module.sh pack build
#   there: OUT=DIR bash bench/device/ckpt_h200.sh          (carry .device)
# Settings: LAYERS (48) and RANK_LAYERS (24) of 4096 x 4096 bf16 with AdamW, ROUNDS (2), RANKS (2),
# SCRATCH (default .scratch in the checkout: the machine's real disk).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
bash bench/device/module.sh build > "$OUT/module.log" 2>&1 || { tail -20 "$OUT/module.log"; exit 1; }
export PYTHONPATH=$PWD/.device/python LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
scratch=${SCRATCH:-$PWD/.scratch}
day=$(date -u +%F)
{ date -u +%FT%TZ; uptime; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
if [ "${SKIP_ONE:-0}" != 1 ]; then
  timeout 330 python3 bench/ckpt_gpu.py --dir "$scratch/one" --out "$OUT/ckpt_gpu-h200-$day.json" \
    --layers "${LAYERS:-48}" --rounds "${ROUNDS:-2}" 2>&1 | tee "$OUT/ckpt_gpu-one.log" | grep -E "round|medians|ratios|met"
fi
timeout 330 torchrun --standalone --nproc-per-node "${RANKS:-2}" bench/ckpt_gpu.py --dir "$scratch/ranks" \
  --out "$OUT/ckpt_gpu-h200-${RANKS:-2}ranks-$day.json" --layers "${RANK_LAYERS:-24}" --rounds "${ROUNDS:-2}" 2>&1 \
  | tee "$OUT/ckpt_gpu-ranks.log" | grep -E "round|medians|ratios|met|Error|error"
rm -rf "$scratch"
uptime >> "$OUT/machine.txt"
