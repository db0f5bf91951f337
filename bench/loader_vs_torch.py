"""pacer.data.Loader against PyTorch's DataLoader and `cat` on the same tar shards.

Usage: PYTHONPATH=build/python /usr/bin/python3 bench/loader_vs_torch.py [--samples N] [--size BYTES] [--rounds R]
           [--per-shard N] [--open-shards N] [--name NAME] [--keep] [--reread] [--torch-in-process]
Writes bench/results/NAME.{json,md} (default NAME: loader_vs_torch-DATE). Shards live in a scratch
directory under the repository and are removed at the end. The page cache is
warmed first: this measures the loaders, not the disk.

How the shards came into the page cache matters on a VM: the writer's 10 KiB
writes leave them in 4 KiB folios, which a new mapping fills a page-table entry
at a time, while a read through pacer's mapping caches them in 2 MiB folios
(docs/data.md, "Page cache"). With --reread the written shards are dropped from
the page cache first (POSIX_FADV_DONTNEED), so that the first epoch reads them
back as a training node does (its shards were written elsewhere, or paged out
since); without it they stay as the writer left them.

The DataLoader contenders run in a child process (their workers fork from it,
not from the process timing pacer: see torch_server); --torch-in-process runs
them here instead, as this script did before 2026-12-05.
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
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import pacer
import pacer.data


def make_shards(root, samples, size, per_shard):
    """Two-field samples as WebDataset writers make them: KEY.bin (`size` random bytes, never zeros) and
    KEY.json (a small label), in GNU tar format, the fields of a key next to each other."""
    rng = np.random.default_rng(0)
    paths = []
    for s in range(0, samples, per_shard):
        path = os.path.join(root, f"bench-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(s, min(samples, s + per_shard)):
                fields = {"bin": rng.integers(0, 256, size, dtype=np.uint8).tobytes(),
                          "json": json.dumps({"label": int(i % 1000), "key": f"{i:08d}"}).encode()}
                for ext, data in fields.items():
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def scan_tar(paths):
    """{(path, key): {ext: (offset, size)}} of every member, as a plain `tarfile` scan finds them."""
    items = {}
    for p in paths:
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    key, _, ext = m.name.partition(".")
                    items.setdefault((p, key), {})[ext] = (m.offset_data, m.size)
    return items


class TarSamples(Dataset):
    """The plain tar-reading Dataset a PyTorch user would write: member offsets indexed once with
    tarfile, then per sample one open + seek + read of each field."""

    def __init__(self, paths):
        self.items = list(scan_tar(paths).items())

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        (path, key), fields = self.items[i]
        out = {"__key__": key}
        with open(path, "rb") as f:
            for ext, (off, size) in fields.items():
                f.seek(off)
                out[ext] = f.read(size)
        return out


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


def time_epoch(loader, cpu=None):
    """One epoch of `loader`: (seconds, samples), its CPU seconds appended to `cpu`."""
    c0 = cpu_seconds(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["__key__"])
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(cpu_seconds(resource.RUSAGE_SELF) - c0)
    return t, n


def time_pacer(spec, batch, copy=False, cpu=None):
    """A dataset opened anew: each round also pays loading its index entries (checking the member headers),
    mapping its shards and first touching batch buffers."""
    ds = pacer.data.open(spec)
    loader = pacer.data.Loader(ds, batch_size=batch, seed=0, shuffle=True, threads=2, decode=False, copy=copy)
    return time_epoch(loader, cpu)


def time_open_many(root, shards, rounds=3):
    """Opening a dataset of many shards. The first open builds every shard's index; it is timed
    against a plain Python `tarfile` scan of the same shards (rounds alternate; the page cache is
    warm for both). Each round opens shards that were never indexed, as a user's new data set is:
    hard links to the same files in a fresh directory (deleting the indexes of an earlier round
    instead would time the file system's handling of thousands of just-deleted files). Later opens
    read only each index's header."""
    many = os.path.join(root, "many")
    os.makedirs(many)
    names = []
    for i in range(shards):
        name = f"m-{i:06d}.tar"
        with tarfile.open(os.path.join(many, name), "w", format=tarfile.GNU_FORMAT) as tar:
            for ext in ("txt", "json"):
                data = f"sample {i} {ext}".encode()
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        names.append(name)
    subprocess.run(["cat", *(os.path.join(many, n) for n in names)], stdout=subprocess.DEVNULL, check=True)
    first, scan = [], []
    spec = None
    for r in range(rounds):
        fresh = os.path.join(root, f"open-{r}")
        os.makedirs(fresh)
        for n in names:
            os.link(os.path.join(many, n), os.path.join(fresh, n))
        paths = [os.path.join(fresh, n) for n in names]
        spec = os.path.join(fresh, "m-{%06d..%06d}.tar" % (0, shards - 1))
        order = ["pacer", "tarfile"] if r % 2 == 0 else ["tarfile", "pacer"]
        for who in order:
            t0 = time.perf_counter()
            if who == "pacer":
                n = len(pacer.data.open(spec))
                first.append(time.perf_counter() - t0)
            else:
                n = len(scan_tar(paths))
                scan.append(time.perf_counter() - t0)
            assert n == shards, (who, n)
    warm = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ds = pacer.data.open(spec)
        warm.append(time.perf_counter() - t0)
        assert len(ds) == shards
    return {"first_open_s": first, "tarfile_scan_s": scan, "open_s": warm}


def time_torch(dataset, batch, workers):
    dl = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=list,
                    persistent_workers=False)
    t0 = time.perf_counter()
    n = 0
    for b in dl:
        n += len(b)
    return time.perf_counter() - t0, n


def torch_server(paths, batch):
    """--torch-server: times DataLoader epochs in this process, one per line of stdin (its worker count),
    answering each with a JSON line. The DataLoader's workers are forked from here, not from the process
    that times pacer: a fork write-protects every page of the forking process, and the contender that ran
    next paid a fault per 4 KiB page it wrote (pooled batch buffers, the allocator's heap) for the peer's
    workers (bench/results/loader_fresh-2026-12-05.md)."""
    dataset = TarSamples(paths)
    print(json.dumps({"ready": len(dataset)}), flush=True)
    for line in sys.stdin:
        t, n = time_torch(dataset, batch, int(line))
        print(json.dumps({"s": t, "samples": n}), flush=True)


class TorchPeer:
    """The DataLoader contenders, run by a child process (torch_server)."""

    def __init__(self, paths, batch):
        # posix_spawn or vfork+exec (subprocess): starting it does not fork this process's memory.
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--batch", str(batch), "--torch-server", *paths],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer("ready")

    def _answer(self, key):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the DataLoader's process ended (exit status {self.proc.wait()}); its errors are above")
        r = json.loads(line)
        if key not in r:
            raise RuntimeError(f"the DataLoader's process answered {line!r}")
        return r

    def epoch(self, workers):
        try:
            self.proc.stdin.write(f"{workers}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _answer names the exit status
        r = self._answer("s")
        return r["s"], r["samples"]

    def close(self):
        """Ends the child: asked to (end of its input), or killed after 60 s."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            status = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.proc.stdout.close()
        return status


class InProcessTorch:
    """--torch-in-process: the DataLoader contenders in this process."""

    def __init__(self, paths, batch):
        self.dataset, self.batch = TarSamples(paths), batch

    def epoch(self, workers):
        return time_torch(self.dataset, self.batch, workers)

    def close(self):
        return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40000)
    ap.add_argument("--size", type=int, default=10 * 1024)
    ap.add_argument("--per-shard", type=int, default=5000)
    ap.add_argument("--name", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--open-shards", type=int, default=10000)
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (its bench-*.tar for loader_copy_floor)")
    ap.add_argument("--reread", action="store_true",
                    help="drop the written shards from the page cache, so that the first epoch reads them back")
    ap.add_argument("--torch-in-process", action="store_true",
                    help="time the DataLoader in this process (its workers fork it) instead of in a child process")
    ap.add_argument("--torch-server", nargs="+", metavar="SHARD", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_server:
        torch_server(args.torch_server, args.batch)
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix=".loader-bench-", dir=repo)
    peers = []  # the DataLoader's child process while it runs, ended on any error
    try:
        paths = make_shards(scratch, args.samples, args.size, args.per_shard)
        spec = os.path.join(scratch, "bench-{%06d..%06d}.tar" % (0, len(paths) - 1))
        pacer.data.open(spec)  # builds the indexes once, outside the timing
        torch_peer = InProcessTorch(paths, args.batch) if args.torch_in_process else TorchPeer(paths, args.batch)
        peers.append(torch_peer)
        if args.reread:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fdatasync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        steady = pacer.data.Loader(pacer.data.open(spec), batch_size=args.batch, seed=0, shuffle=True, threads=2,
                                   decode=False)
        # The next epoch of one loader over a dataset opened once (entries loaded, shards mapped, buffers
        # pooled), as every epoch of a training run after its first.
        time_epoch(steady)  # its first epoch: entries loaded, shards mapped, buffers pooled (and, with --reread, read)
        time_cat(paths)  # warm the page cache
        total_bytes = sum(os.path.getsize(p) for p in paths)
        rows = {"cat": [], "pacer": [], "pacer_steady": [], "pacer_copy": []}
        cpu = {"cat": [], "pacer": [], "pacer_steady": []}  # CPU seconds (user + system), which contention on a shared machine inflates less than wall time
        for w in (0, 1, 2):
            rows[f"torch_workers_{w}"] = []
        loads = []
        contenders = list(rows)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            # The order rotates every round, so no contender always runs first or after the same one.
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for who in order:
                if who == "cat":
                    rows["cat"].append(time_cat(paths, cpu["cat"]))
                    continue
                if who == "pacer":
                    t, n = time_pacer(spec, args.batch, cpu=cpu["pacer"])
                elif who == "pacer_steady":
                    t, n = time_epoch(steady, cpu["pacer_steady"])
                elif who == "pacer_copy":
                    t, n = time_pacer(spec, args.batch, copy=True)
                else:
                    t, n = torch_peer.epoch(int(who.rsplit("_", 1)[1]))
                assert n == args.samples, (who, n)
                rows[who].append(t)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
        loads.append(os.getloadavg()[0])
        if torch_peer.close() != 0:
            raise RuntimeError("the DataLoader's process failed at its end")
        peers.remove(torch_peer)
        opened = time_open_many(scratch, args.open_shards)
        open_times = opened["open_s"]
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
            "pacer_steady_vs_cat": sps["pacer_steady"] / sps["cat"],
            "pacer_vs_best_torch": sps["pacer"] / sps[best_torch],
            "pacer_copy_vs_cat": sps["pacer_copy"] / sps["cat"],
            "pacer_copy_vs_best_torch": sps["pacer_copy"] / sps[best_torch],
            "spread_s": {k: [min(v), max(v)] for k, v in rows.items()},
            "cpu_s": cpu, "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
            "cpu_vs_cat": {k: statistics.median(v) / statistics.median(cpu["cat"]) for k, v in cpu.items() if k != "cat"},
            "open_shards": args.open_shards, "open_s": open_times, "open_median_s": statistics.median(open_times),
            "first_open_s": opened["first_open_s"], "first_open_median_s": statistics.median(opened["first_open_s"]),
            "tarfile_scan_s": opened["tarfile_scan_s"],
            "tarfile_scan_median_s": statistics.median(opened["tarfile_scan_s"]),
            "load_avg_1m": loads,
            "command": "PYTHONPATH=build/python /usr/bin/python3 bench/loader_vs_torch.py "
                       f"--samples {args.samples} --size {args.size} --per-shard {args.per_shard} "
                       f"--rounds {args.rounds} --open-shards {args.open_shards}" + (" --reread" if args.reread else "")
                       + (" --torch-in-process" if args.torch_in_process else ""),
            "torch_process": "this one (its workers fork it)" if args.torch_in_process else "a child process",
            "page_cache": "read back through pacer's mapping (--reread)" if args.reread else "as the writer left it",
        }
        result["first_open_vs_tarfile"] = result["first_open_median_s"] / result["tarfile_scan_median_s"]
        name = args.name or f"loader_vs_torch-{result['date']}"
        out = os.path.join(repo, "bench", "results", name)
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        md = [f"# pacer.data.Loader vs PyTorch DataLoader and cat, {result['date']}", "",
              f"Machine: `{platform.node()}`, {os.cpu_count()} CPUs, kernel {platform.release()}; torch {torch.__version__}. "
              f"{args.samples} two-field samples ({args.size} random bytes + a small JSON) in {len(paths)} GNU tar shards, batch {args.batch}, "
              f"shuffled, page cache warm ({result['page_cache']}), {args.rounds} rounds in rotating order, medians; DataLoader timed in {result['torch_process']}. Load average (1 min) at the "
              f"start of each round and at the end: {', '.join(f'{x:.1f}' for x in loads)}. `{result['command']}`.",
              "", "| reader | seconds [min-max] | samples/s | MB/s |", "|---|---:|---:|---:|"]
        for k in rows:
            md.append(f"| {k} | {med[k]:.3f} [{min(rows[k]):.3f}-{max(rows[k]):.3f}] | {sps[k]:,.0f} | {total_bytes / med[k] / 1e6:,.0f} |")
        md += ["", f"pacer (values are memoryviews into the batch buffer) / cat = {result['pacer_vs_cat']:.2f} (target >= 0.80); "
               f"pacer / best DataLoader ({best_torch}) = {result['pacer_vs_best_torch']:.2f} (target >= 3).",
               "", f"pacer_steady (the same loader's next epoch over a dataset opened once: entries loaded, shards mapped) / cat "
               f"= {result['pacer_steady_vs_cat']:.2f} (target >= 0.80).",
               "", f"pacer_copy (values copied to bytes, copy=True) / cat = {result['pacer_copy_vs_cat']:.2f}; "
               f"pacer_copy / best DataLoader = {result['pacer_copy_vs_best_torch']:.2f}.",
               "", f"CPU seconds (user + system, median): cat {result['cpu_median_s']['cat']:.3f}, pacer "
               f"{result['cpu_median_s']['pacer']:.3f} ({result['cpu_vs_cat']['pacer']:.2f}x cat), pacer_steady "
               f"{result['cpu_median_s']['pacer_steady']:.3f} ({result['cpu_vs_cat']['pacer_steady']:.2f}x cat); "
               "2 reader threads and the consumer together.",
               "", f"First open of {args.open_shards} two-member shards never indexed before (builds every index): "
               f"{result['first_open_median_s']:.3f} s against {result['tarfile_scan_median_s']:.3f} s for a plain "
               f"Python `tarfile` scan of the same shards: {result['first_open_vs_tarfile']:.2f}x (target <= 1). "
               f"Later opens (each index's header only): {result['open_median_s']:.3f} s (medians of 3)."]
        with open(out + ".md", "w") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
    finally:
        for peer in peers:
            peer.close()
        if args.keep:
            print(f"shards kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
