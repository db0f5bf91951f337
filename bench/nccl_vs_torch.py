#!/usr/bin/env python3
"""NCCL all-reduce bus bandwidth: `pacer comm bench --backend nccl` next to torch.distributed.all_reduce.

Both sides run one process per GPU, fp32 sum all-reduce, on the same message
sizes, timed the same way: before each timed call the ranks line up with a
one-element all-reduce, then the host times the call to its completion
(pacer: the CUDA event behind its Request; torch: torch.cuda.synchronize);
each size's figure is the median over iterations of the slowest rank's time.
busbw = bytes / time x 2(n-1)/n, as nccl-tests defines it. Rounds alternate
which tool goes first; the table gives the median over rounds.

    python3 bench/nccl_vs_torch.py --pacer build/bin/pacer --gpus 2 --out DIR

Both use the same libnccl: torch's own (the nvidia-nccl wheel) unless
--nccl-library names another, passed to pacer as PACER_NCCL_LIBRARY.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0) on both sides.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def worker(args):
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, n = dist.get_rank(), dist.get_world_size()
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    points = []
    for nbytes in args.sizes:
        count = nbytes // 4
        x = torch.rand(count, device="cuda").add_(rank)
        # Correctness once: sum over ranks of (rank + 1).
        probe = torch.full((count,), float(rank + 1), device="cuda")
        dist.all_reduce(probe)
        correct = bool(torch.all(probe == n * (n + 1) / 2).item())
        times = []
        for it in range(args.warmup + args.iters):
            dist.all_reduce(sync)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            if it >= args.warmup:
                times.append(time.perf_counter() - t0)
        worst = torch.tensor(times, dtype=torch.float64, device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        med = statistics.median(worst.tolist())
        algbw = count * 4 / med / 1e9
        points.append({"bytes": count * 4, "median_s": med, "algbw_gbps": algbw,
                       "busbw_gbps": algbw * 2 * (n - 1) / n, "correct": correct})
    if rank == 0:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        with open(args.output, "w") as f:
            json.dump({"ranks": n, "nccl": nccl, "torch": torch.__version__, "points": points}, f, indent=1)
    dist.destroy_process_group()


def torch_nccl_library():
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "nccl", "lib", "libnccl.so*")))
    return found[0] if found else None


def run_pacer(args, env, path):
    cmd = [args.mpirun, "--oversubscribe", "-np", str(args.gpus)]
    for k in ("NCCL_NVLS_ENABLE", "PACER_NCCL_LIBRARY", "LD_LIBRARY_PATH"):
        if k in env:
            cmd += ["-x", k]
    cmd += [args.pacer, "comm", "bench", "--backend", "nccl", "--collectives", "all_reduce", "--dtype", "fp32",
            "--min-size", str(args.min_size), "--max-size", str(args.max_size), "--step-factor", "4",
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", "--output", path]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        sys.exit(f"pacer comm bench failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(path) as f:
        rep = json.load(f)
    return {p["bytes"]: p for p in rep["collectives"][0]["points"]}, rep


def run_torch(args, env, sizes, path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
           os.path.abspath(__file__), "--worker", "--output", path, "--iters", str(args.iters), "--warmup",
           str(args.warmup), "--sizes", *[str(s) for s in sizes]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        sys.exit(f"torch all_reduce failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(path) as f:
        rep = json.load(f)
    return {p["bytes"]: p for p in rep["points"]}, rep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--output", help=argparse.SUPPRESS)
    ap.add_argument("--pacer", default="build/bin/pacer")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--min-size", type=int, default=1 << 20)
    ap.add_argument("--max-size", type=int, default=1 << 30)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nccl-library", help="libnccl.so.2 for both sides (default: torch's own)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", **MPI_ENV)
    lib = args.nccl_library or torch_nccl_library()
    if lib:
        env["PACER_NCCL_LIBRARY"] = lib
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    pacer_rep = torch_rep = None
    for k in range(args.rounds):
        order = ["pacer", "torch"] if k % 2 == 0 else ["torch", "pacer"]
        got = {}
        for tool in order:
            if tool == "pacer":
                got["pacer"], pacer_rep = run_pacer(args, env, os.path.join(args.out, f"pacer-round{k}.json"))
            else:
                sizes = sorted(got["pacer"]) if "pacer" in got else None
                if sizes is None:  # torch first: pacer's sizes are min * 4^i up to max
                    sizes, s = [], args.min_size
                    while s <= args.max_size:
                        sizes.append(s // 4 * 4)
                        s *= 4
                got["torch"], torch_rep = run_torch(args, env, sizes, os.path.join(args.out, f"torch-round{k}.json"))
        rounds.append(got)
        print(f"round {k + 1}/{args.rounds} done", file=sys.stderr)

    rows = []
    for nbytes in sorted(rounds[0]["pacer"]):
        p = [r["pacer"][nbytes]["busbw_gbps"] for r in rounds if nbytes in r["torch"]]
        t = [r["torch"][nbytes]["busbw_gbps"] for r in rounds if nbytes in r["torch"]]
        if not t:
            continue
        ok = all(r["pacer"][nbytes]["correct"] and r["torch"][nbytes]["correct"] for r in rounds)
        rows.append({"bytes": nbytes, "pacer_busbw_gbps": statistics.median(p), "torch_busbw_gbps": statistics.median(t),
                     "ratio": statistics.median(p) / statistics.median(t), "pacer_rounds": p, "torch_rounds": t,
                     "correct": ok})
    result = {
        "schema": "pacer.bench.nccl_vs_torch/1",
        "date": datetime.date.today().isoformat(),
        "machine": {"host": platform.node(), "gpus": args.gpus, "torch": torch_rep["torch"], "nccl": torch_rep["nccl"],
                    "nccl_library": lib},
        "method": {"dtype": "fp32", "op": "sum", "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
                   "busbw": "bytes / median(slowest rank's time) x 2(n-1)/n", "NCCL_NVLS_ENABLE": "0"},
        "rows": rows,
    }
    with open(os.path.join(args.out, "nccl_vs_torch.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'BYTES':>12s} {'PACER GB/s':>11s} {'TORCH GB/s':>11s} {'RATIO':>6s}")
    for r in rows:
        print(f"{r['bytes']:12d} {r['pacer_busbw_gbps']:11.1f} {r['torch_busbw_gbps']:11.1f} {r['ratio']:6.3f}"
              + ("" if r["correct"] else "  WRONG RESULT"))


if __name__ == "__main__":
    main()
