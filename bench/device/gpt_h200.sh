#!/usr/bin/env bash
# examples/gpt on one H200 (bench/README.md, "examples/gpt on the H200"), in one call of ~500 s:
#   here:  bash bench/device/module.sh pack build && bash bench/device/gpt_h200.sh pack
#   there: OUT=DIR bash bench/device/gpt_h200.sh                          (carry .device)
#   dry run on a CPU (no .device needed, build/ is used):
#          OUT=/tmp/x bash bench/device/gpt_h200.sh --dry-run
# Prepares the data from a corpus carried in .device/gpt-corpus (the machine has no network and
# a trimmed /usr/share/doc), measures the node (pacer vet --quick), trains the 1b config in bf16
# under pacer monitor with pacer's loader and Checkpointer (interval from pacer plan ckpt on the
# first save's cost), then the same loop the usual way (torch DataLoader, torch.save at the same
# steps), then pacer score, pacer report and pacer plan step beside the measured step time.
# Everything goes to $OUT; steps.txt has one rc= line per step, and the exit code is 0 even when
# a step fails so that every log comes back. Settings: CONFIG STEPS BATCH SEQ VOCAB MAXMB MTBF
# RESTART WORK (scratch, default /tmp/gpt-bench; checkpoints of the 1b config are ~12 GB each),
# NPROC (ranks, one GPU each: NPROC=2 on the 2-GPU machine; BATCH is per rank).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

if [ "${1:-}" = pack ]; then
  # Here: spm_train and its library, and the corpus, into .device (module.sh pack made the rest).
  set -e
  mkdir -p .device/bin .device/lib .device/gpt-corpus
  cp -L "$(command -v spm_train)" .device/bin/
  cp -L /lib/x86_64-linux-gnu/libsentencepiece_train.so.0 /lib/x86_64-linux-gnu/libsentencepiece.so.0 .device/lib/
  rm -f .device/gpt-corpus/*
  # The corpus prepare.py would take by default, copied up to MAXMB (default 8) MiB, in its order.
  python3 - "${MAXMB:-8}" <<'EOF'
import os, shutil, sys
sys.path.insert(0, "examples/gpt")
import prepare
for i, (p, data) in enumerate(prepare.collect([], int(float(sys.argv[1]) * (1 << 20)))):
    with open(os.path.join(".device/gpt-corpus", f"{i:05d}-" + p.strip("/").replace("/", "_")), "wb") as f:
        f.write(data)
EOF
  du -sh .device .device/gpt-corpus
  exit 0
fi

dry=0
[ "${1:-}" = --dry-run ] && dry=1
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
if [ $dry = 1 ]; then
  : "${CONFIG:=tiny}" "${STEPS:=16}" "${BATCH:=2}" "${SEQ:=128}" "${VOCAB:=1000}" "${MAXMB:=0.3}" "${MTBF:=2m}"
  export PYTHONPATH=$root/build/python PACER_BIN=$root/build/bin/pacer
  export PATH=/usr/bin:$PATH  # Debian's python3 (torch, numpy), not a pyenv shim
  device=cpu threads=(--threads 2)
else
  # 1b: 16 layers of width 2048, 8 x 2048 tokens a step (0.46 s and 52 GiB on an H200 with torch 2.11:
  # bench/results/gpt-1b-probe-h200-2026-12-01.md).
  # MTBF 10m is assumed, far below a real job's (hours for thousands of GPUs), so that the planned
  # interval (which grows as sqrt(MTBF)) falls inside a run this short and both loops save mid-run.
  : "${CONFIG:=1b}" "${STEPS:=250}" "${BATCH:=8}" "${SEQ:=2048}" "${VOCAB:=8000}" "${MAXMB:=8}" "${MTBF:=10m}"
  export LD_LIBRARY_PATH=$root/.device/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=$root/.device/python \
         PACER_BIN=$root/.device/bin/pacer SPM_TRAIN=$root/.device/bin/spm_train NCCL_NVLS_ENABLE=0
  device=cuda threads=()
fi
: "${RESTART:=1m}" "${WORK:=/tmp/gpt-bench}"
export PATH=$(dirname "$PACER_BIN"):$PATH
pacer=$PACER_BIN
name=gpt-${CONFIG}-$([ $dry = 1 ] && echo cpu-dry || echo h200)$([ "${NPROC:-1}" != 1 ] && echo "x${NPROC}")
rm -rf "$WORK" && mkdir -p "$WORK"

step() {
  local n=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$n.log" 2>&1
  local rc=$?
  echo "rc=$rc $n $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  return $rc
}
{ date -u; uptime; df -h "$WORK" | tail -1; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tail -1
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'; } > "$OUT/machine.txt" 2>&1

if [ $dry = 0 ] && ! ls .device/python/pacer/_pacer*.so >/dev/null 2>&1; then
  step module bash bench/device/module.sh build
fi
# pacer vet exits 1 when a check fails (a busy shared host): its figures are still what plan step needs.
step vet bash -c '"$0" vet --quick --json > "$1"; [ $? -le 1 ]' "$pacer" "$OUT/vet.json"
corpus=()
if [ -d .device/gpt-corpus ] && [ $dry = 0 ]; then
  for f in .device/gpt-corpus/*; do corpus+=(--input "$f"); done
fi
step prepare python3 examples/gpt/prepare.py "$WORK/prep" --vocab-size "$VOCAB" --max-mb "$MAXMB" "${corpus[@]}" \
  || { echo "prepare failed: see prepare.log" | tee -a "$OUT/steps.txt"; tar -C "$OUT" -czf "$OUT/logs.tgz" --exclude=logs.tgz .; exit 0; }

# NPROC ranks on this machine's GPUs (one each), started as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR/PORT), without torchrun (Debian's crashes on Python 3.11, so the CPU dry run could not use it).
NPROC=${NPROC:-1}
ranks() {
  [ "$NPROC" = 1 ] && exec "$@"
  local pids=() r rc=0
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 1000)) WORLD_SIZE=$NPROC
  for r in $(seq 0 $((NPROC - 1))); do RANK=$r LOCAL_RANK=$r "$@" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
export -f ranks
export NPROC
common=(--data "$WORK/prep/data" --config "$CONFIG" --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ"
        --dtype bfloat16 --device "$device" --warmup 20 --lr 3e-4 --keep-last 1 --mtbf "$MTBF" --restart-cost "$RESTART"
        --warmup-steps-timed 5 "${threads[@]}")
# The pacer loop under pacer monitor: GPU, CPU and I/O samples beside the steps, for pacer score and report.
step train-pacer "$pacer" monitor --db "$OUT/$name.db" --interval 1s -- \
  bash -c 'ranks "$@"' ranks python3 examples/gpt/train.py "${common[@]}" --ckpt "$WORK/ckpt-pacer" --summary "$OUT/pacer-summary.json"
every=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["ckpt_every"])' "$OUT/pacer-summary.json" 2>/dev/null || echo 50)
rm -rf "$WORK/ckpt-pacer"  # room on the disk for the usual loop's files
# The usual loop, saving after the same steps: the first save's step, then every $every steps, and the last.
step train-baseline bash -c 'ranks "$@"' ranks python3 examples/gpt/train.py "${common[@]}" --baseline --ckpt "$WORK/ckpt-torch" \
  --ckpt-every "$every" --first-save 10 --telemetry-db "$WORK/baseline.db" --summary "$OUT/baseline-summary.json"
rm -rf "$WORK/ckpt-torch"

step score "$pacer" score "$OUT/$name.db"
"$pacer" score "$OUT/$name.db" --json > "$OUT/score.json" 2>/dev/null
step plan-step python3 examples/gpt/plan.py step --config "$CONFIG" --vocab "$VOCAB" --seq-len "$SEQ" \
  --batch-size "$BATCH" --world "$NPROC" --vet "$OUT/vet.json" --summary "$OUT/pacer-summary.json"
python3 examples/gpt/plan.py step --config "$CONFIG" --vocab "$VOCAB" --seq-len "$SEQ" --batch-size "$BATCH" \
  --world "$NPROC" --vet "$OUT/vet.json" --summary "$OUT/pacer-summary.json" --json > "$OUT/plan-step.json" 2>/dev/null
# The `pacer plan step --json` document inside it: the report's MFU chart and goodput's planned step.
python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1]))["plan"], open(sys.argv[2], "w"), indent=1)' \
  "$OUT/plan-step.json" "$OUT/pacer-plan-step.json" 2>/dev/null
plan_opt=(); [ -s "$OUT/pacer-plan-step.json" ] && plan_opt=(--plan "$OUT/pacer-plan-step.json")
step report "$pacer" report "$OUT/$name.db" "${plan_opt[@]}" -o "$OUT/$name.html"
"$pacer" goodput "$OUT/$name.db" "${plan_opt[@]}" > "$OUT/goodput.txt" 2>&1
"$pacer" goodput "$OUT/$name.db" "${plan_opt[@]}" --json > "$OUT/goodput.json" 2>/dev/null
{ date -u; uptime; } >> "$OUT/machine.txt"
step compare python3 examples/gpt/compare.py --pacer "$OUT/pacer-summary.json" --baseline "$OUT/baseline-summary.json" \
  --plan "$OUT/plan-step.json" --score "$OUT/score.json" --name "$name-$(date -u +%Y-%m-%d)" --out "$OUT" \
  --machine "$(tr '\n' ' ' < "$OUT/machine.txt")"
cat "$OUT/compare.log"
rm -f "$OUT/$name.db-wal" "$OUT/$name.db-shm"
tar -C "$OUT" -czf "$WORK/logs.tgz" --exclude=logs.tgz --exclude="$name.db" . && mv "$WORK/logs.tgz" "$OUT/"
exit 0
