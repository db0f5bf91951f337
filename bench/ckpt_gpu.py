"""pacer checkpoints of a GPU training state next to torch.save, torch.distributed.checkpoint and dd/cat.

The state is what a training job holds on the GPU: a stack of bf16 Linear
layers (default 48 x 4096 x 4096) and its AdamW state after one real step
(random data and gradients, never zeros), 4.83 GB for the default. Every round
times each contender once, in an order that rotates between rounds:

- d2h:        a pinned device-to-host copy of every tensor (the floor for save() blocking)
- pacer:      save() returning (blocked) and save until durable (wait())
- dd:         dd conv=fsync of pacer's data file, read from the page cache
- torch.save: torch.save of the state dict + fsync
- dcp:        torch.distributed.checkpoint.save; dcp.async_save (blocked, finished)
- loads, each from a cold page cache back into the GPU state: pacer load(into=),
  torch.load(map_location=cuda), dcp.load, and cat of pacer's files

    PYTHONPATH=... python3 bench/ckpt_gpu.py --dir SCRATCH --out RESULT.json [--rounds 3]

Writes one JSON file with the machine, versions, raw per-round numbers,
medians, spreads, ratios and the issue's targets with `met`.

Several ranks (`torchrun --nproc-per-node N bench/ckpt_gpu.py ...`): every rank
holds the same state (DDP: replicated), NCCL when each rank has a GPU of its
own, gloo otherwise (several ranks sharing one GPU, or `--device cpu`). Every
figure is the slowest rank's, each contender starting after a barrier:
pacer's collective save and load(into=) on every rank (and, for comparison,
load(into=, collective=False): every rank reading the whole state); `torch.save` by rank 0
alone (the DDP habit) and `torch.load` on every rank; DCP collectively; `dd`
of each rank's own data file, all at once; `cat` of the step's files once.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_vs_torch import evict, run_dd  # noqa: E402  (page-cache control and dd, shared with the CPU benchmark)

import pacer  # noqa: E402


RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
_TIMING = None  # a gloo group for the barriers and the max of the ranks' times


def log(msg):
    if RANK == 0:
        print(f"ckpt_gpu: {msg}", flush=True)


def now():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def start():
    """Every rank begins a timed step together."""
    if WORLD > 1:
        torch.distributed.barrier(group=_TIMING)
    return now()


def slowest(seconds):
    """The slowest rank's time for the step (every rank gets it)."""
    if WORLD == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=_TIMING)
    return float(t.item())


def setup_ranks(device):
    """torchrun's ranks: the process group, and this rank's device."""
    global _TIMING
    if WORLD == 1:
        return torch.device(device), None
    local = int(os.environ.get("LOCAL_RANK", RANK))
    own_gpu = device == "cuda" and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
    backend = "nccl" if own_gpu else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    torch.distributed.init_process_group(backend)
    _TIMING = torch.distributed.new_group(backend="gloo")
    return dev, backend


def make_state(layers, hidden, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(8, hidden, device=device, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def tensors_of(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_of(v, out)
    return out


def same_state(a, b):
    ta, tb = tensors_of(a, []), tensors_of(b, [])
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu() if x.device != y.device else x, y.cpu() if x.device != y.device else y) for x, y in zip(ta, tb))


def clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def poison(state):
    for t in tensors_of(state, []):
        if t.is_floating_point():
            t.fill_(-7.0)


def files_in(d):
    return sorted(os.path.join(d, n) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))


def rm(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "raw": xs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch directory on the disk to measure (removed at the end)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated contenders to leave out")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run of the script)")
    ap.add_argument("--share-over-gloo", action="store_true",
                    help="several ranks: share loaded pieces over gloo too (pacer.checkpoint._SHARE_OVER_GLOO)")
    a = ap.parse_args()
    if a.share_over_gloo:
        pacer.checkpoint._SHARE_OVER_GLOO = True
    skip = set(filter(None, a.skip.split(",")))
    dev, backend = setup_ranks(a.device)
    load_start = os.getloadavg()
    os.makedirs(a.dir, exist_ok=True)
    cache = {"drop_caches": None}

    model, opt = make_state(a.layers, a.hidden, dev)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    gpu = tensors_of(state, [])
    total = sum(t.numel() * t.element_size() for t in gpu)
    reference = clone(state)
    log(f"state: {len(gpu)} tensors, {total / 1e9:.2f} GB")

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.type == "cuda") for t in gpu]
    errors, raw, checks = {}, {}, {}

    def rec(name, value):
        raw.setdefault(name, []).append(value)

    def attempt(name, fn):
        if name in skip:
            return
        try:
            fn()
        except Exception as e:  # a contender that fails is recorded, the others still run
            errors.setdefault(name, []).append(f"{type(e).__name__}: {e}")
            log(f"{name} failed: {type(e).__name__}: {e}")

    ck_root = os.path.join(a.dir, "pacer")
    ck = pacer.Checkpointer(ck_root, keep_last=1, staging_bytes=total + (256 << 20))
    t0 = start()
    h = ck.save(0, state)
    first_blocked = slowest(time.perf_counter() - t0)
    h.wait()
    first_durable = slowest(time.perf_counter() - t0)
    log(f"first save (allocates and pins staging): blocked {first_blocked:.3f} s, durable {first_durable:.3f} s")
    step = [0]

    def step_dir():
        return os.path.join(ck_root, f"step-{step[0]:012d}")

    def timed(key, t0, at=None):
        """Records the slowest rank's seconds since t0 (every rank must call it)."""
        rec(key, slowest((time.perf_counter() if at is None else at) - t0))

    def barrier():
        if WORLD > 1:
            torch.distributed.barrier(group=_TIMING)

    def sync_all():
        os.sync()
        barrier()

    def evict_all(path):
        if RANK == 0:
            evict(path, cache)
        barrier()

    def rm_all(path):
        barrier()
        if RANK == 0:
            rm(path)
        barrier()

    def c_d2h():
        t0 = start()
        for p, t in zip(pinned, gpu):
            p.copy_(t, non_blocking=True)
        timed("d2h_s", t0, now())

    def c_pacer():
        step[0] += 1
        sync_all()
        t0 = start()
        h = ck.save(step[0], state)
        blocked = time.perf_counter() - t0
        h.wait()
        durable = time.perf_counter()
        rec("pacer_blocked_s", slowest(blocked))
        timed("pacer_durable_s", t0, durable)

    def c_dd():
        # Each rank writes its own part of the step as pacer did: its data
        # file, the ranks at once.
        src = files_in(step_dir())
        mine = [f for f in src if os.path.basename(f) == f"rank-{RANK:05d}.bin"] or [max(src, key=os.path.getsize)]
        data = mine[0]
        with open(data, "rb") as f:  # the source from the page cache: dd measures the write alone
            while f.read(64 << 20):
                pass
        dst = os.path.join(a.dir, f"dd-{RANK}.bin")
        sync_all()
        start()
        s, _, _ = run_dd(["dd", f"if={data}", f"of={dst}", "bs=64M", "conv=fsync"])
        rec("dd_fsync_s", slowest(s))
        n = torch.tensor([os.path.getsize(data)], dtype=torch.float64)
        if WORLD > 1:
            torch.distributed.all_reduce(n, group=_TIMING)
        rec("dd_bytes", float(n.item()))
        os.unlink(dst)
        barrier()

    def c_torch_save():
        # The DDP habit: rank 0 saves, every rank loads.
        path = os.path.join(a.dir, "torch.pt")
        sync_all()
        t0 = start()
        if RANK == 0:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        timed("torch_save_s", t0)
        evict_all(path)
        t0 = start()
        loaded = torch.load(path, map_location=dev, **({"weights_only": False} if torch.__version__ >= "2" else {}))
        timed("torch_load_s", t0, now())
        del loaded
        rm_all(path)

    def c_dcp():
        import torch.distributed.checkpoint as dcp
        path = os.path.join(a.dir, "dcp")
        sync_all()
        t0 = start()
        dcp.save(state, checkpoint_id=path)
        timed("dcp_save_s", t0)
        evict_all(path)
        poison(state)
        t0 = start()
        dcp.load(state, checkpoint_id=path)
        timed("dcp_load_s", t0, now())
        checks.setdefault("dcp_load_equal", []).append(same_state(state, reference))
        rm_all(path)
        if hasattr(dcp, "async_save"):
            path2 = os.path.join(a.dir, "dcp_async")
            sync_all()
            t0 = start()
            fut = dcp.async_save(state, checkpoint_id=path2)
            blocked = time.perf_counter() - t0
            fut.result()
            done = time.perf_counter()
            rec("dcp_async_blocked_s", slowest(blocked))
            timed("dcp_async_done_s", t0, done)
            rm_all(path2)

    def c_loads():
        d = step_dir()
        files = files_in(d)
        evict_all(d)
        t0 = start()
        if RANK == 0:  # the step's bytes read once: the floor for any number of readers on one host
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        timed("cat_s", t0)
        evict_all(d)
        poison(state)
        t0 = start()
        ck.load(into=state)
        timed("pacer_load_s", t0, now())
        checks.setdefault("pacer_load_equal", []).append(same_state(state, reference))
        checks.setdefault("pacer_last_load_rank0", []).append(getattr(ck, "last_load", None))
        if WORLD > 1:  # every rank reading the whole state itself, as before loads were shared
            evict_all(d)
            poison(state)
            t0 = start()
            ck.load(into=state, collective=False)
            timed("pacer_load_alone_s", t0, now())
            checks.setdefault("pacer_load_alone_equal", []).append(same_state(state, reference))

    def summarise(rounds_done):
        med = {k: stats(v) for k, v in raw.items()}

        def m(k):
            return med[k]["median"] if med.get(k) else None

        def ratio(x, y):
            return None if m(x) is None or m(y) is None else m(x) / m(y)

        dd_rate = (m("dd_bytes") / m("dd_fsync_s")) if m("dd_bytes") and m("dd_fsync_s") else None
        dd_same_bytes = total / dd_rate if dd_rate else None
        targets = {
            "pacer_blocked / d2h <= 2": ratio("pacer_blocked_s", "d2h_s"),
            "pacer_durable / dd_fsync(same bytes) <= 1.1": (m("pacer_durable_s") / dd_same_bytes) if dd_same_bytes and m("pacer_durable_s") else None,
            "pacer_load / cat <= 1.15": ratio("pacer_load_s", "cat_s"),
            "dcp_load / pacer_load >= 1.4": ratio("dcp_load_s", "pacer_load_s"),
            "dcp_async_blocked / pacer_blocked": ratio("dcp_async_blocked_s", "pacer_blocked_s"),
            "torch_save / pacer_durable": ratio("torch_save_s", "pacer_durable_s"),
            "torch_load / pacer_load": ratio("torch_load_s", "pacer_load_s"),
            "pacer_load_alone / pacer_load": ratio("pacer_load_alone_s", "pacer_load_s"),
        }
        limits = {"pacer_blocked / d2h <= 2": ("<=", 2), "pacer_durable / dd_fsync(same bytes) <= 1.1": ("<=", 1.1),
                  "pacer_load / cat <= 1.15": ("<=", 1.15), "dcp_load / pacer_load >= 1.4": (">=", 1.4)}
        met = {k: (None if targets[k] is None else (targets[k] <= v if op == "<=" else targets[k] >= v)) for k, (op, v) in limits.items()}
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else "none"
        try:
            st = ck.stats()
            pacer_stats = dict(st)
        except Exception as e:  # older module without stats()
            pacer_stats = f"{type(e).__name__}: {e}"
        result = {
            "schema": "pacer.bench.ckpt_gpu/1",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": socket.gethostname(), "gpu": smi, "cpus": os.cpu_count(), "kernel": platform.release(),
                        "loadavg_start_end": [load_start, os.getloadavg()], "torch": torch.__version__, "python": platform.python_version(),
                        "drop_caches": cache["drop_caches"]},
            "command": " ".join(sys.argv),
            "ranks": {"world_size": WORLD, "backend": backend, "device": str(dev),
                      "note": "every figure is the slowest rank's" if WORLD > 1 else None},
            "state": {"layers": a.layers, "hidden": a.hidden, "tensors": len(gpu), "bytes": total, "dtype": "bfloat16", "optimizer": "AdamW"},
            "first_save": {"blocked_s": first_blocked, "durable_s": first_durable},
            "pacer_stats": pacer_stats,
            "medians": med,
            "dd_rate_Bps": dd_rate,
            "ratios": targets,
            "met": met,
            "checks": checks,
            "errors": errors,
        }
        result["rounds_done"] = rounds_done
        if RANK != 0:
            return med, targets, met
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        return med, targets, met

    contenders = [("d2h", c_d2h), ("pacer", c_pacer), ("dd", c_dd), ("torch", c_torch_save), ("dcp", c_dcp), ("loads", c_loads)]
    for r in range(a.rounds):
        k = r % len(contenders)
        order = contenders[k:] + contenders[:k]
        # loads read pacer's newest step: keep pacer before them in every round
        if [n for n, _ in order].index("loads") < [n for n, _ in order].index("pacer"):
            order = [c for c in order if c[0] != "loads"] + [c for c in order if c[0] == "loads"]
        log(f"round {r + 1}/{a.rounds}: {' '.join(n for n, _ in order)}")
        for name, fn in order:
            attempt(name, fn)
        log(f"round {r + 1} done: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in raw.items() if v and k.endswith("_s")))
        summarise(r + 1)  # a run cut short still leaves its finished rounds

    med, targets, met = summarise(a.rounds)
    if WORLD > 1:
        torch.distributed.barrier(group=_TIMING)
        torch.distributed.destroy_process_group()
    if RANK == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
    log("medians: " + ", ".join(f"{k} {v['median']:.3f}" for k, v in med.items() if v and k.endswith("_s")))
    log("ratios: " + json.dumps({k: (round(v, 3) if v is not None else None) for k, v in targets.items()}))
    log(f"met: {met}; checks: {checks}; errors: {list(errors)}")


if __name__ == "__main__":
    main()
