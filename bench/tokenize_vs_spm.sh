#!/usr/bin/env bash
# pacer shard tokenize next to SentencePiece's own encoders on the same text and model:
# spm_encode (the library's command-line tool, one thread), N spm_encode processes at once on
# N slices of the text (the library's many-core throughput on this host) and python3-sentencepiece's
# encode, against pacer on 1 thread and on every CPU. Rounds alternate the contenders.
#   bash bench/tokenize_vs_spm.sh [BUILD_DIR]      (default build; ROUNDS=5, MB=8; NAME=result file name,
#                                                   PACER_PYTHON=a python with sentencepiece, OUTDIR=results folder,
#                                                   TEXT_DIR=a folder of text files to use instead of Debian's,
#                                                   as bench/debian_text.py writes them)
# Without python sentencepiece (the GPU machine has none) its contender is left out.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
pacer=$build/bin/pacer
[ -x "$pacer" ] || { echo "no $pacer: build first" >&2; exit 2; }
command -v spm_train >/dev/null || { echo "needs spm_train/spm_encode (Debian: sentencepiece)" >&2; exit 2; }
py=${PACER_PYTHON:-/usr/bin/python3}  # a python with sentencepiece
[ -x "$py" ] || py=python3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pacer-tokbench-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export ROUNDS=${ROUNDS:-5} MB=${MB:-8} PACER="$pacer" TMPD="$tmp" OUTDIR="${OUTDIR:-$here/results}" TEXT_DIR=${TEXT_DIR:-} HERE="$here"

# Real text Debian ships (bench/debian_text.py: copyright files, licenses, then changelogs), whole
# files in order, cut at MB MiB (at a line end); the model is trained on its first 2 MiB.
$py - <<'PY'
import os, sys
sys.path.insert(0, os.environ["HERE"])
import debian_text
out = debian_text.text(int(os.environ["MB"]) << 20, os.environ["TEXT_DIR"])
open(os.environ["TMPD"] + "/text.txt", "wb").write(out)
open(os.environ["TMPD"] + "/train.txt", "wb").write(out[: 2 << 20])
PY
spm_train --input="$tmp/train.txt" --model_prefix="$tmp/tok" --vocab_size=8000 --model_type=bpe \
  --byte_fallback=true --minloglevel=2 >/dev/null 2>&1

$py - <<'PY'
import json, os, platform, statistics, subprocess, sys, time
try:
    import sentencepiece as spm
except ImportError:
    spm = None

tmp, pacer, rounds = os.environ["TMPD"], os.environ["PACER"], int(os.environ["ROUNDS"])
text, model = f"{tmp}/text.txt", f"{tmp}/tok.model"
size = os.path.getsize(text)
cpus = len(os.sched_getaffinity(0))
lines = [l for l in open(text, encoding="utf-8", errors="replace").read().split("\n") if l]
sp = spm.SentencePieceProcessor(model_file=model) if spm else None

def load():
    return os.getloadavg()[0]

def smt_siblings():
    """CPUs sharing CPU 0's core (e.g. "0,8": two hardware threads per core), as the kernel lists them."""
    try:
        return open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read().strip()
    except OSError:
        return None


def run(cmd):
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"{cmd[0]} exited {p.returncode}")
    run.cpu = ru.ru_utime + ru.ru_stime
    return time.perf_counter() - t

def spm_encode():
    return run(["spm_encode", f"--model={model}", "--output_format=id", f"--input={text}", f"--output={tmp}/ids.txt"])

# The text cut into `cpus` slices of about equal bytes at line ends, for as many spm_encode processes at once.
with open(text, "rb") as f:
    data = f.read()
slices, start = [], 0
for k in range(1, cpus + 1):
    end = len(data) if k == cpus else data.find(b"\n", len(data) * k // cpus) + 1 or len(data)
    slices.append(f"{tmp}/slice{k}.txt")
    with open(slices[-1], "wb") as f:
        f.write(data[start:end])
    start = max(start, end)
del data

def spm_encode_many():
    """Wall time from the first start to the last exit; CPU time of all of them."""
    t = time.perf_counter()
    procs = [subprocess.Popen(["spm_encode", f"--model={model}", "--output_format=id", f"--input={s}", f"--output={s}.ids"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for s in slices]
    cpu_s = 0.0
    for p in procs:
        _, status, ru = os.wait4(p.pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"spm_encode exited {os.waitstatus_to_exitcode(status)}")
        cpu_s += ru.ru_utime + ru.ru_stime
    run.cpu = cpu_s
    return time.perf_counter() - t

def py_encode():
    t, c = time.perf_counter(), time.process_time()
    for l in lines:
        sp.encode(l)
    run.cpu = time.process_time() - c
    return time.perf_counter() - t

def pacer_tok(threads):
    return lambda: run([pacer, "shard", "tokenize", text, f"{tmp}/out", "--model", model, "--threads", str(threads)])

many = f"spm_encode x {cpus} processes (a slice each, at once)"
contenders = {"spm_encode (1 thread)": spm_encode, many: spm_encode_many, "python sentencepiece encode (1 thread)": py_encode,
              "pacer tokenize --threads 1": pacer_tok(1), f"pacer tokenize --threads {cpus}": pacer_tok(cpus)}
if sp is None:
    del contenders["python sentencepiece encode (1 thread)"]
names = list(contenders)
times = {n: [] for n in names}
cpu = {n: [] for n in names}  # CPU seconds (user + system) per round
load_before, uptime_before = load(), subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
pacer_tok(1)()  # warm the page cache and the binary
for r in range(rounds):
    order = names[r % len(names):] + names[: r % len(names)]  # who goes first rotates
    for n in order:
        times[n].append(contenders[n]())
        cpu[n].append(run.cpu)
uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

def mbps(n):
    return [size / t / 1e6 for t in times[n]]

res = {n: {"median_MBps": statistics.median(mbps(n)), "min_MBps": min(mbps(n)), "max_MBps": max(mbps(n)),
           "seconds": times[n], "cpu_seconds": cpu[n],
           "MB_per_cpu_second": statistics.median(size / c / 1e6 for c in cpu[n])} for n in names}
ref = res["spm_encode (1 thread)"]["median_MBps"]
one = res["pacer tokenize --threads 1"]["median_MBps"]
alln = res[f"pacer tokenize --threads {cpus}"]["median_MBps"]
m = json.load(open(f"{tmp}/out.manifest.json"))
py_name = "python sentencepiece encode (1 thread)"
def vs_py(key):
    return res["pacer tokenize --threads 1"][key] / res[py_name][key] if py_name in res else None
out = {
    "schema": "pacer.bench.tokenize_vs_spm/1", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "machine": {"host": platform.node(), "cpus": cpus, "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
                "cpu0_thread_siblings": smt_siblings()},
    "load_before": uptime_before, "load_after": uptime_after,
    "text": {"source": (os.environ["TEXT_DIR"] + "/*" if os.environ["TEXT_DIR"] else "/usr/share/doc/*/copyright, /usr/share/common-licenses/*, /usr/share/doc/*/changelog*.gz") + ", name order", "bytes": size, "lines": len(lines),
             "documents": m["documents"], "tokens": m["tokens"]},
    "model": {"type": "bpe", "vocab_size": 8000, "trained_on_bytes": 2 << 20, "sentencepiece": spm.__version__ if spm else None},
    "rounds": rounds, "results": res,
    "ratios": {"pacer_1_thread_vs_spm_encode": one / ref,
               "pacer_1_thread_vs_python_encode": vs_py("median_MBps"),
               f"pacer_{cpus}_threads_vs_spm_encode": alln / ref,
               f"pacer_{cpus}_threads_per_core_vs_spm_encode": alln / ref / cpus,
               "scaling_all_vs_1_thread": alln / one,
               # Per CPU-second, which a loaded machine disturbs less than wall-clock rates: the work per core.
               "pacer_1_thread_per_cpu_second_vs_spm_encode": res["pacer tokenize --threads 1"]["MB_per_cpu_second"] / res["spm_encode (1 thread)"]["MB_per_cpu_second"],
               f"pacer_{cpus}_threads_per_cpu_second_vs_spm_encode": res[f"pacer tokenize --threads {cpus}"]["MB_per_cpu_second"] / res["spm_encode (1 thread)"]["MB_per_cpu_second"],
               "pacer_1_thread_per_cpu_second_vs_python_encode": vs_py("MB_per_cpu_second"),
               # What the host allows: the library's own tool on every CPU at once, against one alone; and pacer
               # against it, the many-core peer (a host whose CPUs share cores or slow down when all are busy
               # shows it in both).
               f"spm_encode_{cpus}_processes_vs_1": res[many]["median_MBps"] / ref,
               f"spm_encode_{cpus}_processes_per_core_vs_1": res[many]["median_MBps"] / ref / cpus,
               f"pacer_{cpus}_threads_vs_spm_encode_{cpus}_processes": alln / res[many]["median_MBps"],
               f"spm_encode_{cpus}_processes_per_cpu_second_vs_1": res[many]["MB_per_cpu_second"] / res["spm_encode (1 thread)"]["MB_per_cpu_second"]},
}
day = time.strftime("%Y-%m-%d", time.gmtime())
base = f"{os.environ['OUTDIR']}/" + (os.environ.get("NAME") or f"tokenize_vs_spm-{day}")
json.dump(out, open(base + ".json", "w"), indent=2)
md = [f"# pacer shard tokenize vs SentencePiece, {out['date']}", "",
      f"{out['machine']['cpu']}, {cpus} CPU(s) (CPU 0's core: CPUs {out['machine']['cpu0_thread_siblings']}). Text: {size/1e6:.1f} MB of Debian copyright files (then changelogs past ~26 MB), {len(lines)} lines "
      f"(= documents), BPE model of 8000 pieces. {rounds} rounds, contenders alternated; MB/s of input text.", "",
      f"Load before: `{uptime_before}`  ", f"Load after: `{uptime_after}`", "",
      "| contender | median MB/s | min | max | MB per CPU-second |", "|---|---|---|---|---|"]
md += [f"| {n} | {r['median_MBps']:.2f} | {r['min_MBps']:.2f} | {r['max_MBps']:.2f} | {r['MB_per_cpu_second']:.2f} |" for n, r in res.items()]
md += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in out["ratios"].items() if v is not None]
open(base + ".md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
