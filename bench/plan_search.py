#!/usr/bin/env python3
"""Wall-clock time of `pacer plan search` (the issue's bound: 2 s for 4,096 GPUs).

Runs each case ROUNDS times, cases alternated round by round, and records the median, the spread and the
number of layouts each evaluated, with the machine, the date and `uptime` before and after, in
bench/results/plan_search-DATE.json and .md. There is no peer tool to run side by side: the planners that
search layouts (Calculon, Megatron's own estimators) are not packaged in Debian.

    python3 bench/plan_search.py build/bin/pacer [--rounds 7] [--out bench/results]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

CASES = [
    ("llama3-70b on 4096 h200", ["--model", "llama3-70b", "--gpu", "h200", "--gpus", "4096", "--global-batch", "2048", "--seq", "4096"]),
    ("apertus-70b on 4096 gh200", ["--model", "apertus-70b", "--gpu", "gh200", "--gpus", "4096", "--global-batch", "2048"]),
    ("llama3-405b on 16384 h100-sxm", ["--model", "llama3-405b", "--gpu", "h100-sxm", "--gpus", "16384", "--global-batch", "2048"]),
    ("mixtral-8x7b on 4096 h100-sxm", ["--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "4096", "--global-batch", "2048"]),
]


def uptime():
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pacer")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    before = uptime()
    times = {name: [] for name, _ in CASES}
    evaluated = {}
    for rnd in range(a.rounds):
        order = CASES if rnd % 2 == 0 else list(reversed(CASES))
        for name, args in order:
            t0 = time.perf_counter()
            r = subprocess.run([a.pacer, "plan", "search", *args, "--json"], capture_output=True, text=True)
            times[name].append(time.perf_counter() - t0)
            if r.returncode not in (0, 1):
                raise SystemExit(f"{name}: exit {r.returncode}: {r.stderr}")
            j = json.loads(r.stdout)
            evaluated[name] = (j["evaluated"], j["fitting"], j["top"][0]["config"] if j["top"] else None)
    after = uptime()
    date = datetime.date.today().isoformat()
    rows = []
    for name, _ in CASES:
        t = sorted(times[name])
        rows.append({"case": name, "median_s": statistics.median(t), "min_s": t[0], "max_s": t[-1],
                     "evaluated": evaluated[name][0], "fitting": evaluated[name][1], "best": evaluated[name][2]})
    result = {"date": date, "machine": platform.node(), "cpus": os.cpu_count(), "rounds": a.rounds,
              "load_before": before, "load_after": after, "peer": None,
              "command": "python3 bench/plan_search.py build/bin/pacer", "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"plan_search-{date}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# pacer plan search, {date}, {platform.node()} ({os.cpu_count()} CPUs), load {' '.join(before)} -> {' '.join(after)}\n\n")
        f.write("| case | layouts evaluated | fit | median s | min-max s |\n|---|---:|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['case']} | {r['evaluated']} | {r['fitting']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} |\n")
    for r in rows:
        print(f"{r['case']}: {r['median_s']:.3f} s ({r['min_s']:.3f}-{r['max_s']:.3f}), {r['evaluated']} layouts")


if __name__ == "__main__":
    main()
