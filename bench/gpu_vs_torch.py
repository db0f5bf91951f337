"""pacer vet's GPU figures against PyTorch's on the same GPU, sizes and precisions, in one run.

Usage (GPU machine): python3 bench/gpu_vs_torch.py PACER_BINARY [--size 8192] [--rounds 3] [--out DIR]

Runs `pacer vet --only` the GEMM, HBM and transfer checks (JSON) and, on the same
sizes, torch.matmul (bf16, fp16, tf32, fp64), Tensor.copy_ and pinned/pageable
copies; prints and writes gpu_vs_torch.json with the ratios (target >= 0.97).

Both sides are measured the same way, since a GPU's clocks follow its power
draw: GEMM inputs are uniform in +-[0.5, 1) (pacer's distribution; all-positive
inputs toggle fewer bits and draw less power), a 0.3 s warm-up, then 50 ms
batches of back-to-back GEMMs for 1 s (vet's `seconds`), median batch. Copies:
4 GiB device copies, 20 timed after 2 untimed; transfers: 256 MiB, 11 timed
after one untimed, CUDA events, medians. For information the script also
records torch's GEMM timed in short bursts (10 GEMMs, median of 7), as a quick
benchmark would time it. Rounds alternate which tool goes first; the table
gives the median over rounds.
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

import torch


def timed(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def signed_uniform(n, dtype):
    u = torch.rand(n, n, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    sign = torch.randint(0, 2, (n, n), device="cuda", dtype=u.dtype).mul_(2).sub_(1)
    return u.mul_(0.5).add_(0.5).mul_(sign).to(dtype)


def torch_gemm(dtype, n, seconds, tf32=False):
    """pacer's method: warm-up, then 50 ms batches for `seconds`, median batch."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a, b = signed_uniform(n, dtype), signed_uniform(n, dtype)
    out = torch.empty(n, n, device="cuda", dtype=dtype)

    def run(k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(k):
            torch.matmul(a, b, out=out)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / k

    one = run(1)
    run(max(1, int(0.3 / one)))
    one = run(3)
    per_batch = max(1, int(0.05 / one))
    batches, t0 = [], time.monotonic()
    while len(batches) < 3 or time.monotonic() - t0 < seconds:
        batches.append(run(per_batch))
    return 2 * n ** 3 / statistics.median(batches) / 1e12


def torch_gemm_burst(dtype, n, tf32=False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.rand(n, n, device="cuda", dtype=torch.float32).add_(0.5).to(dtype)
    b = torch.rand(n, n, device="cuda", dtype=torch.float32).add_(0.5).to(dtype)
    reps = 10 if dtype != torch.float64 else 3

    def batch():
        for _ in range(reps):
            torch.matmul(a, b)

    t = timed(batch, 7) / reps
    return 2 * n ** 3 / t / 1e12


def torch_copy(nbytes):
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 20, warmup=2)
    return 2 * nbytes / t / 1e9


def torch_transfer(nbytes):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    pageable = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out = {}
    out["h2d_pinned"] = nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True), 11, warmup=1) / 1e9
    out["d2h_pinned"] = nbytes / timed(lambda: pinned.copy_(dev, non_blocking=True), 11, warmup=1) / 1e9
    out["h2d_pageable"] = nbytes / timed(lambda: dev.copy_(pageable), 11, warmup=1) / 1e9
    out["d2h_pageable"] = nbytes / timed(lambda: pageable.copy_(dev), 11, warmup=1) / 1e9
    return out


def run_pacer(pacer, checks, path):
    cmd = [pacer, "vet", "--only", ",".join(checks), "--json-file", path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
    with open(path) as f:
        vet = json.load(f)
    return {c["name"]: c.get("value") for c in vet["checks"] if c.get("target", "") in ("gpu0", "")}, r.returncode


def run_torch(size, seconds):
    figs = {
        "gpu.gemm_bf16": torch_gemm(torch.bfloat16, size, seconds),
        "gpu.gemm_fp16": torch_gemm(torch.float16, size, seconds),
        "gpu.gemm_tf32": torch_gemm(torch.float32, size, seconds, tf32=True),
        "gpu.gemm_fp64": torch_gemm(torch.float64, size, seconds),
        "gpu.hbm_bandwidth": torch_copy(4 << 30),
    }
    for k, v in torch_transfer(256 << 20).items():
        figs["gpu." + k] = v
    return figs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pacer")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed GEMM time per precision (vet's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    checks = ["gpu.gemm_bf16", "gpu.gemm_fp16", "gpu.gemm_tf32", "gpu.gemm_fp64", "gpu.hbm_bandwidth", "gpu.h2d_pinned",
              "gpu.d2h_pinned", "gpu.h2d_pageable", "gpu.d2h_pageable"]
    pacer_rounds, torch_rounds, exits = [], [], []
    for k in range(args.rounds):
        for tool in (["pacer", "torch"] if k % 2 == 0 else ["torch", "pacer"]):
            if tool == "pacer":
                figs, rc = run_pacer(args.pacer, checks, os.path.join(args.out, f"vet-gpu-round{k}.json"))
                pacer_rounds.append(figs)
                exits.append(rc)
            else:
                torch_rounds.append(run_torch(args.size, args.seconds))
        print(f"round {k + 1}/{args.rounds} done", file=sys.stderr)
    burst = {
        "gpu.gemm_bf16": torch_gemm_burst(torch.bfloat16, args.size),
        "gpu.gemm_fp16": torch_gemm_burst(torch.float16, args.size),
        "gpu.gemm_tf32": torch_gemm_burst(torch.float32, args.size, tf32=True),
        "gpu.gemm_fp64": torch_gemm_burst(torch.float64, args.size),
    }
    rows = []
    for name in checks:
        pv = [r[name] for r in pacer_rounds if r.get(name) is not None]
        tv = [r[name] for r in torch_rounds]
        p, t = (statistics.median(pv) if pv else None), statistics.median(tv)
        rows.append({"check": name, "pacer": p, "torch": t, "ratio": (p / t) if p else None, "pacer_rounds": pv,
                     "torch_rounds": tv, "torch_burst": burst.get(name)})
    result = {"schema": "pacer.bench.gpu_vs_torch/2", "date": datetime.date.today().isoformat(),
              "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "cuda": torch.version.cuda},
              "size": args.size, "seconds": args.seconds, "rounds": args.rounds, "rows": rows, "vet_exits": exits}
    with open(os.path.join(args.out, "gpu_vs_torch.json"), "w") as f:
        json.dump(result, f, indent=2)
    for row in rows:
        p = "-" if row["pacer"] is None else f"{row['pacer']:.1f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        b = "" if row["torch_burst"] is None else f"  (torch burst {row['torch_burst']:.1f})"
        print(f"{row['check']:22s} pacer {p:>8s}  torch {row['torch']:8.1f}  ratio {ratio}{b}")


if __name__ == "__main__":
    main()
