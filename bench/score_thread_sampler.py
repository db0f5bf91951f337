#!/usr/bin/env python3
"""What the per-thread sampler costs: `pacer monitor` over a process of many threads, with and without it.

Runs `pacer monitor --no-gpu --interval I --json -- PYTHON -c CHILD` where the child starts --threads
threads (one spins, the rest sleep on a lock) and lives --seconds; alternately with and without
--no-threads, --rounds times each. The monitor's own CPU time per sampling pass (sampler_cpu_s / samples
of pacer.monitor/1) is the figure: the medians of both and their difference, the thread sampler's cost
per pass. Writes bench/results/NAME-DATE.json and .md (machine, load before/after).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import threading, time, sys
n, seconds = int(sys.argv[1]), float(sys.argv[2])
stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1
ts = [threading.Thread(target=stop.wait) for _ in range(n - 2)] + [threading.Thread(target=spin)]
[t.start() for t in ts]
time.sleep(seconds)
stop.set()
[t.join() for t in ts]
"""


def once(args, threads_on, db):
    cmd = [args.pacer, "monitor", "--no-gpu", "--interval", args.interval, "--db", db, "--json", "-q"]
    if not threads_on:
        cmd.append("--no-threads")
    cmd += ["--", sys.executable, "-c", CHILD, str(args.threads), str(args.seconds)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    j = json.loads(r.stdout)
    return 1e6 * j["sampler_cpu_s"] / max(1, j["samples"]), j["samples"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=128, help="threads of the monitored process (main thread included)")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--interval", default="100ms")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pacer", default=os.path.join(HERE, "../build/bin/pacer"))
    p.add_argument("--name", default="score_thread_sampler-" + platform.node().split(".")[0])
    args = p.parse_args()
    load_before = os.getloadavg()
    per_pass = {"with_threads": [], "without": []}
    passes = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            for on in ((True, False) if i % 2 == 0 else (False, True)):  # alternated, so drift hits both
                us, n = once(args, on, os.path.join(d, "r%d-%d.db" % (i, on)))
                per_pass["with_threads" if on else "without"].append(us)
                passes.append(n)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in per_pass.items()}
    spread = {k: [min(v), max(v)] for k, v in per_pass.items()}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    result = {"schema": "pacer.bench.score_thread_sampler/1", "date": date, "host": platform.node(),
              "cpus": os.cpu_count(), "threads": args.threads, "seconds": args.seconds, "interval": args.interval,
              "rounds": args.rounds, "passes_per_run": statistics.median(passes),
              "monitor_cpu_us_per_pass": per_pass, "median_us_per_pass": med, "min_max_us_per_pass": spread,
              "thread_sampler_us_per_pass": med["with_threads"] - med["without"],
              "load_before": load_before, "load_after": load_after,
              "command": "python3 bench/score_thread_sampler.py " + " ".join(sys.argv[1:])}
    out = os.path.join(HERE, "results", "%s-%s" % (args.name, date))
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    md = ["# Thread sampler cost (%s, %s)" % (platform.node(), date), "",
          "`pacer monitor --no-gpu --interval %s` over a Python process of %d threads (one spinning), %s s per run, "
          "%d rounds alternated; the monitor's CPU time per sampling pass (median, min-max). Load %.2f before, %.2f after."
          % (args.interval, args.threads, args.seconds, args.rounds, load_before[0], load_after[0]), "",
          "| monitor | µs of CPU per pass | min-max |", "|---|---:|---|"]
    for k in ("without", "with_threads"):
        md.append("| %s | %.0f | %.0f-%.0f |" % ("with the thread sampler" if k == "with_threads" else "--no-threads", med[k], *spread[k]))
    md += ["", "Thread sampler: %.0f µs per pass over %d threads." % (result["thread_sampler_us_per_pass"], args.threads)]
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
