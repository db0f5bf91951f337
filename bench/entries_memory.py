"""What a dataset's index entries cost a process: the anonymous memory they take and the time to load
them (the first read of each shard), for one or more pacer builds side by side.

Usage: /usr/bin/python3 bench/entries_memory.py [--shards 16] [--per-shard 20000] [--rounds 5]
           --build NAME=PYTHONPATH [--build ...] [--name NAME]
Writes bench/results/NAME.{json,md} (default NAME: entries_memory-DATE).

The shards (two small fields per sample, `KEY.bin` and `KEY.json`, as loader_vs_torch.py writes them)
are written and indexed once. Each round runs every build, in an order that rotates from round to
round, in a process of its own: it opens the dataset (index headers only), then reads sample 0 of
every shard, which loads that shard's entries (the whole index, its fields checked against the
shard) and maps the shard. Measured in that process: the growth of its anonymous resident memory
(RssAnon) over those reads, per sample, and their wall time. The shards' own pages are file-backed
and not counted; the few samples read are.
"""
import argparse
import datetime
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile

CHILD = r"""
import json, sys, time
import pacer.data
def anon_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
ds = pacer.data.open(sys.argv[1])
starts, at = [], 0
for n in ds.shard_samples:
    starts.append(at)
    at += n
before = anon_kib()
t0 = time.perf_counter()
for s in starts:
    ds[s]
t = time.perf_counter() - t0
print(json.dumps({"samples": len(ds), "anon_kib": anon_kib() - before, "s": t}))
"""


def make_shards(root, shards, per_shard):
    for s in range(shards):
        with tarfile.open(os.path.join(root, f"e-{s:06d}.tar"), "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(s * per_shard, (s + 1) * per_shard):
                for ext, data in (("bin", os.urandom(64)), ("json", json.dumps({"label": i % 1000}).encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return os.path.join(root, "e-{%06d..%06d}.tar" % (0, shards - 1))


def run_child(pythonpath, spec):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--per-shard", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--build", action="append", required=True, metavar="NAME=PYTHONPATH")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    builds = dict(b.split("=", 1) for b in args.build)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=".entries-memory-", dir=repo)
    try:
        spec = make_shards(scratch, args.shards, args.per_shard)
        first = next(iter(builds.values()))
        run_child(first, spec)  # writes the indexes (and warms the page cache) outside the rounds
        rows = {name: [] for name in builds}
        loads = []
        names = list(builds)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in names[r % len(names):] + names[:r % len(names)]:
                got = run_child(builds[name], spec)
                assert got["samples"] == args.shards * args.per_shard, got
                rows[name].append(got)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {v[-1]['anon_kib'] / 1024:.1f} MiB {v[-1]['s'] * 1000:.1f} ms" for n, v in rows.items()), flush=True)
        loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    samples = args.shards * args.per_shard
    summary = {}
    for name, v in rows.items():
        per = sorted(x["anon_kib"] * 1024 / samples for x in v)
        ms = sorted(x["s"] * 1000 for x in v)
        summary[name] = {"bytes_per_sample_median": statistics.median(per), "bytes_per_sample_range": [per[0], per[-1]],
                         "load_ms_median": statistics.median(ms), "load_ms_range": [ms[0], ms[-1]]}
    result = {"schema": "pacer.bench.entries_memory/1", "date": datetime.date.today().isoformat(),
              "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M"),
              "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
              "builds": builds, "shards": args.shards, "per_shard": args.per_shard, "rounds": rows,
              "load_avg": [min(loads), max(loads)], "summary": summary}
    name = args.name or f"entries_memory-{result['date']}"
    out = os.path.join(repo, "bench", "results")
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Index entries in memory, {result['date']} {result['time_utc']} UTC",
             "", f"`{' '.join(sys.argv)}` on {result['machine']['host']} ({result['machine']['cpus']} CPUs, kernel "
             f"{result['machine']['kernel']}), load {min(loads):.1f}-{max(loads):.1f}.",
             f"{args.shards} shards x {args.per_shard} two-field samples; each build in a process of its own per round, "
             f"{args.rounds} rounds, the order rotating. Anonymous memory gained by loading every shard's entries "
             "(RssAnon, per sample) and the time of those loads; medians [min-max].", "",
             "| build | bytes per sample | load ms |", "|---|---:|---:|"]
    for build, s in summary.items():
        lines.append(f"| {build} | {s['bytes_per_sample_median']:.1f} [{s['bytes_per_sample_range'][0]:.1f}-{s['bytes_per_sample_range'][1]:.1f}] "
                     f"| {s['load_ms_median']:.1f} [{s['load_ms_range'][0]:.1f}-{s['load_ms_range'][1]:.1f}] |")
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
