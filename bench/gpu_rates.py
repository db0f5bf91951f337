"""The GPU rates bench scripts compare against, measured with PyTorch the way `pacer vet` measures them."""
import statistics
import time

import torch


def sustained(fn, warmup_s=0.3, seconds=1.0, batch_s=0.05):
    """Median seconds per call over ~50 ms batches of back-to-back calls for `seconds`, after a warm-up:
    a GPU's clock follows its power draw, so a short burst overstates what it sustains."""
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    calls = max(1, int(batch_s / max(a.elapsed_time(b) / 1e3, 1e-6)))
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 3:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(samples)


def gemm_tflops(n=8192):
    """Sustained bf16 GEMM rate (gpu.gemm_bf16's size and timing), random inputs."""
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / sustained(lambda: torch.matmul(x, y, out=out)) / 1e12


def copy_gbps(nbytes=4 << 30):
    """Device-to-device copy bandwidth (read + write bytes), median of 20 after 2 untimed."""
    src = torch.randint(0, 255, (nbytes,), device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(22):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9
