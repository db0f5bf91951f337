#!/usr/bin/env bash
# Side-by-side: pacer vet's memory-bandwidth and storage-throughput figures
# next to mbw and fio on the same patterns, plus the wall-clock time each tool
# takes to produce its figure (process start included).
#
#   bash bench/vet_peers.sh [BUILD_DIR]       (default BUILD_DIR: build)
#
# Environment:
#   ROUNDS=7            rounds; each round runs every tool once, order alternating
#   BENCH_DIR=DIR       where the storage tests write (default: a temporary
#                       directory under the repository root, removed at exit)
#   MBW_MEMCPY_FLAG=-tN the mbw flag that really runs memcpy (default: detected,
#                       see mbw_memcpy_flag below)
#
# Writes bench/results/vet_peers-YYYY-MM-DD.{json,md}; every other file it
# creates is removed on exit. See bench/README.md.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-build}
case $BUILD in
  /*) ;;
  *) if [[ -d $BUILD ]]; then BUILD=$(cd "$BUILD" && pwd); else BUILD=$REPO/$BUILD; fi ;;
esac
PACER=$BUILD/bin/pacer
ROUNDS=${ROUNDS:-7}
MEM_PROFILE=$REPO/bench/profiles/memory-copy-1t.toml
STOR_PROFILE=$REPO/bench/profiles/storage-seq.toml
RESULTS=$REPO/bench/results
DAY=$(date -u +%Y-%m-%d)
OUT_JSON=$RESULTS/vet_peers-$DAY.json
OUT_MD=$RESULTS/vet_peers-$DAY.md

die() { echo "vet_peers: $*" >&2; exit 1; }
[[ -x $PACER ]] || die "no pacer binary at $PACER (build first: make build, or pass the build directory)"
for tool in mbw fio python3; do command -v "$tool" >/dev/null || die "$tool not found (apt-get install $tool)"; done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"

# Everything temporary lives in two directories that the trap removes: RAW for
# tool outputs, SCRATCH for the storage test files.
RAW=$(mktemp -d "${TMPDIR:-/tmp}/vet_peers.XXXXXX")
if [[ -n ${BENCH_DIR:-} ]]; then
  mkdir -p "$BENCH_DIR"
  SCRATCH=$(mktemp -d "$BENCH_DIR/vet_peers.XXXXXX")
else
  SCRATCH=$(mktemp -d "$REPO/.vet_peers-scratch.XXXXXX")
fi
cleanup() { rm -rf -- "$RAW" "$SCRATCH"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# Sizes come from the bench profiles as pacer resolves them, so the peers are
# always run on exactly the same sizes.
"$PACER" vet --profile "$MEM_PROFILE" --show-profile >"$RAW/mem_profile.json"
"$PACER" vet --profile "$STOR_PROFILE" --show-profile >"$RAW/stor_profile.json"
read -r MEM_TOTAL MEM_REPS MEM_PATTERN MEM_THREADS < <(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))["params"]["memory.bandwidth"]["normal"]
print(p["size"], p["reps"], p["pattern"], p["threads"])' "$RAW/mem_profile.json")
read -r STOR_SIZE STOR_BLOCK < <(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))["params"]["storage"]["normal"]
print(p["size"], p["block"])' "$RAW/stor_profile.json")
[[ $MEM_PATTERN == copy && $MEM_THREADS == 1 ]] || die "$MEM_PROFILE must set pattern = \"copy\" and threads = 1"
# pacer's `size` is both arrays together; mbw's argument is one array, in MiB.
(( MEM_TOTAL % (2 * 1048576) == 0 )) || die "memory size must be a multiple of 2 MiB"
MBW_MIB=$(( MEM_TOTAL / 2 / 1048576 ))

# mbw 1.2.x (Debian 12 ships 1.2.2) has its test numbers crossed: its worker
# runs memcpy() for type 1 and the b[i]=a[i] loop for type 0, while the help
# text and the output label call -t0 "MEMCPY" and -t1 "DUMB". Upstream fixed
# this when it added the version banner to -h (1.4 prints "mbw memory
# benchmark v1.4"), so: banner present -> -t0 is memcpy; absent -> -t1 is.
mbw_memcpy_flag() {
  if [[ -n ${MBW_MEMCPY_FLAG:-} ]]; then echo "$MBW_MEMCPY_FLAG"
  elif mbw -h 2>&1 | grep -q 'memory benchmark v'; then echo -t0
  else echo -t1
  fi
}
MBW_FLAG=$(mbw_memcpy_flag)

PACER_MEM_CMD=("$PACER" vet --only memory.bandwidth --profile "$MEM_PROFILE" --json)
PACER_TRIAD_CMD=("$PACER" vet --only memory.bandwidth --json)
MBW_CMD=(mbw -q "$MBW_FLAG" -n "$MEM_REPS" "$MBW_MIB")
MBW_T0_CMD=(mbw -q -t0 -n "$MEM_REPS" "$MBW_MIB")
PACER_STOR_CMD=("$PACER" vet --only storage.write,storage.read --profile "$STOR_PROFILE" --path "$SCRATCH" --json)
FIO_FILE=$SCRATCH/fio-seq.dat
FIO_COMMON=(--filename="$FIO_FILE" --bs="$STOR_BLOCK" --size="$STOR_SIZE" --direct=1 --ioengine=psync --numjobs=1
            --output-format=json)
# fallocate=none: like pacer, write into a freshly created, unallocated file.
FIO_W_CMD=(fio --name=seqwrite --rw=write --end_fsync=1 --fallocate=none "${FIO_COMMON[@]}")
FIO_R_CMD=(fio --name=seqread --rw=read "${FIO_COMMON[@]}")

# timed NAME CMD...: runs CMD with stdout to $RAW/NAME.out, stderr to
# $RAW/NAME.err, and appends "NAME wall_seconds rc" to $RAW/times.
timed() {
  local name=$1; shift
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  "$@" >"$RAW/$name.out" 2>"$RAW/$name.err" || rc=$?
  t1=$(date +%s.%N)
  echo "$name $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.6f", b - a }') $rc" >>"$RAW/times"
}

start=$(date +%s)
echo "vet_peers: $ROUNDS rounds; memory: 2 x $MBW_MIB MiB copy (mbw $MBW_FLAG), storage: $((STOR_SIZE / 1048576)) MiB in $((STOR_BLOCK / 1048576)) MiB blocks on $SCRATCH"
for ((r = 1; r <= ROUNDS; r++)); do
  echo "  round $r/$ROUNDS"
  # Alternate who goes first, so neither tool always runs on a warmer machine.
  if (( r % 2 )); then mem_order=(pacer mbw); stor_order=(pacer fio); else mem_order=(mbw pacer); stor_order=(fio pacer); fi
  for who in "${mem_order[@]}"; do
    if [[ $who == pacer ]]; then timed "mem_pacer_$r" "${PACER_MEM_CMD[@]}"
    else timed "mem_mbw_$r" "${MBW_CMD[@]}"; fi
  done
  # For information: what `mbw -t0` (labelled MEMCPY) gives, and pacer's default
  # multi-threaded triad.
  timed "mem_mbwt0_$r" "${MBW_T0_CMD[@]}"
  timed "mem_triad_$r" "${PACER_TRIAD_CMD[@]}"
  for who in "${stor_order[@]}"; do
    if [[ $who == pacer ]]; then
      timed "stor_pacer_$r" "${PACER_STOR_CMD[@]}"
    else
      rm -f -- "$FIO_FILE"
      timed "stor_fiow_$r" "${FIO_W_CMD[@]}"
      timed "stor_fior_$r" "${FIO_R_CMD[@]}"
      rm -f -- "$FIO_FILE"
    fi
  done
done
echo "vet_peers: measured in $(( $(date +%s) - start )) s"

# Machine facts.
FS_MAGIC=$(stat -f -c %T "$SCRATCH")
FS_TYPE=$(findmnt -no FSTYPE -T "$SCRATCH" 2>/dev/null || true)
CPU_MODEL=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
PACER_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$REPO" diff --quiet HEAD -- src include apps 2>/dev/null || PACER_COMMIT="$PACER_COMMIT (+ uncommitted changes)"
MBW_VERSION=$(dpkg-query -W -f '${Version}' mbw 2>/dev/null || echo unknown)
FIO_VERSION=$(fio --version 2>/dev/null || echo unknown)
GLIBC_VERSION=$(ldd --version 2>/dev/null | awk 'NR==1{print $NF}')  # no head: SIGPIPE under pipefail
THP=$(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)

mkdir -p "$RESULTS"
export RAW ROUNDS OUT_JSON OUT_MD DAY MBW_FLAG MBW_MIB MEM_TOTAL MEM_REPS STOR_SIZE STOR_BLOCK \
  FS_MAGIC FS_TYPE CPU_MODEL PACER_COMMIT MBW_VERSION FIO_VERSION GLIBC_VERSION THP
export SCRATCH_DESC=$([[ -n ${BENCH_DIR:-} ]] && echo "$BENCH_DIR/vet_peers.XXXXXX" || echo "$REPO/.vet_peers-scratch.XXXXXX")
export CMD_PACER_MEM="${PACER_MEM_CMD[*]}" CMD_PACER_TRIAD="${PACER_TRIAD_CMD[*]}" CMD_MBW="${MBW_CMD[*]}" \
  CMD_MBW_T0="${MBW_T0_CMD[*]}" CMD_PACER_STOR="${PACER_STOR_CMD[*]}" CMD_FIO_W="${FIO_W_CMD[*]}" CMD_FIO_R="${FIO_R_CMD[*]}"
python3 - <<'PY'
import json, os, platform, re, socket, statistics, datetime

E = os.environ
raw = E["RAW"]
rounds = int(E["ROUNDS"])
times = {}
for line in open(os.path.join(raw, "times")):
    name, wall, rc = line.split()
    times[name] = (float(wall), int(rc))

def text(name, ext="out"):
    with open(os.path.join(raw, f"{name}.{ext}")) as f:
        return f.read()

def load_json(name):
    s = text(name)
    return json.loads(s[s.index("{"):])  # fio may print notes before its JSON

def check(report, name):
    for c in report["checks"]:
        if c["name"] == name:
            return c
    raise SystemExit(f"vet_peers: no {name} in pacer's report: {report.get('checks')}")

def mbw_iters(name):
    # "0\tMethod: MEMCPY\tElapsed: 0.05497\tMiB: 256.00000\tCopy: 4656.832 MiB/s"
    v = [float(m.group(1)) for m in re.finditer(r"^\d+\s+Method:.*Copy:\s*([0-9.]+) MiB/s", text(name), re.M)]
    if not v:
        raise SystemExit(f"vet_peers: no per-iteration lines in mbw output {name}: {text(name)!r} {text(name, 'err')!r}")
    return v

med = statistics.median
mib = 1048576
rows = []
for r in range(1, rounds + 1):
    pm = load_json(f"mem_pacer_{r}")
    pc = check(pm, "memory.bandwidth")
    tr = check(load_json(f"mem_triad_{r}"), "memory.bandwidth")
    mb = mbw_iters(f"mem_mbw_{r}")
    m0 = mbw_iters(f"mem_mbwt0_{r}")
    ps = load_json(f"stor_pacer_{r}")
    pw, pr = check(ps, "storage.write"), check(ps, "storage.read")
    fw = load_json(f"stor_fiow_{r}")["jobs"][0]
    fr = load_json(f"stor_fior_{r}")["jobs"][0]
    rows.append({
        "round": r,
        "memory": {
            "pacer_copy_GBps": pc["value"],
            "pacer_copy_MiBps_mbw_counting": pc["value"] * 1e9 / 2 / mib,
            "pacer_status": pc["status"], "pacer_detail": pc["reason"], "pacer_probe_s": pc["duration_s"],
            "pacer_wall_s": times[f"mem_pacer_{r}"][0], "pacer_rc": times[f"mem_pacer_{r}"][1],
            "mbw_memcpy_iter_MiBps": mb, "mbw_memcpy_median_MiBps": med(mb),
            "mbw_wall_s": times[f"mem_mbw_{r}"][0], "mbw_rc": times[f"mem_mbw_{r}"][1],
            "mbw_t0_iter_MiBps": m0, "mbw_t0_median_MiBps": med(m0), "mbw_t0_wall_s": times[f"mem_mbwt0_{r}"][0],
            "pacer_triad_default_GBps": tr["value"], "pacer_triad_detail": tr["reason"],
            "pacer_triad_wall_s": times[f"mem_triad_{r}"][0],
        },
        "storage": {
            "pacer_write_MBps": pw["value"], "pacer_read_MBps": pr["value"],
            "pacer_write_status": pw["status"], "pacer_read_status": pr["status"],
            "pacer_detail": pw["reason"], "pacer_probe_s": pw["duration_s"],
            "pacer_wall_s": times[f"stor_pacer_{r}"][0], "pacer_rc": times[f"stor_pacer_{r}"][1],
            "fio_write_MBps": fw["write"]["bw_bytes"] / 1e6, "fio_write_runtime_ms": fw["write"]["runtime"],
            "fio_write_io_bytes": fw["write"]["io_bytes"], "fio_write_wall_s": times[f"stor_fiow_{r}"][0],
            "fio_read_MBps": fr["read"]["bw_bytes"] / 1e6, "fio_read_runtime_ms": fr["read"]["runtime"],
            "fio_read_io_bytes": fr["read"]["io_bytes"], "fio_read_wall_s": times[f"stor_fior_{r}"][0],
            "fio_rc": [times[f"stor_fiow_{r}"][1], times[f"stor_fior_{r}"][1]],
        },
    })

def col(section, key):
    return [x[section][key] for x in rows]

def ratio(a, b):
    return a / b if b else None

M = {k: med(col("memory", k)) for k in rows[0]["memory"] if isinstance(rows[0]["memory"][k], (int, float))}
S = {k: med(col("storage", k)) for k in rows[0]["storage"] if isinstance(rows[0]["storage"][k], (int, float))}
fio_wall = med([x["storage"]["fio_write_wall_s"] + x["storage"]["fio_read_wall_s"] for x in rows])

def verdict(fig_ratio, time_ratio):
    ok_fig = fig_ratio is not None and abs(fig_ratio - 1) <= 0.10
    ok_time = time_ratio is not None and time_ratio < 1
    return ("within 10%" if ok_fig else "OFF by more than 10%") + ", " + ("faster" if ok_time else "NOT faster")

comparisons = [
    {"figure": f"memory copy, 1 thread, 2 x {E['MBW_MIB']} MiB (MiB/s, mbw counting)",
     "pacer": M["pacer_copy_MiBps_mbw_counting"], "peer": M["mbw_memcpy_median_MiBps"], "peer_tool": f"mbw {E['MBW_FLAG']} (memcpy)",
     "pacer_wall_s": M["pacer_wall_s"], "peer_wall_s": M["mbw_wall_s"]},
    {"figure": f"storage sequential write, {int(E['STOR_SIZE'])//mib} MiB, {int(E['STOR_BLOCK'])//mib} MiB O_DIRECT (MB/s)",
     "pacer": S["pacer_write_MBps"], "peer": S["fio_write_MBps"], "peer_tool": "fio rw=write",
     "pacer_wall_s": S["pacer_wall_s"], "peer_wall_s": fio_wall},
    {"figure": f"storage sequential read, {int(E['STOR_SIZE'])//mib} MiB, {int(E['STOR_BLOCK'])//mib} MiB O_DIRECT (MB/s)",
     "pacer": S["pacer_read_MBps"], "peer": S["fio_read_MBps"], "peer_tool": "fio rw=read",
     "pacer_wall_s": S["pacer_wall_s"], "peer_wall_s": fio_wall},
]
for c in comparisons:
    c["ratio"] = ratio(c["pacer"], c["peer"])
    c["time_ratio"] = ratio(c["pacer_wall_s"], c["peer_wall_s"])
    c["verdict"] = verdict(c["ratio"], c["time_ratio"])

info = {
    "mbw_t0_labelled_MEMCPY_median_MiBps": M["mbw_t0_median_MiBps"],
    "pacer_copy_over_mbw_t0": ratio(M["pacer_copy_MiBps_mbw_counting"], M["mbw_t0_median_MiBps"]),
    "mbw_t0_wall_s": M["mbw_t0_wall_s"],
    "pacer_triad_default_GBps": M["pacer_triad_default_GBps"],
    "pacer_triad_wall_s": M["pacer_triad_wall_s"],
}

now = datetime.datetime.now(datetime.timezone.utc)
doc = {
    "benchmark": "vet_peers",
    "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": {
        "hostname": socket.gethostname(), "nproc": os.cpu_count(), "cpu_model": E["CPU_MODEL"],
        "kernel": platform.release(), "glibc": E["GLIBC_VERSION"], "thp_enabled": E["THP"],
        "storage_path": E["SCRATCH_DESC"], "fs_type_stat": E["FS_MAGIC"], "fs_type_mount": E["FS_TYPE"],
    },
    "tools": {"pacer_commit": E["PACER_COMMIT"], "mbw": E["MBW_VERSION"], "fio": E["FIO_VERSION"],
              "mbw_memcpy_flag": E["MBW_FLAG"]},
    "params": {"rounds": rounds, "memory_total_bytes": int(E["MEM_TOTAL"]), "mbw_array_MiB": int(E["MBW_MIB"]),
               "memory_passes": int(E["MEM_REPS"]), "storage_size_bytes": int(E["STOR_SIZE"]),
               "storage_block_bytes": int(E["STOR_BLOCK"])},
    "commands": {
        "pacer_memory": E["CMD_PACER_MEM"], "mbw_memcpy": E["CMD_MBW"], "mbw_t0_info": E["CMD_MBW_T0"],
        "pacer_triad_info": E["CMD_PACER_TRIAD"], "pacer_storage": E["CMD_PACER_STOR"],
        "fio_write": E["CMD_FIO_W"], "fio_read": E["CMD_FIO_R"],
    },
    "counting": {
        "pacer_memory": "copy GB/s = 2 x array bytes (read + write) / s / 1e9; converted to mbw counting as GB/s * 1e9 / 2 / 2^20",
        "mbw": "MiB/s = one array's MiB / s of one memcpy; per-iteration figures, median taken here",
        "pacer_storage": "MB/s = bytes / s / 1e6; the write time includes the final fsync",
        "fio": "bw_bytes / 1e6 (MB/s); end_fsync=1 on the write job",
        "wall_s": "date +%s.%N around each process, start and exit included; pacer storage is one process for write + read, "
                  "compared with fio write + fio read",
    },
    "medians": {"memory": M, "storage": S, "fio_write_plus_read_wall_s": fio_wall},
    "comparisons": comparisons,
    "info": info,
    "rounds": rows,
}
with open(E["OUT_JSON"], "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")

def f1(x): return "n/a" if x is None else f"{x:,.1f}"
def f2(x): return "n/a" if x is None else f"{x:.2f}"
def f3(x): return "n/a" if x is None else f"{x:.3f}"
m = doc["machine"]
md = [
    f"# pacer vet vs mbw and fio, {E['DAY']}",
    "",
    f"Machine: `{m['hostname']}`, {m['nproc']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, glibc {m['glibc']}, "
    f"THP `{m['thp_enabled']}`; storage on {m['fs_type_mount'] or m['fs_type_stat']} (`stat -f`: {m['fs_type_stat']}).",
    f"Tools: pacer {doc['tools']['pacer_commit']}, mbw {doc['tools']['mbw']}, {doc['tools']['fio']}. "
    f"{rounds} rounds, tools alternating; medians shown. Generated by `bash bench/vet_peers.sh`; raw numbers in "
    f"`{os.path.basename(E['OUT_JSON'])}`.",
    "",
    "| figure | pacer | peer | pacer/peer | pacer s | peer s | time ratio | verdict |",
    "|---|---:|---:|---:|---:|---:|---:|---|",
]
for c in comparisons:
    md.append(f"| {c['figure']} vs {c['peer_tool']} | {f1(c['pacer'])} | {f1(c['peer'])} | {f3(c['ratio'])} | "
              f"{f2(c['pacer_wall_s'])} | {f2(c['peer_wall_s'])} | {f2(c['time_ratio'])} | {c['verdict']} |")
md += [
    "",
    "Times are wall-clock seconds per process, start to exit. Storage: pacer measures write and read in one process, so "
    "both storage rows compare it with fio's write job plus its read job.",
    "",
    "For information:",
    "",
    f"- `mbw -t0` (labelled MEMCPY): {f1(info['mbw_t0_labelled_MEMCPY_median_MiBps'])} MiB/s, "
    f"pacer copy / that = {f3(info['pacer_copy_over_mbw_t0'])}. In mbw 1.2.x `-t0` runs the element-wise "
    "`b[i]=a[i]` loop, not memcpy (its worker tests `type==1` for memcpy while the label and help say 0); "
    f"the memcpy figure above comes from `mbw {E['MBW_FLAG']}`.",
    f"- pacer's default `memory.bandwidth` (triad, all CPUs, built-in sizes): {f2(info['pacer_triad_default_GBps'])} GB/s "
    f"(STREAM counting), {f2(info['pacer_triad_wall_s'])} s.",
    "",
    "## Commands",
    "",
    "```",
    *[f"{k}: {v}" for k, v in doc["commands"].items()],
    "```",
    "",
    "## Per round",
    "",
    "| round | pacer copy MiB/s | mbw memcpy MiB/s | mbw -t0 MiB/s | pacer triad GB/s | pacer write MB/s | fio write MB/s | "
    "pacer read MB/s | fio read MB/s | pacer mem s | mbw s | pacer stor s | fio w+r s |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]
for x in rows:
    a, s = x["memory"], x["storage"]
    md.append(f"| {x['round']} | {f1(a['pacer_copy_MiBps_mbw_counting'])} | {f1(a['mbw_memcpy_median_MiBps'])} | "
              f"{f1(a['mbw_t0_median_MiBps'])} | {f2(a['pacer_triad_default_GBps'])} | {f1(s['pacer_write_MBps'])} | "
              f"{f1(s['fio_write_MBps'])} | {f1(s['pacer_read_MBps'])} | {f1(s['fio_read_MBps'])} | {f2(a['pacer_wall_s'])} | "
              f"{f2(a['mbw_wall_s'])} | {f2(s['pacer_wall_s'])} | {f2(s['fio_write_wall_s'] + s['fio_read_wall_s'])} |")
with open(E["OUT_MD"], "w") as f:
    f.write("\n".join(md) + "\n")
print("\n".join(md[:len(comparisons) + 8]))
PY
echo "vet_peers: wrote $OUT_JSON and $OUT_MD"
