"""The first open of many never-indexed tar shards, against a Python `tarfile` scan of the same shards,
for one or more pacer builds side by side, on a file system that has just deleted many files.

Usage: /usr/bin/python3 bench/first_open.py [--shards 10000] [--rounds 5] [--churn 40000]
           [--build NAME=PYTHONPATH ...] [--name NAME]
Writes bench/results/NAME.{json,md} (default NAME: first_open-DATE).

Each round first creates and deletes --churn small files in the scratch directory (as a run that
wrote and removed its shards and indexes does; 0: none), then runs every contender, in an order that
rotates from round to round, each in a process of its own on a fresh directory of hard links to the
same shards (never indexed there; links allocate no inodes), timing only the open or the scan:
- `tarfile`: every shard opened with `tarfile.open` and its members listed;
- `pacer:NAME`: `pacer.data.open(spec)` of that build (it builds and writes every index), and the
  next open of the same directory (`warm`).
The page cache is warm for all: the shards are read once before the first round.
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
import time

CHILD = r"""
import os, sys, tarfile, time
who, d, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
paths = [os.path.join(d, f"m-{i:06d}.tar") for i in range(n)]
if who == "tarfile":
    t0 = time.perf_counter()
    count = 0
    for p in paths:
        with tarfile.open(p) as t:
            count += len(t.getmembers()) // 2
    print(time.perf_counter() - t0, 0.0, count)
else:
    import pacer.data
    spec = os.path.join(d, "m-{%06d..%06d}.tar" % (0, n - 1))
    t0 = time.perf_counter()
    count = len(pacer.data.open(spec))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert len(pacer.data.open(spec)) == count
    print(first, time.perf_counter() - t0, count)
"""


def make_shards(root, n):
    """Tiny two-member shards: the cost measured is per shard, not per byte."""
    src = os.path.join(root, "src")
    os.makedirs(src)
    for i in range(n):
        with tarfile.open(os.path.join(src, f"m-{i:06d}.tar"), "w", format=tarfile.GNU_FORMAT) as tar:
            for ext in ("txt", "json"):
                data = f"sample {i} {ext}".encode()
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    subprocess.run(["cat"] + [os.path.join(src, f"m-{i:06d}.tar") for i in range(n)], stdout=subprocess.DEVNULL, check=True)
    return src


def churn(root, files):
    """Creates and deletes `files` small files: the state a run that removed its outputs leaves."""
    if not files:
        return
    d = os.path.join(root, "churn")
    os.makedirs(d)
    for i in range(files):
        with open(os.path.join(d, f"c{i}"), "wb") as f:
            f.write(b"x")
    shutil.rmtree(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--churn", type=int, default=40000)
    ap.add_argument("--build", action="append", default=[], metavar="NAME=PYTHONPATH",
                    help="a pacer build to time (default: this tree's build/python as 'new')")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    builds = {k: os.path.abspath(v) for k, v in (b.split("=", 1) for b in args.build)} or {"new": os.path.join(repo, "build", "python")}
    contenders = ["tarfile"] + [f"pacer:{b}" for b in builds]
    scratch = tempfile.mkdtemp(prefix=".first-open-", dir=repo)
    rows = {c: [] for c in contenders}
    warm = {c: [] for c in contenders if c != "tarfile"}
    loads = []
    try:
        src = make_shards(scratch, args.shards)
        for r in range(args.rounds):
            churn(scratch, args.churn)
            loads.append(os.getloadavg()[0])
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                d = os.path.join(scratch, f"r{r}-{c.replace(':', '-')}")
                os.makedirs(d)
                for i in range(args.shards):
                    name = f"m-{i:06d}.tar"
                    os.link(os.path.join(src, name), os.path.join(d, name))
                env = dict(os.environ)
                if c != "tarfile":
                    env["PYTHONPATH"] = builds[c.split(":", 1)[1]]
                out = subprocess.run([sys.executable, "-c", CHILD, c, d, str(args.shards)], env=env, check=True,
                                     capture_output=True, text=True).stdout.split()
                first, again, count = float(out[0]), float(out[1]), int(out[2])
                assert count == args.shards, (c, count)
                rows[c].append(first)
                if c != "tarfile":
                    warm[c].append(again)
            # The round's directories and their indexes go: the next round's churn adds to it.
            for c in contenders:
                shutil.rmtree(os.path.join(scratch, f"r{r}-{c.replace(':', '-')}"))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c} {v[-1]:.3f} s" for c, v in rows.items()), flush=True)
        loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {c: statistics.median(v) for c, v in rows.items()}
    result = {
        "schema": "pacer.bench.first_open/1",
        "date": datetime.date.today().isoformat(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "shards": args.shards, "rounds": args.rounds, "churn_files": args.churn, "builds": builds,
        "first_open_s": rows, "median_s": med, "spread_s": {c: [min(v), max(v)] for c, v in rows.items()},
        "warm_open_s": warm, "warm_median_s": {c: statistics.median(v) for c, v in warm.items()},
        "vs_tarfile": {c: med[c] / med["tarfile"] for c in contenders if c != "tarfile"},
        "load_avg_1m": loads,
        "command": "/usr/bin/python3 bench/first_open.py " + f"--shards {args.shards} --rounds {args.rounds} --churn {args.churn}"
                   + "".join(f" --build {b}=..." for b in builds),
    }
    name = args.name or f"first_open-{result['date']}"
    out = os.path.join(repo, "bench", "results", name)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    md = [f"# First open of {args.shards} never-indexed shards against a `tarfile` scan, {result['date']}", "",
          f"Machine: `{platform.node()}`, {os.cpu_count()} CPUs, kernel {platform.release()}; {result['time_utc']} UTC at the end. "
          f"{args.rounds} rounds in rotating order, each after creating and deleting {args.churn} files; every contender in a "
          f"process of its own on a fresh directory of hard links; medians. Load average (1 min) at each round's start and "
          f"at the end: {', '.join(f'{x:.1f}' for x in loads)}. `{result['command']}`.", "",
          "| contender | first open s [min-max] | / tarfile | next open s |", "|---|---:|---:|---:|"]
    for c in contenders:
        ratio = f"{result['vs_tarfile'][c]:.2f}" if c != "tarfile" else "1"
        nxt = f"{result['warm_median_s'][c]:.3f}" if c != "tarfile" else ""
        md.append(f"| {c} | {med[c]:.3f} [{min(rows[c]):.3f}-{max(rows[c]):.3f}] | {ratio} | {nxt} |")
    md += ["", "Builds: " + ", ".join(f"`{b}` = `{p}`" for b, p in builds.items()) + "."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
