"""pacer vet's GPU figures against PyTorch's on the same GPU, sizes and precisions, in one run.

Usage (GPU machine): python3 bench/gpu_vs_torch.py PACER_BINARY [--size 8192] [--out DIR]
Runs `pacer vet --only` the GEMM, HBM and transfer checks (JSON) and, on the same
sizes, torch.matmul (bf16, fp16, tf32, fp64), Tensor.copy_ and pinned/pageable
copies; prints and writes gpu_vs_torch.json with the ratios (target >= 0.97).
Inputs are random (never zeros); medians of timed repetitions with CUDA events.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

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


def torch_gemm(dtype, n, tf32=False):
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
    t = timed(lambda: dst.copy_(src), 20)
    return 2 * nbytes / t / 1e9


def torch_transfer(nbytes):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    pageable = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out = {}
    out["h2d_pinned"] = nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True), 5) / 1e9
    out["d2h_pinned"] = nbytes / timed(lambda: pinned.copy_(dev, non_blocking=True), 5) / 1e9
    out["h2d_pageable"] = nbytes / timed(lambda: dev.copy_(pageable), 5) / 1e9
    out["d2h_pageable"] = nbytes / timed(lambda: pageable.copy_(dev), 5) / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pacer")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    vet_json = os.path.join(args.out, "vet-gpu.json")
    checks = ["gpu.gemm_bf16", "gpu.gemm_fp16", "gpu.gemm_tf32", "gpu.gemm_fp64", "gpu.hbm_bandwidth", "gpu.h2d_pinned",
              "gpu.d2h_pinned", "gpu.h2d_pageable", "gpu.d2h_pageable"]
    cmd = [args.pacer, "vet", "--only", ",".join(checks), "--json-file", vet_json]
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout[-4000:], r.stderr[-2000:], file=sys.stderr)
    vet = json.load(open(vet_json))
    figures = {c["name"]: c.get("value") for c in vet["checks"] if c.get("target", "") in ("gpu0", "")}
    torch_figs = {
        "gpu.gemm_bf16": torch_gemm(torch.bfloat16, args.size),
        "gpu.gemm_fp16": torch_gemm(torch.float16, args.size),
        "gpu.gemm_tf32": torch_gemm(torch.float32, args.size, tf32=True),
        "gpu.gemm_fp64": torch_gemm(torch.float64, args.size),
        "gpu.hbm_bandwidth": torch_copy(4 << 30),
    }
    for k, v in torch_transfer(256 << 20).items():
        torch_figs["gpu." + k] = v
    rows = []
    for name, tv in torch_figs.items():
        pv = figures.get(name)
        rows.append({"check": name, "pacer": pv, "torch": tv, "ratio": (pv / tv) if pv else None})
    result = {"schema": "pacer.bench.gpu_vs_torch/1", "date": datetime.date.today().isoformat(),
              "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "cuda": torch.version.cuda}, "size": args.size, "rows": rows, "vet_exit": r.returncode}
    with open(os.path.join(args.out, "gpu_vs_torch.json"), "w") as f:
        json.dump(result, f, indent=2)
    for row in rows:
        p = "-" if row["pacer"] is None else f"{row['pacer']:.1f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{row['check']:22s} pacer {p:>8s}  torch {row['torch']:8.1f}  ratio {ratio}")


if __name__ == "__main__":
    main()
