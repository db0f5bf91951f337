"""Cold checkpoint loads, side by side: pacer load() into new memory (4 KiB or
huge-page destinations), torch.load, and a dd read of pacer's files; and the
resume path, into tensors that already exist: pacer load(into=state) against
torch.load + load_state_dict.

    PYTHONPATH=build/python /usr/bin/python3 bench/ckpt_load.py --out bench/results/ckpt_load-DATE

One command, one process: it writes the checkpoints once (pacer and
torch.save of the same tensors) into a scratch directory under the repository
(or --dir), then runs every contender once per round, the order rotating,
each from a cold page cache after the same idle pause (bench/ckpt_vs_torch.py's
evict() and settle()), and writes OUT.json and OUT.md. The scratch directory
is removed on exit. See bench/README.md.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

import pacer
import pacer.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_vs_torch as cv  # noqa: E402  (the shared cache control, dd and timing helpers)

MB = 1e6


def log(msg):
    print(f"ckpt_load: {msg}", flush=True)


def vmstat(key):
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k == key:
                return int(v)
    return None


def first_line(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def sh(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


class Bench:
    def __init__(self, a, scratch):
        self.a = a
        self.state = {"drop_caches": None}
        n, per = a.tensors, a.bytes // a.tensors // 4
        g = torch.Generator().manual_seed(7)
        self.src = {f"w{i}": torch.randn(per, generator=g) for i in range(n)}
        for t in self.src.values():
            t[t == 0] = 1.0
        self.total = sum(t.numel() * 4 for t in self.src.values())
        # The model a resume fills: its tensors exist and were written (faulted in) before.
        self.model = torch.nn.Module()
        for k, t in self.src.items():
            self.model.register_parameter(k, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
        self.root = os.path.join(scratch, "pacer")
        self.torch_path = os.path.join(scratch, "torch.pt")
        self.ck = pacer.Checkpointer(self.root, keep_last=0, staging_bytes=256 << 20)
        self.ck.save(1, {"model": self.src}).wait()
        self.step_dir = os.path.join(self.root, "step-000000000001")
        torch.save(self.src, self.torch_path)
        cv.fsync_path(self.torch_path)
        cv.fsync_dir(scratch)
        self.data_files = [f for f in cv.files_under(self.step_dir) if f.endswith(".bin")]

    def cold(self, path):
        res = cv.evict(path, self.state)
        cv.settle()
        return res

    def check_model(self):
        ok = all(torch.equal(p, self.src[k]) for k, p in self.model.named_parameters())
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()  # the next resume must write every byte again; the pages stay faulted in
        return ok

    # Each contender: (seconds, bytes resident before, loaded equal to the source)
    def pacer_new(self, huge, faulters=None):
        res = self.cold(self.step_dir)
        keep = pacer.checkpoint._FAULTERS
        pacer.checkpoint._LOAD_HUGE_PAGES = huge
        pacer.checkpoint._FAULTERS = faulters or keep
        try:
            thp0 = vmstat("thp_fault_alloc")
            t0 = cv.now()
            got = self.ck.load(1)
            s = cv.now() - t0
            thp = vmstat("thp_fault_alloc") - thp0
        finally:
            pacer.checkpoint._LOAD_HUGE_PAGES = False
            pacer.checkpoint._FAULTERS = keep
        ok = all(torch.equal(got.state["model"][k], self.src[k]) for k in self.src)
        del got
        return {"s": s, "resident_before": res, "equal": ok, "thp_faults": thp}

    def torch_new(self):
        res = self.cold(self.torch_path)
        t0 = cv.now()
        got = torch.load(self.torch_path)
        s = cv.now() - t0
        ok = all(torch.equal(got[k], self.src[k]) for k in self.src)
        del got
        return {"s": s, "resident_before": res, "equal": ok}

    def dd(self):
        res = self.cold(self.step_dir)
        secs = 0.0
        for f in self.data_files:
            dd_s, _, _ = cv.run_dd(["dd", f"if={f}", "of=/dev/null", "bs=4M"])
            secs += dd_s
        return {"s": secs, "resident_before": res, "equal": None}

    def pacer_resume(self):
        res = self.cold(self.step_dir)
        t0 = cv.now()
        self.ck.load(1, into={"model": self.model.state_dict()})
        s = cv.now() - t0
        return {"s": s, "resident_before": res, "equal": self.check_model()}

    def torch_resume(self):
        res = self.cold(self.torch_path)
        t0 = cv.now()
        self.model.load_state_dict(torch.load(self.torch_path))
        s = cv.now() - t0
        return {"s": s, "resident_before": res, "equal": self.check_model()}


CONTENDERS = {
    "pacer_load_4k": ("pacer `load(step)` into new arrays, 4 KiB pages, one thread faulting them in ahead of the "
                      "readers (the default)", lambda b: b.pacer_new(False, 1)),
    "pacer_load_4k_2_faulters": ("pacer `load(step)` into new arrays, 4 KiB pages, two faulting threads "
                                 "(`_FAULTERS = 2`)", lambda b: b.pacer_new(False, 2)),
    "pacer_load_huge": ("pacer `load(step)` into new arrays advised MADV_HUGEPAGE", lambda b: b.pacer_new(True, 1)),
    "torch_load": ("`torch.load(path)`", lambda b: b.torch_new()),
    "dd_read": ("`dd if=rank-00000.bin of=/dev/null bs=4M`", lambda b: b.dd()),
    "pacer_resume": ("pacer `load(step, into={\"model\": model.state_dict()})`", lambda b: b.pacer_resume()),
    "torch_resume": ("`model.load_state_dict(torch.load(path))`", lambda b: b.torch_resume()),
}
COLD = ("pacer_load_4k", "pacer_load_4k_2_faulters", "pacer_load_huge")


def summarize(o):
    """Medians, ranges, ratios and targets from o["runs"]."""
    runs = o["runs"]
    med = o["median_s"] = {k: statistics.median(x["s"] for x in v) for k, v in runs.items()}
    o["range_s"] = {k: [min(x["s"] for x in v), max(x["s"] for x in v)] for k, v in runs.items()}
    ratios, targets = {}, {}
    for k in COLD:
        if k in med:
            ratios[f"{k}_vs_torch_load"] = med["torch_load"] / med[k]
            ratios[f"{k}_vs_dd"] = med["dd_read"] / med[k]
            targets[f"load >= 1.3x torch.load ({k})"] = {"value": ratios[f"{k}_vs_torch_load"], "goal": 1.3}
            targets[f"load >= 0.8x dd ({k})"] = {"value": ratios[f"{k}_vs_dd"], "goal": 0.8}
    ratios["pacer_resume_vs_torch_resume"] = med["torch_resume"] / med["pacer_resume"]
    ratios["pacer_resume_vs_dd"] = med["dd_read"] / med["pacer_resume"]
    targets["resume >= 1.3x torch resume"] = {"value": ratios["pacer_resume_vs_torch_resume"], "goal": 1.3}
    targets["resume >= 0.8x dd"] = {"value": ratios["pacer_resume_vs_dd"], "goal": 0.8}
    for t in targets.values():
        t["met"] = t["value"] >= t["goal"]
    o["ratios"], o["targets"] = ratios, targets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results path without extension (OUT.json, OUT.md)")
    ap.add_argument("--bytes", type=int, default=2 << 30)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--dir", default=None, help="where the scratch directory goes (default: the repository root)")
    ap.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    a = ap.parse_args()
    if a.render:
        render(a.out + ".json")
        return
    if a.bytes <= 0 or a.tensors <= 0 or a.bytes % (4 * a.tensors):
        ap.error("--bytes must be a positive multiple of 4 x --tensors")
    cv.SETTLE_S = a.settle
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=".ckpt_load-scratch.", dir=a.dir or repo)
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        log(f"writing {a.bytes / (1 << 20):.0f} MiB in {a.tensors} tensors to {scratch}")
        b = Bench(a, scratch)
        names = list(CONTENDERS)
        runs = {k: [] for k in names}
        round_load = []
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            round_load.append(os.getloadavg()[0])
            for k in order:
                x = CONTENDERS[k][1](b)
                if x["equal"] is False:
                    raise SystemExit(f"ckpt_load: {k} loaded other bytes than were saved")
                runs[k].append(x)
                log(f"round {r + 1} {k}: {x['s']:.3f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()
    commit = sh("git", "-C", repo, "rev-parse", "--short", "HEAD") or "unknown"
    if subprocess.run(["git", "-C", repo, "diff", "--quiet", "HEAD", "--", "src", "include", "python"]).returncode:
        commit += " (+ uncommitted changes)"
    cpu = next((l.split(":", 1)[1].strip() for l in sh("lscpu").splitlines() if l.startswith("Model name:")), "")
    facts = {
        "host": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu, "kernel": platform.release(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "thp_enabled": first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": first_line("/sys/kernel/mm/transparent_hugepage/defrag"),
        "page_reporting_order": first_line("/sys/module/page_reporting/parameters/page_reporting_order"),
        "fs_type": sh("findmnt", "-no", "FSTYPE", "-T", repo), "device": sh("findmnt", "-no", "SOURCE", "-T", repo),
        "python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
        "pacer": pacer.__version__, "pacer_commit": commit, "drop_caches": b.state["drop_caches"],
    }
    cmd = (f"PYTHONPATH=build/python /usr/bin/python3 bench/ckpt_load.py --out {a.out} --bytes {a.bytes} "
           f"--tensors {a.tensors} --rounds {a.rounds} --settle {a.settle:g}")
    out = {
        "schema": "pacer.bench.ckpt_load/1", "date": started.strftime("%Y-%m-%d"),
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": cmd, "machine": facts, "bytes": b.total, "tensors": a.tensors, "rounds": a.rounds,
        "settle_s": a.settle, "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        "loadavg_1m_per_round": round_load,
        "contenders": {k: CONTENDERS[k][0] for k in names},
        "runs": runs,
    }
    summarize(out)
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    write_md(out, a.out + ".md")
    log(f"wrote {a.out}.json and {a.out}.md")


def render(json_path):
    """Writes the .md beside a results .json again, and the labels in both (after a change of this text)."""
    with open(json_path) as f:
        o = json.load(f)
    o["contenders"] = {k: CONTENDERS[k][0] for k in o["contenders"]}
    summarize(o)
    with open(json_path, "w") as f:
        json.dump(o, f, indent=2)
        f.write("\n")
    write_md(o, json_path[:-len(".json")] + ".md")


def write_md(o, path):
    m = o["machine"]
    gib = o["bytes"] / (1 << 30)
    lines = [
        f"# Cold checkpoint loads: pacer, torch.load, dd ({o['date']})", "",
        f"Machine: `{m['host']}`, {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"THP enabled `{m['thp_enabled']}`, defrag `{m['thp_defrag']}`, free page reporting order "
        f"`{m['page_reporting_order'] or 'n/a'}`; {m['fs_type']} on {m['device']}. Python {m['python']}, torch "
        f"{m['torch']}, numpy {m['numpy']}, pacer {m['pacer']} ({m['pacer_commit']}). Page cache drop: {m['drop_caches']}.",
        "",
        f"Data: {o['tensors']} float32 tensors, {gib:.2f} GiB in all. {o['rounds']} rounds, contenders rotating, each "
        f"from a cold page cache after `sync` and {o['settle_s']:g} s idle; medians with the range. Started "
        f"{o['started']}, finished {o['finished']}. Load average (1, 5, 15 min) before: "
        + ", ".join(f"{x:.2f}" for x in o["loadavg_before"]) + "; after: "
        + ", ".join(f"{x:.2f}" for x in o["loadavg_after"]) + "; 1 min at each round's start: "
        + ", ".join(f"{x:.2f}" for x in o["loadavg_1m_per_round"]) + ".",
        "", f"Command: `{o['command']}`", "",
    ] + ([f"Note: {o['note']}", ""] if o.get("note") else []) + [
        "| contender | median s | range s | MB/s | runs s |", "|---|---:|---|---:|---|",
    ]
    for k, label in o["contenders"].items():
        lo, hi = o["range_s"][k]
        runs = ", ".join(f"{x['s']:.2f}" for x in o["runs"][k])
        lines.append(f"| {label} | {o['median_s'][k]:.3f} | {lo:.2f}-{hi:.2f} | {o['bytes'] / MB / o['median_s'][k]:,.0f} "
                     f"| {runs} |")
    thp = [x.get("thp_faults") for x in o["runs"]["pacer_load_huge"]]
    lines += ["", f"Huge pages faulted by the huge-page loads (thp_fault_alloc; {o['bytes'] >> 21} would hold it all): "
              f"{', '.join(str(x) for x in thp)}. The pacer cold loads differ only in the advice on their new "
              "arrays (`pacer.checkpoint._LOAD_HUGE_PAGES`) and in the number of threads that fault them in "
              "(`_FAULTERS`); the resume contenders fill tensors that exist and were "
              "written before (a model's), so they pay no first touch.", "",
              "| target | value | goal | met |", "|---|---:|---:|---|"]
    for name, t in o["targets"].items():
        lines.append(f"| {name} | {t['value']:.2f}x | {t['goal']}x | {'yes' if t['met'] else 'NO'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
