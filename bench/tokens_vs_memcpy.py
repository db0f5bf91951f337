"""pacer.data.Loader over a Megatron token dataset, packed rows, against a memcpy of the same bytes.

Usage: PYTHONPATH=build/python /usr/bin/python3 bench/tokens_vs_memcpy.py [--tokens N] [--seq-len 4096]
           [--batch 8] [--rounds 5] [--dtype int32] [--name NAME]
Writes bench/results/NAME.{json,md} (default NAME: tokens_vs_memcpy-DATE).

The dataset (random token ids, never zeros; document lengths drawn from a
log-normal with a median of about 600 tokens, as web text has) is written once
under a scratch directory in the repository and read with the page cache warm.
The loader packs documents into seq_len-token rows (pack=True, pin_memory=True:
page-locked buffers when CUDA is present) and hands out int64 `tokens` and
int32 `position_ids`; the figure of merit is the rate at which those bytes
reach the caller. The peer is a one-thread memcpy (numpy.copyto) of the same
number of bytes between two buffers allocated and touched once, which is the
least any producer of those bytes costs. Rounds alternate the two; medians.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np

import pacer
import pacer.data


def make_dataset(prefix, tokens, dtype, seed=0):
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < tokens:
        n = int(min(16384, max(8, rng.lognormal(np.log(600), 1.0))))
        docs.append(rng.integers(1, 50000, n, dtype=np.int64))
        total += n
    pacer.data.write_tokens(prefix, docs, dtype=dtype)
    return len(docs), total


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def open_loader(prefix, seq_len, batch, threads):
    return pacer.data.Loader(prefix, batch_size=batch, seq_len=seq_len, pack=True, seed=0, threads=threads,
                             pin_memory=True)


def time_loader(prefix, seq_len, batch, threads, loader=None):
    """One epoch: of a new loader (opening the dataset, planning the epoch's packing, mapping the .bin),
    or of `loader`, which read epochs before (its next epoch is planned in the timing too)."""
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    if loader is None:
        loader = open_loader(prefix, seq_len, batch, threads)
    out_bytes, rows = 0, 0
    for b in loader:
        out_bytes += b["tokens"].nbytes + b["position_ids"].nbytes
        rows += b["tokens"].shape[0]
    return time.perf_counter() - t0, out_bytes, rows, loader.stats(), cpu_seconds() - c0


def time_memcpy(src, dst):
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0, cpu_seconds() - c0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64 << 20)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="int32")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=".tokens-bench-", dir=repo)
    try:
        prefix = os.path.join(scratch, "tok")
        ndocs, ntok = make_dataset(prefix, args.tokens, args.dtype)
        with open(prefix + ".bin", "rb") as f:  # warm the page cache
            while f.read(1 << 24):
                pass
        t, out_bytes, rows, _, _ = time_loader(prefix, args.seq_len, args.batch, args.threads)  # warm-up, sizes
        steady = open_loader(prefix, args.seq_len, args.batch, args.threads)
        time_loader(prefix, args.seq_len, args.batch, args.threads, steady)
        src = np.random.default_rng(1).integers(1, 255, out_bytes, dtype=np.uint8)
        dst = np.ones_like(src)
        time_memcpy(src, dst)
        res = {"loader": [], "loader_steady": [], "memcpy": []}
        cpu = {k: [] for k in res}
        # Bytes delivered per round: another epoch packs its shuffled documents into slightly other rows.
        moved = {k: [] for k in res}
        loads, stats = [], None
        contenders = list(res)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            # The order rotates every round, so no contender always runs first or after the same one.
            for who in contenders[r % 3:] + contenders[:r % 3]:
                if who == "memcpy":
                    t, c = time_memcpy(src, dst)
                    b = out_bytes
                else:
                    t, b, _, stats, c = time_loader(prefix, args.seq_len, args.batch, args.threads,
                                                    steady if who == "loader_steady" else None)
                    assert who == "loader_steady" or b == out_bytes, (who, b, out_bytes)
                res[who].append(t)
                moved[who].append(b)
                cpu[who].append(c)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in res.items()), flush=True)
        loads.append(os.getloadavg()[0])
        med = {k: statistics.median(v) for k, v in res.items()}
        rate = {k: statistics.median(b / t for b, t in zip(moved[k], res[k])) for k in res}  # bytes/s
        date = datetime.date.today().isoformat()
        command = ("PYTHONPATH=build/python /usr/bin/python3 bench/tokens_vs_memcpy.py "
                   f"--tokens {args.tokens} --seq-len {args.seq_len} --batch {args.batch} --threads {args.threads} "
                   f"--rounds {args.rounds} --dtype {args.dtype}")
        result = {
            "schema": "pacer.bench.tokens/1", "date": date,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                        "pacer": pacer.__version__},
            "command": command, "documents": ndocs, "tokens": ntok, "dtype": args.dtype, "seq_len": args.seq_len,
            "batch": args.batch, "threads": args.threads, "rows": rows, "bytes_out": out_bytes,
            "rounds": res, "median_s": med, "spread_s": {k: [min(v), max(v)] for k, v in res.items()},
            "bytes_per_round": moved, "median_bytes_per_s": rate,
            "loader_vs_memcpy": rate["loader"] / rate["memcpy"],
            "loader_steady_vs_memcpy": rate["loader_steady"] / rate["memcpy"],
            "cpu_s": cpu, "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
            "cpu_vs_memcpy": {k: statistics.median(v) / statistics.median(cpu["memcpy"]) for k, v in cpu.items()},
            "load_avg_1m": loads,
            "padding_fraction": stats["padding_fraction"] if stats else None,
        }
        name = args.name or f"tokens_vs_memcpy-{date}"
        out = os.path.join(repo, "bench", "results", name)
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        md = [f"# pacer.data.Loader (packed tokens) vs memcpy, {date}", "",
              f"Machine: `{platform.node()}`, {os.cpu_count()} CPUs, kernel {platform.release()}. {ndocs:,} documents, "
              f"{ntok:,} {args.dtype} tokens; packed into {rows:,} rows of {args.seq_len} (batch {args.batch}, "
              f"{args.threads} reader threads, padding {100 * result['padding_fraction']:.2f}%); page cache warm; "
              f"{args.rounds} rounds in rotating order, medians [min-max]. Load average (1 min) at each round's start and "
              f"the end: {', '.join(f'{x:.1f}' for x in loads)}. `{command}`.", "",
              "| contender | seconds | MB/s of int64 tokens + int32 positions | CPU seconds (user + system) |",
              "|---|---:|---:|---:|"]
        for k in res:
            md.append(f"| {k} | {med[k]:.3f} [{min(res[k]):.3f}-{max(res[k]):.3f}] | {rate[k] / 1e6:,.0f} | "
                      f"{result['cpu_median_s'][k]:.3f} |")
        md += ["", f"loader (a new loader per round: opens the dataset, plans the packing, maps the .bin) / memcpy rate = "
               f"{result['loader_vs_memcpy']:.2f} (target >= 0.80); loader_steady (the next epoch of one loader, planned "
               f"in the timing) / memcpy = {result['loader_steady_vs_memcpy']:.2f}. CPU time / memcpy's: loader "
               f"{result['cpu_vs_memcpy']['loader']:.2f}, loader_steady {result['cpu_vs_memcpy']['loader_steady']:.2f}."]
        with open(out + ".md", "w") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
