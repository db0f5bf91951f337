"""Summarises bench/comm_overlap.sh runs: JSON with the machine, and a Markdown table.

Usage: python3 bench/comm_overlap_report.py TMPDIR OUT_PREFIX   (reads pacer.jsonl, ddp.jsonl, bench.json)
       python3 bench/comm_overlap_report.py --from OUT_PREFIX.json OUT_PREFIX   (re-renders the Markdown)
"""
import datetime
import json
import os
import platform
import sys


def load(argv):
    if argv[1] == "--from":
        return json.load(open(argv[2])), argv[3]
    tmp, out = argv[1], argv[2]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    machine = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
               "date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
               "load_average_at_report": os.getloadavg()[0],
               "note": os.environ.get("MACHINE_NOTE", "every figure is a median over rounds")}
    data = {"machine": machine, "pacer": [json.loads(l) for l in open(f"{tmp}/pacer.jsonl")],
            "ddp": [json.loads(l) for l in open(f"{tmp}/ddp.jsonl")], "bench": json.load(open(f"{tmp}/bench.json"))}
    json.dump(data, open(out + ".json", "w"), indent=1)
    return data, out


def main():
    data, out = load(sys.argv)
    m, pacer, ddp = data["machine"], data["pacer"], data["ddp"]
    # comm_overlap.sh runs, per (ranks, compute, ms): pacer with 25 MiB then 4 MiB buckets, then DDP.
    pct = lambda x: f"{x:.0%}"
    rows = ["| ranks | compute | target per layer | pacer: comm alone / compute alone | no overlap | pacer thread 25 MiB (finish wait) | pacer thread 4 MiB (finish wait) | pacer caller 25 MiB | DDP: comm alone / compute alone | DDP no overlap | DDP gloo 25 MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, d in enumerate(ddp):
        p25, p4 = pacer[2 * k], pacer[2 * k + 1]
        ms = d.get("compute_ms_per_layer", [8, 2][k % 2])
        rows.append(f"| {d['ranks']} | {d['compute']} | {ms:g} ms | {p25['comm_s']*1e3:.0f} / {p25['compute_s']*1e3:.0f} ms | "
                    f"{pct(p25['hidden_no_overlap'])} | {pct(p25['hidden_thread'])} ({p25['finish_wait_thread_s']*1e3:.1f} ms) | "
                    f"{pct(p4['hidden_thread'])} ({p4['finish_wait_thread_s']*1e3:.1f} ms) | {pct(p25['hidden_caller'])} | "
                    f"{d['comm_s']*1e3:.0f} / {d['compute_s']*1e3:.0f} ms | {pct(d['hidden_no_overlap'])} | {pct(d['hidden_ddp'])} |")
    md = [f"# Gradient all-reduce overlap, {m['date_utc'][:10]}", "",
          f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores; {m.get('note', '')}. Medians over {pacer[0]['rounds']} rounds. "
          "16 layers x 4 MiB fp32 gradients (64 MiB); first bucket 1 MiB.", "",
          "hidden = 1 - (step time - compute alone) / communication alone, each from its own program's runs; "
          "negative: overlapping cost more than it hid.", "", *rows, "",
          "pacer all_reduce + wait against MPI_Allreduce, alternating in the same run (busbw ratio pacer / MPI; target >= 0.95):",
          "", "| ranks | compute | 64 KiB | 1 MiB | 16 MiB |", "|---|---|---|---|---|"]
    for p in pacer:
        r = p["busbw_ratio_vs_mpi"]
        md.append(f"| {p['ranks']} | {p['compute']} | {r['65536']:.2f} | {r['1048576']:.2f} | {r['16777216']:.2f} |")
    ar = next(c for c in data["bench"]["collectives"] if c["name"] == "all_reduce")
    md += ["", f"`pacer comm bench`, 2 ranks, all_reduce fit: alpha {ar['fit']['alpha_s']*1e6:.2f} us, "
           f"{ar['fit']['bandwidth_gbps']:.2f} GB/s, R2 {ar['fit']['r2']:.3f}; at {ar['points'][-1]['bytes']/2**20:.0f} MiB "
           f"busbw {ar['points'][-1]['busbw_gbps']:.2f} GB/s."]
    open(out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
