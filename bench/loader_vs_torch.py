"""pacer.data.Loader against PyTorch's DataLoader and `cat` on the same tar shards.

Usage: PYTHONPATH=build/python /usr/bin/python3 bench/loader_vs_torch.py [--samples N] [--size BYTES] [--rounds R]
Writes bench/results/loader_vs_torch-DATE.{json,md}. Shards live in a scratch
directory under the repository and are removed at the end. The page cache is
warmed first: this measures the loaders, not the disk.
"""
import argparse
import datetime
import io
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import pacer
import pacer.data


def make_shards(root, samples, size, per_shard):
    rng = np.random.default_rng(0)
    paths = []
    for s in range(0, samples, per_shard):
        path = os.path.join(root, f"bench-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s, min(samples, s + per_shard)):
                data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()  # never zeros
                info = tarfile.TarInfo(f"{i:08d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


class TarSamples(Dataset):
    """The plain tar-reading Dataset a PyTorch user would write: an index of
    member offsets built once with tarfile, then one open + seek + read per sample."""

    def __init__(self, paths):
        self.items = []
        for p in paths:
            with tarfile.open(p) as tar:
                for m in tar.getmembers():
                    if m.isfile():
                        self.items.append((p, m.offset_data, m.size))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, off, size = self.items[i]
        with open(path, "rb") as f:
            f.seek(off)
            return f.read(size)


def cpu_seconds(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def time_cat(paths, cpu=None):
    c0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(cpu_seconds(resource.RUSAGE_CHILDREN) - c0)
    return t


def time_pacer(spec, batch, copy=False, cpu=None):
    ds = pacer.data.open(spec)
    loader = pacer.data.Loader(ds, batch_size=batch, seed=0, shuffle=True, threads=2, decode=False, copy=copy)
    c0 = cpu_seconds(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["__key__"])
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(cpu_seconds(resource.RUSAGE_SELF) - c0)
    return t, n


def time_open_many(root, shards):
    """Opening a dataset of many shards: only each index's header is read."""
    many = os.path.join(root, "many")
    os.makedirs(many)
    for i in range(shards):
        with tarfile.open(os.path.join(many, f"m-{i:06d}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
            data = f"sample {i}".encode()
            info = tarfile.TarInfo(f"{i:08d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    spec = os.path.join(many, "m-{%06d..%06d}.tar" % (0, shards - 1))
    assert len(pacer.data.open(spec)) == shards  # builds the indexes, outside the timing
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ds = pacer.data.open(spec)
        times.append(time.perf_counter() - t0)
        assert len(ds) == shards
    return times


def time_torch(dataset, batch, workers):
    dl = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=list)
    t0 = time.perf_counter()
    n = 0
    for b in dl:
        n += len(b)
    return time.perf_counter() - t0, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--size", type=int, default=10 * 1024)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--open-shards", type=int, default=10000)
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=".loader-bench-", dir=repo)
    try:
        paths = make_shards(scratch, args.samples, args.size, args.per_shard)
        spec = os.path.join(scratch, "bench-{%06d..%06d}.tar" % (0, len(paths) - 1))
        pacer.data.open(spec)  # builds the indexes once, outside the timing
        torch_ds = TarSamples(paths)
        time_cat(paths)  # warm the page cache
        total_bytes = sum(os.path.getsize(p) for p in paths)
        rows = {"cat": [], "pacer": [], "pacer_copy": []}
        cpu = {"cat": [], "pacer": []}  # CPU seconds (user + system), which contention on a shared machine inflates less than wall time
        for w in (0, 1, 2):
            rows[f"torch_workers_{w}"] = []
        for r in range(args.rounds):
            rows["cat"].append(time_cat(paths, cpu["cat"]))
            t, n = time_pacer(spec, args.batch, cpu=cpu["pacer"])
            assert n == args.samples, n
            rows["pacer"].append(t)
            t, n = time_pacer(spec, args.batch, copy=True)
            assert n == args.samples, n
            rows["pacer_copy"].append(t)
            for w in (0, 1, 2):
                t, n = time_torch(torch_ds, args.batch, w)
                assert n == args.samples, n
                rows[f"torch_workers_{w}"].append(t)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
        open_times = time_open_many(scratch, args.open_shards)
        med = {k: statistics.median(v) for k, v in rows.items()}
        sps = {k: args.samples / v for k, v in med.items()}
        best_torch = max((k for k in sps if k.startswith("torch")), key=lambda k: sps[k])
        result = {
            "schema": "pacer.bench.loader/1",
            "date": datetime.date.today().isoformat(),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                        "torch": torch.__version__, "pacer": pacer.__version__},
            "samples": args.samples, "sample_bytes": args.size, "shards": len(paths), "batch": args.batch,
            "shard_bytes": total_bytes, "rounds": rows, "median_s": med, "samples_per_s": sps,
            "best_torch": best_torch,
            "pacer_vs_cat": sps["pacer"] / sps["cat"],
            "pacer_vs_best_torch": sps["pacer"] / sps[best_torch],
            "pacer_copy_vs_cat": sps["pacer_copy"] / sps["cat"],
            "pacer_copy_vs_best_torch": sps["pacer_copy"] / sps[best_torch],
            "cpu_s": cpu, "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
            "open_shards": args.open_shards, "open_s": open_times, "open_median_s": statistics.median(open_times),
        }
        out = os.path.join(repo, "bench", "results", f"loader_vs_torch-{result['date']}")
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        md = [f"# pacer.data.Loader vs PyTorch DataLoader and cat, {result['date']}", "",
              f"Machine: `{platform.node()}`, {os.cpu_count()} CPUs, kernel {platform.release()}; torch {torch.__version__}. "
              f"{args.samples} samples of {args.size} random bytes in {len(paths)} tar shards, batch {args.batch}, "
              f"shuffled, page cache warm, {args.rounds} rounds, medians. `PYTHONPATH=build/python /usr/bin/python3 bench/loader_vs_torch.py`.",
              "", "| reader | seconds | samples/s | MB/s |", "|---|---:|---:|---:|"]
        for k in rows:
            md.append(f"| {k} | {med[k]:.3f} | {sps[k]:,.0f} | {total_bytes / med[k] / 1e6:,.0f} |")
        md += ["", f"pacer (values are memoryviews into the batch buffer) / cat = {result['pacer_vs_cat']:.2f} (target >= 0.80); "
               f"pacer / best DataLoader ({best_torch}) = {result['pacer_vs_best_torch']:.2f} (target >= 3).",
               "", f"pacer_copy (values copied to bytes, copy=True) / cat = {result['pacer_copy_vs_cat']:.2f}; "
               f"pacer_copy / best DataLoader = {result['pacer_copy_vs_best_torch']:.2f}.",
               "", f"CPU seconds (user + system, median): cat {result['cpu_median_s']['cat']:.3f}, pacer "
               f"{result['cpu_median_s']['pacer']:.3f} (2 reader threads and the consumer together).",
               "", f"Opening {args.open_shards} shards' indexes: {result['open_median_s']:.3f} s (median of 3; target < 1 s)."]
        with open(out + ".md", "w") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
