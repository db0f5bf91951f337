"""PyTorch DDP (gloo, CPU) on the same synthetic backward as bench/comm_overlap.cpp.

Usage: /usr/bin/python3 bench/comm_overlap_ddp.py RANKS LAYERS LAYER_MIB COMPUTE_MS spin|sleep ROUNDS BUCKET_MIB
Prints one JSON object with the same keys as comm_overlap (the DDP run is "overlap_ddp_s").
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spin(iters):
    a, b, c = 1.0, 0.999999, 1e-7
    for _ in range(iters):
        a = a * b + c
    return a


class Layer(torch.autograd.Function):
    """Identity forward; backward spends the layer's compute and yields its gradient."""

    @staticmethod
    def forward(ctx, x, w, cfg):
        ctx.cfg = cfg
        ctx.w = w
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        cfg = ctx.cfg
        if cfg["sleep"]:
            time.sleep(cfg["compute_s"])
        else:
            spin(cfg["iters"])
        grad = torch.empty_like(ctx.w)
        grad.copy_(cfg["pattern"])
        return g, grad, None


class Model(torch.nn.Module):
    def __init__(self, layers, floats, cfg):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(floats)) for _ in range(layers)])
        self.cfg = cfg

    def forward(self, x):
        for w in self.ws:
            x = Layer.apply(x, w, self.cfg)
        return x.sum()


def worker(rank, n, layers, floats, compute_s, sleep, rounds, bucket_mib, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    iters = 0
    if not sleep:
        t = torch.tensor([0], dtype=torch.int64)
        if rank == 0:
            k = 1 << 14
            while True:
                t0 = time.perf_counter()
                spin(k)
                dt = time.perf_counter() - t0
                if dt > 0.02:
                    t[0] = int(k * compute_s / dt)
                    break
                k *= 2
        dist.broadcast(t, 0)
        iters = int(t[0])
    cfg = {"sleep": sleep, "compute_s": compute_s, "iters": iters, "pattern": torch.arange(floats) % 13}
    plain = Model(layers, floats, cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(Model(layers, floats, cfg), bucket_cap_mb=bucket_mib)
    flat = torch.zeros(layers * floats)
    x = torch.zeros(1, requires_grad=True)
    res = {k: [] for k in ("compute", "comm", "seq", "ddp")}

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        res[key].append(time.perf_counter() - t0)

    for _ in range(rounds):
        timed("compute", lambda: plain(x).backward())
        timed("comm", lambda: dist.all_reduce(flat))

        def seq():
            plain(x).backward()
            dist.all_reduce(torch.cat([w.grad for w in plain.ws]))
        timed("seq", seq)
        timed("ddp", lambda: ddp(x).backward())
        for m in (plain, ddp):
            m.zero_grad(set_to_none=True)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in res.items()}
        hidden = lambda total: 1 - (total - med["compute"]) / med["comm"]
        out.put({"ranks": n, "layers": layers, "gradient_mib": layers * floats * 4 / 2**20, "bucket_mib": bucket_mib,
                 "compute": "sleep" if sleep else "spin", "rounds": rounds,
                 "compute_ms_per_layer": round(compute_s * 1e3, 6), "compute_s": med["compute"],
                 "comm_s": med["comm"], "sequential_s": med["seq"], "overlap_ddp_s": med["ddp"],
                 "hidden_no_overlap": hidden(med["seq"]), "hidden_ddp": hidden(med["ddp"]),
                 "torch": torch.__version__})
    dist.destroy_process_group()


def main():
    n, layers, layer_mib, compute_ms, kind, rounds, bucket_mib = sys.argv[1:8]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (int(n), int(layers), int(float(layer_mib) * 2**20 / 4), float(compute_ms) / 1e3, kind == "sleep",
            int(rounds), float(bucket_mib), out)
    procs = mp.spawn(worker, args=args, nprocs=int(n), join=False)
    result = out.get()
    procs.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
