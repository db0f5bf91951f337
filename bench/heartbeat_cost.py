"""What `pacer.run.heartbeat(step)` costs the training thread, with and without a supervisor.

    cmake --build build --target pacer_cli pacer_python_files heartbeat_cost
    PYTHONPATH=build/python python3 bench/heartbeat_cost.py [--pacer build/bin/pacer] [--calls 1000000] [--rounds 7]

Two processes: one under `pacer run --hang-timeout 1h` (the heartbeat file is
mapped: two stores per call) and one bare (no supervisor: the call returns at
once). In each, rounds alternate the contenders: heartbeat(step), heartbeat()
without a step, and the peers a Python call costs anyway: a no-op Python
function and time.monotonic() (a C call that reads the clock). The C++ call
(bench/heartbeat_cost.cpp, when built: 10x the calls) is measured the same two
ways against clock_gettime(CLOCK_MONOTONIC). Per call: the
median over rounds and the spread (min..max). Writes
bench/results/heartbeat_cost-DATE.json and .md.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def measure(calls, rounds):
    import pacer.run
    hb = pacer.run.heartbeat
    hb(0)  # maps the file, installs the stack dump

    def noop(step=None):
        return None

    contenders = {
        "heartbeat(step)": lambda n: [hb(i) for i in range(n)],
        "heartbeat()": lambda n: [hb() for _ in range(n)],
        "python no-op call": lambda n: [noop(i) for i in range(n)],
        "time.monotonic()": lambda n: [time.monotonic() for _ in range(n)],
    }
    empty = lambda n: [None for _ in range(n)]  # the loop's own cost, subtracted  # noqa: E731
    per = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            t0 = time.perf_counter_ns()
            empty(calls)
            t1 = time.perf_counter_ns()
            contenders[k](calls)
            t2 = time.perf_counter_ns()
            per[k].append(max(0.0, ((t2 - t1) - (t1 - t0)) / calls))
    return {k: {"median_ns": statistics.median(v), "min_ns": min(v), "max_ns": max(v), "rounds": v}
            for k, v in per.items()}


def loadavg():
    return list(os.getloadavg())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pacer", default="build/bin/pacer")
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cxx", default="build/bin/heartbeat_cost", help="the C++ driver (skipped when missing)")
    p.add_argument("--inner", help=argparse.SUPPRESS)  # write this process's figures here
    a = p.parse_args()
    if a.inner:
        with open(a.inner, "w") as f:
            json.dump({"supervised": "PACER_HEARTBEAT_FILE" in os.environ, "per_call": measure(a.calls, a.rounds)}, f)
        return
    load_before = loadavg()
    results = {}
    here = os.path.abspath(__file__)
    for label, prefix in (("under pacer run", [a.pacer, "run", "--quiet", "--hang-timeout", "1h", "--"]),
                          ("no supervisor", [])):
        out = os.path.join(os.path.dirname(here), "results", f".heartbeat-{os.getpid()}.json")
        subprocess.run([*prefix, sys.executable, here, "--inner", out, "--calls", str(a.calls),
                        "--rounds", str(a.rounds)], check=True)
        with open(out) as f:
            results[label] = json.load(f)
        os.unlink(out)
        if os.path.exists(a.cxx):
            r = subprocess.run([*prefix, a.cxx, str(10 * a.calls), str(a.rounds)], check=True, capture_output=True,
                               text=True)
            results[label]["cxx_per_call"] = json.loads(r.stdout)
    date = datetime.date.today().isoformat()
    doc = {"bench": "heartbeat_cost", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "python": platform.python_version()},
           "load_before": load_before, "load_after": loadavg(), "calls_per_round": a.calls, "rounds": a.rounds,
           "command": "PYTHONPATH=build/python python3 bench/heartbeat_cost.py", "results": results}
    base = os.path.join(os.path.dirname(here), "results", f"heartbeat_cost-{date}")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# pacer.run.heartbeat cost, {doc['date']}", "",
             f"{doc['machine']['host']}, {doc['machine']['cpus']} CPUs, Python {doc['machine']['python']}; "
             f"load {load_before[0]:.2f} before, {doc['load_after'][0]:.2f} after; "
             f"{a.rounds} rounds of {a.calls} calls, loop cost subtracted.", "",
             "| process | call | median ns/call | min..max |", "|---|---|---|---|"]
    for label, r in results.items():
        for k, v in r["per_call"].items():
            lines.append(f"| {label} | Python {k} | {v['median_ns']:.0f} | {v['min_ns']:.0f}..{v['max_ns']:.0f} |")
        for k, v in r.get("cxx_per_call", {}).items():
            lines.append(f"| {label} | C++ {k} | {v['median_ns']:.1f} | {v['min_ns']:.1f}..{v['max_ns']:.1f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
