#!/bin/bash
# examples/gpt as a Slurm job: every rank through srun, the whole job under `pacer run --monitor`
# (checkpoint before the time limit, requeue, restart after a crash, the vet gate), and when the
# training has finished: pacer score, pacer report and pacer plan step beside the measured step.
#
#   sbatch examples/gpt/sbatch.sh                       # from the directory holding examples/gpt (or from a copy of it)
#   CONFIG=1b STEPS=20000 SEQ=2048 TRAIN_ARGS="--dtype bfloat16" sbatch --ntasks=8 --gpus-per-node=8 --time=4:00:00 examples/gpt/sbatch.sh
#
# Settings (environment, all optional): DATA (prepare.py's OUT/data), OUT (the job's directory: ckpt/,
# the catalog, the report), CONFIG, STEPS, BATCH, SEQ, TRAIN_ARGS (more train.py options), RUN_ARGS
# (more pacer run options), BEFORE (pacer run --before; at least the --signal lead below), VET_SKIP
# (checks the vet gate leaves out, e.g. system.load on a shared test machine), EXAMPLE_DIR (where train.py
# is), PYTHON, PACER.
#SBATCH --job-name=gpt
#SBATCH --ntasks=2
#SBATCH --time=30
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -u
# Slurm runs a copy of this script from its spool: the example's files are found from where sbatch ran.
if [ -n "${EXAMPLE_DIR:-}" ]; then here=$EXAMPLE_DIR
elif [ -f "${SLURM_SUBMIT_DIR:-.}/train.py" ]; then here=${SLURM_SUBMIT_DIR:-.}
else here=${SLURM_SUBMIT_DIR:-.}/examples/gpt; fi
here=$(cd "$here" && pwd) || exit 2
PYTHON=${PYTHON:-python3}
PACER=${PACER:-${PACER_BIN:-pacer}}
OUT=${OUT:-${SLURM_SUBMIT_DIR:-.}/gpt-${SLURM_JOB_ID:-local}}
DATA=${DATA:-$OUT/prep/data}
CONFIG=${CONFIG:-tiny} STEPS=${STEPS:-200} BATCH=${BATCH:-8} SEQ=${SEQ:-128}
BEFORE=${BEFORE:-3m}
mkdir -p "$OUT"
export PACER_BIN=$PACER
# torch.distributed's rendezvous: the job's first node, a port of this job's own (pacer ports).
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -1)}
export MASTER_PORT=${MASTER_PORT:-$("$PACER" ports --local-rank 0 | head -1)}
if [ ! -e "$DATA.idx" ]; then  # once per job, not per rank: the first allocation prepares the data
  "$PYTHON" "$here/prepare.py" "$(dirname "$DATA")" || exit $?
fi
vet=(--vet quick)
[ -n "${VET_SKIP:-}" ] && vet+=(--vet-skip "$VET_SKIP")

# The time-limit warning (--signal=B:USR1) comes to this shell. Ignored until pacer run is started (the
# ignored disposition is what pacer run inherits, until it installs its own handler), then passed on to it;
# a warning that comes before is lost, and --before (from Slurm's end time) makes up for it (docs/run.md).
trap '' USR1
"$PACER" run --ckpt-dir "$OUT/ckpt" --before "$BEFORE" --requeue scontrol "${vet[@]}" \
    --monitor --monitor-db "$OUT/gpt.db" --log "$OUT/run.jsonl" ${RUN_ARGS:-} -- \
  srun --kill-on-bad-exit=1 "$PYTHON" "$here/train.py" --data "$DATA" --ckpt "$OUT/ckpt" --config "$CONFIG" \
    --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ" --summary "$OUT/summary.json" ${TRAIN_ARGS:-} &
pid=$!
trap 'kill -USR1 $pid 2>/dev/null' USR1
while kill -0 $pid 2>/dev/null; do wait $pid; done
wait $pid
rc=$?
[ $rc = 0 ] || exit $rc  # 75: checkpointed and requeued; else the failure pacer run gave up on

# Finished: how saturated the run kept the machine, its report, and pacer's step-time model beside the measurement.
"$PACER" score "$OUT/gpt.db"
"$PACER" report "$OUT/gpt.db" -o "$OUT/report.html"
vocab=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab"])' "$OUT/summary.json")
"$PACER" vet --quick --json > "$OUT/vet.json" 2>/dev/null
"$PYTHON" "$here/plan.py" step --config "$CONFIG" --vocab "$vocab" --seq-len "$SEQ" --batch-size "$BATCH" \
  --world "${SLURM_NTASKS:-1}" --vet "$OUT/vet.json" --summary "$OUT/summary.json" || true
echo "sbatch.sh: done; report $OUT/report.html"
