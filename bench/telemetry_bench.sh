#!/usr/bin/env bash
# Telemetry benchmarks: sampler overhead at 1 Hz and 10 Hz (CPU time of the
# monitor process over a run, as % of one core), catalog ingest rate, and
# named-question times on a 10-million-sample catalog. Results go to
# bench/results/telemetry-DATE.{json,md}. Usage: bash bench/telemetry_bench.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SAMPLES=${SAMPLES:-10000000}
RUN_1HZ=${RUN_1HZ:-60}      # seconds of sampling at 1 Hz
RUN_10HZ=${RUN_10HZ:-30}    # seconds of sampling at 10 Hz
cmake --build "$BUILD" --target pacer_cli telemetry_bench -j"$(nproc)" >/dev/null
work=$(mktemp -d "${BENCH_DIR:-$PWD}/.telemetry-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
day=$(date -u +%Y-%m-%d)
out=bench/results/telemetry-$day

overhead() {  # interval seconds -> the monitor's pacer.monitor/1 summary
  "$BUILD/bin/pacer" monitor --interval "$1" --db "$work/overhead-$1.db" --json -q -- sleep "$2"
}
echo "telemetry bench: sampler overhead at 1 Hz for ${RUN_1HZ}s, 10 Hz for ${RUN_10HZ}s" >&2
o1=$(overhead 1s "$RUN_1HZ")
o10=$(overhead 100ms "$RUN_10HZ")
echo "telemetry bench: ingest and queries on $SAMPLES samples" >&2
cat_json=$("$BUILD/bin/telemetry_bench" "$work" "$SAMPLES")

O1="$o1" O10="$o10" CAT="$cat_json" OUT="$out" DAY="$day" /usr/bin/python3 - <<'PY'
import json, os, platform, socket, subprocess
o1, o10, cat = (json.loads(os.environ[k]) for k in ("O1", "O10", "CAT"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
gpus = subprocess.run(["sh", "-c", "nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c"],
                      capture_output=True, text=True).stdout.strip() or "none"
machine = {"host": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(), "gpus": gpus, "kernel": platform.release()}
res = {"schema": "pacer.bench.telemetry/1", "date": os.environ["DAY"], "machine": machine,
       "overhead": {"1hz": o1, "10hz": o10}, "catalog": cat}
json.dump(res, open(os.environ["OUT"] + ".json", "w"), indent=2)
def pct(o): return f"{o['sampler_core_percent']:.3f}% ({o['sampler_cpu_s']:.3f} s CPU over {o['wall_s']:.1f} s, {o['samples']} passes, {o['readings']} values)"
lines = [f"# Telemetry bench, {os.environ['DAY']}", "",
         f"Machine: {machine['host']}, {machine['cpu']}, {machine['cpus']} CPUs, GPUs: {machine['gpus']}, kernel {machine['kernel']}.", "",
         "| figure | result | target |", "|---|---|---|",
         f"| sampler overhead at 1 Hz | {pct(o1)} | < 0.5% of one core |",
         f"| sampler overhead at 10 Hz | {pct(o10)} | < 2% of one core |",
         f"| ingest, samples | {cat['ingest_samples_per_s']:.0f} values/s ({cat['samples']} values, one transaction per node pass of 120) | |",
         f"| ingest, steps | {cat['ingest_steps_per_s']:.0f} steps/s ({cat['steps']} steps, {cat['ranks']} ranks, step time derived) | |",
         f"| catalog size | {cat['catalog_bytes'] / 1e6:.0f} MB for {cat['samples']} values ({cat['catalog_bytes'] / cat['samples']:.1f} B each) | |",
         "", "| query on the catalog above | rows | median of 3 (s) |", "|---|---|---|"]
lines += [f"| `{q['query']}` | {q['rows']} | {q['median_s']:.3f} |" for q in cat["queries"]]
notes = sorted(set(o1["notes"] + o10["notes"]))
if notes:
    lines += ["", "Sources skipped on this machine: " + "; ".join(notes) + "."]
open(os.environ["OUT"] + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
