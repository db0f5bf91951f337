#!/usr/bin/env bash
# pacer's GradientReducer against PyTorch DDP (gloo) on the same synthetic backward, CPU ranks under mpirun.
# Usage: bash bench/comm_overlap.sh [BUILD_DIR]   (ROUNDS=7 by default)
# Writes bench/results/comm_overlap-DATE.json and .md.
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
/usr/bin/python3 - "$tmp" "$OUT" <<'PY'
import json, platform, subprocess, sys, datetime
tmp, out = sys.argv[1], sys.argv[2]
pacer = [json.loads(l) for l in open(f"{tmp}/pacer.jsonl")]
ddp = [json.loads(l) for l in open(f"{tmp}/ddp.jsonl")]
bench = json.load(open(f"{tmp}/bench.json"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
machine = {"host": platform.node(), "cpu": cpu, "cores": __import__("os").cpu_count(),
           "date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
           "note": "2 cores shared with other work; every figure is a median over rounds"}
json.dump({"machine": machine, "pacer": pacer, "ddp": ddp, "bench": bench}, open(out + ".json", "w"), indent=1)
rows = ["| ranks | compute | per layer | comm alone | compute alone | bucket | no overlap: hidden | pacer thread: hidden (finish wait) | pacer caller: hidden | DDP gloo: hidden |",
        "|---|---|---|---|---|---|---|---|---|---|"]
for p in pacer:
    d = next((d for d in ddp if (d["ranks"], d["compute"]) == (p["ranks"], p["compute"]) and abs(d["compute_s"] - p["compute_s"]) < 0.5 * p["compute_s"] and p["bucket_mib"] == 25 and d.get("_ms") is None), None)
    ms = round(p["compute_s"] / p["layers"] * 1000)
    rows.append(f"| {p['ranks']} | {p['compute']} | {ms} ms | {p['comm_s']*1e3:.0f} ms | {p['compute_s']*1e3:.0f} ms | {p['bucket_mib']:g} MiB | "
                f"{p['hidden_no_overlap']:.0%} | {p['hidden_thread']:.0%} ({p['finish_wait_thread_s']*1e3:.1f} ms) | {p['hidden_caller']:.0%} | "
                + (f"{d['hidden_ddp']:.0%} (comm {d['comm_s']*1e3:.0f} ms, compute {d['compute_s']*1e3:.0f} ms)" if d else "-") + " |")
ar = next(c for c in bench["collectives"] if c["name"] == "all_reduce")
md = [f"# comm overlap, {machine['date_utc'][:10]}", "",
      f"Machine: {machine['host']}, {machine['cpu']}, {machine['cores']} cores shared with other work. "
      f"Medians over rounds (ROUNDS={pacer[0]['rounds']}). 16 layers x 4 MiB fp32 gradients (64 MiB).", "",
      "hidden = 1 - (step time - compute alone) / communication alone; negative means overlapping cost more than it hid.", "",
      *rows, "",
      "pacer all_reduce + wait against MPI_Allreduce in the same run (busbw ratio, >= 0.95 is the target):", "",
      "| ranks | compute | 64 KiB | 1 MiB | 16 MiB |", "|---|---|---|---|---|"]
for p in pacer:
    if p["bucket_mib"] == 25 and round(p["compute_s"] / p["layers"] * 1000) >= 5:
        r = p["busbw_ratio_vs_mpi"]
        md.append(f"| {p['ranks']} | {p['compute']} | {r['65536']:.2f} | {r['1048576']:.2f} | {r['16777216']:.2f} |")
md += ["", f"pacer comm bench, 2 ranks, all_reduce fit: alpha {ar['fit']['alpha_s']*1e6:.2f} us, "
       f"{ar['fit']['bandwidth_gbps']:.2f} GB/s, R2 {ar['fit']['r2']:.3f}; largest size "
       f"{ar['points'][-1]['bytes']/2**20:.0f} MiB busbw {ar['points'][-1]['busbw_gbps']:.2f} GB/s."]
open(out + ".md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
