#!/usr/bin/env python3
"""Trains model.py's decoder on a pacer token dataset; resumes from its latest checkpoint.

    python3 examples/gpt/train.py --data OUT/data --ckpt CKPT_DIR [--config tiny] [--steps 200] ...

Pacer supplies the data (pacer.data.Loader, packed rows), the checkpoints (pacer.Checkpointer:
model, optimizer, LR schedule, loader position and RNG states), the telemetry (pacer.telemetry.step)
and the supervision contract (pacer.run: heartbeat, checkpoint requests, the checkpoint directory).
A rerun with the same arguments continues from the newest valid checkpoint, and every later step's
loss equals what an uninterrupted run computes, bit for bit.

Several ranks: start it with torchrun (rank and world size from the environment); the CPU uses gloo.
"""
import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time

# cuBLAS is deterministic only with a fixed workspace; set before torch initialises CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pacer  # noqa: E402
import pacer._dist  # noqa: E402
import pacer.data  # noqa: E402
import pacer.run  # noqa: E402
import pacer.telemetry  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as gpt  # noqa: E402
import plan  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the example decoder with pacer.")
    ap.add_argument("--data", required=True, help="the token dataset prefix (prepare.py's OUT/data)")
    ap.add_argument("--ckpt", help="checkpoint root (default: $PACER_CKPT_DIR under pacer run)")
    ap.add_argument("--config", default="tiny", help=f"model size: {', '.join(gpt.CONFIGS)}")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per rank per step")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak")
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="save every N steps (and when pacer run asks); default: N from pacer plan ckpt")
    ap.add_argument("--first-save", type=int, default=None,
                    help="also save after this step (default with a planned interval: step 10, whose cost plans N)")
    ap.add_argument("--mtbf", default="3h", help="planned interval: the job's mean time between failures")
    ap.add_argument("--restart-cost", default="1m", help="planned interval: from a failure to training again")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: --comm-tune's, else DDP's 25)")
    ap.add_argument("--comm-tune", help="a `pacer comm tune --json` report: DDP's bucket size from it")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="autocast dtype on CUDA (the CPU trains in float32)")
    ap.add_argument("--attention", default="auto", choices=list(gpt.ATTENTION),
                    help="attention kernel (auto: flex_attention's block mask on a GPU with torch >= 2.5, else SDPA "
                         "with a dense mask, else explicit softmax); the same kernel on resume keeps losses bit-identical")
    ap.add_argument("--losses", help="JSON lines file of per-step losses (default: CKPT/losses.jsonl)")
    ap.add_argument("--telemetry-db", help="telemetry catalog (default: $PACER_TELEMETRY_DB or the job's)")
    ap.add_argument("--summary", help="write this run's timings here as JSON (pacer.example.gpt.train/1)")
    ap.add_argument("--warmup-steps-timed", type=int, default=3,
                    help="--summary: the first N steps of a process are left out of its timings")
    ap.add_argument("--baseline", action="store_true",
                    help="the same loop the usual way: torch DataLoader over the same tokens, torch.save checkpoints")
    ap.add_argument("--workers", type=int, default=2, help="--baseline: DataLoader worker processes")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="read each batch when its step starts, not during the step before (the same batches either way)")
    # For tests: after this step (its checkpoint committed) wait to be killed, so a kill lands at a known step;
    # only in a job's first attempt, so the restarted run goes on.
    ap.add_argument("--hold-after", type=int, default=None, help=argparse.SUPPRESS)
    # For tests: sleep this long after every step in a job's first allocation, so its time limit comes mid-run.
    ap.add_argument("--slow-first", type=float, default=0.0, help=argparse.SUPPRESS)
    # For tests: this rank (RANK:STEP or STEP for rank 0) raises CUDA's out-of-memory error at that step.
    ap.add_argument("--fake-oom-at", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.ckpt = pacer.run.ckpt_dir(a.ckpt)
    if not a.ckpt:
        ap.error("--ckpt is required outside pacer run")
    if a.steps < 1 or (a.ckpt_every is not None and a.ckpt_every < 1) or a.batch_size < 1 or a.seq_len < 2:
        ap.error("--steps, --ckpt-every, --batch-size must be >= 1 and --seq-len >= 2")
    if a.ckpt_every is None and a.first_save is None:
        a.first_save = 10
    if a.first_save is not None:
        a.first_save = max(0, min(a.first_save, a.steps - 1))
    return a


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cosine_schedule(optimizer, warmup, total, min_ratio):
    def factor(step):  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(model, lr, weight_decay):
    # Norm weights and (none here) biases are not decayed; matrices and embeddings are.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def rewrite_losses(path, upto):
    """Keeps the records of steps <= upto (a resumed run rewrites what it computes again), atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= upto]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def batches(loader):
    """Batches forever: each pass over the loader is one epoch."""
    while True:
        got = False
        for b in loader:
            got = True
            yield b
        if not got:
            raise SystemExit("train: the dataset gives no batch (too few tokens for one row per rank?)")


def planned_interval(save_s, step_s, mtbf, restart_cost, write_s=0.0):
    """(N steps, pacer plan ckpt's report): Daly's interval for this save cost, in steps of this length, and
    never shorter than twice the first save's write time: on the H200 machine later writes took up to 1.7x
    the first one's (bench/results/gpt-1b-h200-2026-12-01-defer/)."""
    cmd = [plan.pacer_bin("train", "or fix the interval with --ckpt-every"), "plan", "ckpt",
           "--save-cost", f"{max(save_s, 1e-6):.6f}s", "--mtbf", mtbf,
           "--restart-cost", restart_cost, "--write-time", f"{2 * write_s:.6f}s", "--json"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:  # its 2 (a bad --mtbf or --restart-cost) is ours too
        print(f"train: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}", file=sys.stderr, flush=True)
        sys.exit(2 if r.returncode == 2 else 3)
    report = json.loads(r.stdout)
    interval = report.get("interval_s") or report.get("daly_interval_s")
    if not interval or not step_s:
        return 1, report
    return max(1, int(round(interval / step_s))), report


def bucket_cap(a, rank):
    """DDP's bucket_cap_mb and where it came from: --bucket-mb, a pacer comm tune report, or DDP's default."""
    if a.bucket_mb is not None:
        return a.bucket_mb, "--bucket-mb"
    if a.comm_tune:
        try:
            with open(a.comm_tune) as f:
                report = json.load(f)
            for s in report.get("settings", []):
                if s.get("framework") == "pytorch_ddp" and s.get("recommended"):
                    return float(s["recommended"]), f"pacer comm tune ({a.comm_tune})"
        except (OSError, ValueError) as e:
            raise SystemExit(f"train: --comm-tune {a.comm_tune}: {e}")
        raise SystemExit(f"train: --comm-tune {a.comm_tune}: no pytorch_ddp setting (not a pacer.comm.tune/1 report?)")
    return 25.0, "DDP's default"


def is_oom(e):
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def report_oom(e, a, cfg, world, device):
    gpu = None
    if device.type == "cuda":
        gpu = f"{torch.cuda.get_device_properties(device).total_memory}B"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"train: out of memory on {device} with --config {a.config} --batch-size {a.batch_size} --seq-len {a.seq_len}: "
          f"{first}\ntrain: pacer plan memory's estimate for this model (GPT-shaped, bf16 weights and fp32 Adam; this "
          f"loop keeps fp32 weights, 16 B per parameter):\n"
          + plan.memory_estimate(cfg, a.seq_len, a.batch_size, world, gpu)
          + "\ntrain: lower --batch-size or --seq-len, or pick a smaller --config", file=sys.stderr, flush=True)


def documents_read(cu_seqlens, documents):
    """[(document, tokens read)] of a packed batch: segment k covers cu[k]..cu[k+1] of the flattened rows and
    belongs to documents[k] (-1: padding). Counted after the step, outside its data wait."""
    cu, docs = np.asarray(cu_seqlens), np.asarray(documents)
    seen = {}
    for k, doc in enumerate(docs.tolist()):
        if doc >= 0:
            seen[doc] = seen.get(doc, 0) + int(cu[k + 1] - cu[k])
    return sorted(seen.items())


class PacerData:
    """pacer.data.Loader: packed rows, document-aware position ids, a resumable position."""

    def __init__(self, a, dataset, device):
        self.loader = pacer.data.Loader(dataset, batch_size=a.batch_size, seq_len=a.seq_len, pack=True, seed=a.seed,
                                        threads=2, prefetch=4, pin_memory=device.type == "cuda")
        self.device, self.batch_size = device, a.batch_size
        self.it = None
        self.ahead = None  # (the loader's state before it, the batch read ahead by prefetch())

    def __len__(self):
        return len(self.loader)

    def epoch(self):
        return self.ahead[0]["epoch"] if self.ahead else self.loader.epoch

    def prefetch(self):
        """Reads the next batch and queues its copy to the GPU now, while the GPU still runs this step's kernels,
        so the next step starts without waiting for the host work. state_dict() and epoch() stay those of the
        batch next() returns, so a checkpoint taken in between resumes with the batch read ahead."""
        if self.ahead is None:
            state = self.loader.state_dict()
            self.ahead = (state, self._read())

    def next(self):
        if self.ahead is not None:
            batch, self.ahead = self.ahead[1], None
            return batch
        return self._read()

    def _read(self):
        if self.it is None:
            self.it = batches(self.loader)
        b = next(self.it)
        d = self.device
        host = {k: np.asarray(b[k]) for k in ("tokens", "position_ids", "lengths")}
        short = self.batch_size - len(host["lengths"])
        if short > 0:
            # An epoch's last batch may have fewer rows: rows of padding (length 0, every label -100) keep the
            # shape, so a compiled kernel (flex_attention's) is not compiled again for it, and the loss is the same.
            n = host["tokens"].shape[1]
            host["tokens"] = np.concatenate([host["tokens"], np.zeros((short, n), host["tokens"].dtype)])
            host["position_ids"] = np.concatenate([host["position_ids"], np.broadcast_to(
                np.arange(n, dtype=host["position_ids"].dtype), (short, n))])
            host["lengths"] = np.concatenate([host["lengths"], np.zeros(short, host["lengths"].dtype)])
        tokens = torch.as_tensor(host["tokens"]).to(d, non_blocking=True)
        pos = torch.as_tensor(host["position_ids"]).to(d, non_blocking=True).long()
        lengths = torch.as_tensor(host["lengths"]).to(d, non_blocking=True).long()
        return {"tokens": tokens, "pos": pos, "labels": gpt.labels_for(tokens, pos, lengths),
                "n_tokens": int(host["lengths"].sum()), "host_tokens": b["tokens"],
                "documents": (b["cu_seqlens"], b["documents"]),
                # The loader's pinned buffers go back to its pool when `b` is dropped: the copies above may still
                # be queued behind the running step (prefetch), so the batch keeps `b` until the step is over.
                "host_batch": b}

    def state_dict(self):
        return self.ahead[0] if self.ahead else self.loader.state_dict()

    def load_state_dict(self, s):
        self.ahead = None
        self.loader.load_state_dict(s)


class TokenWindows(torch.utils.data.Dataset):
    """The usual way: the dataset's .bin as one flat token array, cut into seq_len windows."""

    DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}

    def __init__(self, prefix, seq_len):
        with open(prefix + ".idx", "rb") as f:
            head = f.read(18)  # Megatron's index: 9-byte magic, u64 version, u8 dtype code
        if len(head) < 18 or head[:9] != b"MMIDIDX\x00\x00" or head[17] not in self.DTYPES:
            raise SystemExit(f"train: {prefix}.idx is not a Megatron index")
        self.tokens = np.memmap(prefix + ".bin", dtype=self.DTYPES[head[17]], mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len], dtype=np.int64))


class BaselineData:
    def __init__(self, a, prefix, device, rank, world):
        self.ds = TokenWindows(prefix, a.seq_len)
        g = torch.Generator()
        g.manual_seed(a.seed)
        sampler = torch.utils.data.DistributedSampler(self.ds, num_replicas=world, rank=rank, shuffle=True,
                                                      seed=a.seed, drop_last=True) if world > 1 else None
        self.loader = torch.utils.data.DataLoader(
            self.ds, batch_size=a.batch_size, shuffle=sampler is None, sampler=sampler, generator=g, drop_last=True,
            num_workers=a.workers, pin_memory=device.type == "cuda", persistent_workers=a.workers > 0)
        self.sampler, self.device, self.it, self._epoch = sampler, device, None, 0

    def __len__(self):
        return len(self.loader)

    def epoch(self):
        return self._epoch

    def next(self):
        while True:
            if self.it is None:
                if self.sampler is not None:
                    self.sampler.set_epoch(self._epoch)
                self.it = iter(self.loader)
            try:
                tokens = next(self.it).to(self.device, non_blocking=True)
                break
            except StopIteration:
                self.it, self._epoch = None, self._epoch + 1
        labels = torch.full_like(tokens, -100)
        labels[:, :-1] = tokens[:, 1:]
        return {"tokens": tokens, "pos": None, "labels": labels, "n_tokens": tokens.numel(), "host_tokens": None,
                "documents": None}


class PacerSaver:
    """pacer.Checkpointer: the state staged, then written in the background; the next save waits for it."""

    def __init__(self, a, net, optimizer):
        # Staging as large as the state (weights and AdamW's two moments), so save() returns once the bytes are
        # copied and never waits for the disk (docs/checkpoint.md, "Staging memory"). On a GPU the pool is made
        # and page-locked in the background now (reserve), so the first save does not pay for it; on the CPU its
        # buffers are made on first use (a tiny model's state takes a few of them).
        state = sum(p.numel() * p.element_size() for p in net.parameters()) * 3
        staging = max(1 << 30, -(-(state + (state >> 4) + (256 << 20)) // (64 << 20)) * (64 << 20))
        self.ck = pacer.Checkpointer(a.ckpt, keep_last=a.keep_last, staging_bytes=staging)
        device = next(net.parameters()).device
        if device.type == "cuda":
            self.ck.reserve(device)
        self.optimizer = optimizer
        self.pending = None

    def resume(self):
        return self.ck.load() if self.ck.steps() else None

    def save(self, step, state_fn, meta, wait):
        if self.pending is not None:
            self.pending.wait()
        # before=: the GPU tensors' copies run during the next forward and backward; the optimizer's next
        # step waits for them on the GPU (torch >= 2.0; older torch copies before save() returns).
        self.pending = self.ck.save(step, state_fn(), meta=meta, before=self.optimizer)
        if wait:
            self.pending.wait()

    def durable(self):
        """Whether the last save is durable. With several ranks a save commits in wait(): it waits here."""
        if self.pending is None:
            return True
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.pending.wait()
            return True
        return self.pending.done()

    def close(self):
        if self.pending is not None:
            self.pending.wait()
        self.ck.flush()


class TorchSaver:
    """The usual way: torch.save of the whole state to a file, the loop waiting; the oldest beyond --keep-last removed."""

    def __init__(self, a):
        self.dir, self.keep = a.ckpt, a.keep_last
        os.makedirs(self.dir, exist_ok=True)

    def _files(self):
        return sorted(f for f in os.listdir(self.dir) if f.startswith("torch-") and f.endswith(".pt"))

    def resume(self):
        files = self._files()
        if not files:
            return None
        s = torch.load(os.path.join(self.dir, files[-1]), map_location="cpu")
        return s["step"], s, s.get("meta", {})

    def save(self, step, state_fn, meta, wait):
        if dist.is_initialized() and dist.get_rank() != 0:
            return  # the usual way: rank 0 writes the (replicated) state
        path = os.path.join(self.dir, f"torch-{step:012d}.pt")
        torch.save({**state_fn(), "step": step, "meta": meta}, path + ".tmp")
        os.replace(path + ".tmp", path)
        for old in self._files()[:-self.keep]:
            os.unlink(os.path.join(self.dir, old))

    def durable(self):
        return True  # torch.save returned after the file was written

    def close(self):
        pass


def timed_allreduce_hook(clock):
    """DDP's all-reduce, timed: comm_s is the sum over buckets of launch to completion (overlapped with backward)."""
    def hook(state, bucket):
        t0 = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            clock[0] += time.perf_counter() - t0
            return f.value()[0]
        return fut.then(done)
    return hook


def main(argv=None):
    a = parse_args(argv)
    pacer.run.watch()  # before anything slow: the request signal must not kill us
    env = pacer._dist.environment_rank()  # torchrun's RANK/WORLD_SIZE, or srun's SLURM_PROCID/SLURM_NTASKS
    world = env[1] if env else 1
    if world > 1 and not dist.is_initialized():
        os.environ.setdefault("RANK", str(env[0]))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl" if a.device.startswith("cuda") else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if a.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        a.device = f"cuda:{local}"
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if a.telemetry_db:
        pacer.telemetry.open(a.telemetry_db)

    if not (os.path.exists(a.data + ".idx") and os.path.exists(a.data + ".bin")):
        print(f"train: no token dataset at {a.data} ({a.data}.idx/.bin missing): run prepare.py first", file=sys.stderr)
        sys.exit(2)
    dataset = pacer.data.open(a.data)
    vocab = None
    manifest = a.data + ".manifest.json"
    if os.path.exists(manifest):
        with open(manifest) as f:
            vocab = json.load(f).get("vocab_size")
    if not vocab:
        vocab = int(max(int(dataset[d].max()) for d in range(len(dataset)))) + 1
    seed_everything(a.seed)  # the same initial weights on every rank and every fresh start
    cfg = gpt.config(a.config, vocab, max_seq_len=max(a.seq_len, 2048))
    try:
        net = gpt.GPT(cfg, attention=a.attention).to(device)
    except Exception as e:  # noqa: BLE001 (only out-of-memory is ours to explain)
        if is_oom(e):
            report_oom(e, a, cfg, world, device)
            sys.exit(3)
        raise
    model = net
    comm_clock = [0.0]
    if dist.is_initialized() and dist.get_world_size() > 1:
        cap, cap_from = bucket_cap(a, rank)
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=cap)
        model.register_comm_hook(None, timed_allreduce_hook(comm_clock))
        if rank == 0:
            print(f"train: DDP bucket_cap_mb {cap:g} ({cap_from})", flush=True)
    optimizer = make_optimizer(net, a.lr, a.weight_decay)
    sched = cosine_schedule(optimizer, a.warmup, a.steps, a.min_lr_ratio)
    data = BaselineData(a, a.data, device, rank, world) if a.baseline else PacerData(a, dataset, device)
    saver = TorchSaver(a) if a.baseline else PacerSaver(a, net, optimizer)

    losses_path = a.losses or os.path.join(a.ckpt, "losses.jsonl")
    # Per rank: the documents (and how many of their tokens) each step read, to show every token is read once an epoch.
    samples_path = os.path.join(a.ckpt, f"samples-rank{rank}.jsonl")
    start = 0
    every = a.ckpt_every
    anchor = a.first_save if a.first_save is not None else -1
    resumed = saver.resume()
    if resumed:
        step, state, meta = resumed
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        if "loader" in state:
            data.load_state_dict(state["loader"])
        pacer.set_rng_state(state["rng"])
        start = step + 1
        if every is None and (meta or {}).get("ckpt_every"):
            every = int(meta["ckpt_every"])  # the interval the first attempt planned
            anchor = int(meta.get("ckpt_anchor", anchor))
        rewrite_losses(samples_path, step)
        if rank == 0:
            rewrite_losses(losses_path, step)
            print(f"train: resumed from step {step} in {a.ckpt} (attempt {pacer.run.attempt()})", flush=True)
            pacer.telemetry.event("train.resumed", {"step": step})
    else:
        for path in [samples_path] + ([losses_path] if rank == 0 else []):
            if os.path.exists(path):
                os.unlink(path)
    if rank == 0:
        print(f"train: {a.config}, {net.parameter_count():,} parameters, vocab {vocab}, "
              f"{len(dataset)} documents, {len(data)} batches per epoch; steps {start}..{a.steps - 1}"
              + (" (baseline: torch DataLoader, torch.save)" if a.baseline else ""), flush=True)
        if every is not None:
            print(f"train: checkpoint every {every} steps" + (" (--ckpt-every)" if a.ckpt_every else " (planned before)"),
                  flush=True)

    def state():
        s = {"model": net.state_dict(), "optim": optimizer.state_dict(), "sched": sched.state_dict(),
             "rng": pacer.rng_state()}
        if not a.baseline:
            s["loader"] = data.state_dict()
        return s

    if every is None and rank == 0:
        planned_interval(1.0, 1.0, a.mtbf, a.restart_cost)  # a bad --mtbf or a missing pacer fails now, not at step 10
    first_at = a.first_save
    if every is None and first_at is not None and start > first_at:
        first_at = anchor = min(start + 1, a.steps - 1)  # resumed before an interval was planned: measure here
    fake_oom = None
    if a.fake_oom_at:
        r, _, s = a.fake_oom_at.rpartition(":")
        fake_oom = (int(r or 0), int(s))
    losses = open(losses_path, "a") if rank == 0 else None
    samples = open(samples_path, "a") if not a.baseline else None
    answered = False  # a save answered pacer run's pending request
    plan_report = None
    first_cost = None  # (start, blocking s) of the first save: the interval is planned once it is durable
    due = False  # a periodic save is due
    timings = []  # per step of this process: (step, step_time_s, data_wait_s, save_s)
    model.train()
    value = float("nan")
    t_loop = time.perf_counter()
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        comm_clock[0] = 0.0
        try:
            batch = data.next()
            t1 = time.perf_counter()
            if fake_oom == (rank, step):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated by --fake-oom-at)")
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda" and a.dtype == "bfloat16"):
                logits = model(batch["tokens"], batch["pos"])
            loss = gpt.loss_fn(logits, batch["labels"])
            del logits
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if a.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), a.grad_clip)
            optimizer.step()  # the first one allocates AdamW's moments: 8 bytes per parameter
            if step + 1 < a.steps and hasattr(data, "prefetch") and not a.no_prefetch:
                data.prefetch()  # the GPU is still busy with this step: the next batch's host work hides behind it
        except Exception as e:  # noqa: BLE001 (only out-of-memory is ours to explain)
            if is_oom(e):
                report_oom(e, a, cfg, world, device)
                sys.exit(3)
            raise
        sched.step()
        tc = time.perf_counter()
        if dist.is_initialized():  # report the mean over ranks: the loss of the global batch
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            value = mean.item() / dist.get_world_size()
        else:
            value = loss.item()  # also waits for the GPU: the step time below is the step's
        comm_s = comm_clock[0] + (time.perf_counter() - tc if dist.is_initialized() else 0.0)
        t2 = time.perf_counter()
        trained = int((batch["labels"] != -100).sum().item())
        pacer.telemetry.step(step, loss=value, tokens=batch["n_tokens"], data_wait_s=t1 - t0,
                             comm_s=comm_s if dist.is_initialized() else None,
                             step_time_s=t2 - t0, lr=sched.get_last_lr()[0], trained_tokens=trained)
        if losses is not None:
            # float.hex: the exact bits, so a resumed run can be compared without rounding.
            # batch: a digest of this rank's tokens, so a resumed run shows it read the same data.
            host = batch["host_tokens"]
            digest = hashlib.blake2b(np.ascontiguousarray(host if host is not None else batch["tokens"].cpu().numpy())
                                     .tobytes(), digest_size=8).hexdigest()
            losses.write(json.dumps({"step": step, "loss": value, "loss_hex": value.hex(), "lr": sched.get_last_lr()[0],
                                     "epoch": data.epoch(), "batch": digest}) + "\n")
            losses.flush()
        if samples is not None:
            samples.write(json.dumps({"step": step, "epoch": data.epoch(), "documents": documents_read(*batch["documents"])})
                          + "\n")
            samples.flush()

        requested = pacer.run.checkpoint_requested()
        if dist.is_initialized():  # rank 0 decides: every rank must save the same step
            flag = torch.tensor([int(requested)], device=device if device.type == "cuda" else "cpu")
            dist.broadcast(flag, 0)
            requested = bool(flag.item())
        last = step == a.steps - 1
        first = step == first_at
        ts = time.perf_counter()
        save_s = 0.0
        # Periodic saves count from the first save (from step -1 without one), so both loops of a bench save alike.
        due = due or bool(every and step > anchor and (step - anchor) % every == 0)
        # A periodic save waits (a step at a time) until the last one is durable rather than holding the
        # loop while it is written; a requested or final save goes at once.
        periodic = due and saver.durable()
        if first or periodic or last or (requested and not answered):
            due = False
            saver.save(step, state, {"loss": value, "ckpt_every": every, "ckpt_anchor": anchor},
                       wait=requested or last)
            answered = answered or requested
            save_s = time.perf_counter() - ts
            # The loop's time in save(), after this step's record: pacer goodput counts the gap as a checkpoint stall.
            pacer.telemetry.event("checkpoint.saved", {"step": step, "save_s": save_s})
            if every is None and first_cost is None:
                first_cost = (ts, save_s)
        if every is None and first_cost is not None:
            # The first save's cost plans the interval, the same on every rank, once that save is durable:
            # its write time is the shortest interval (a save started sooner waits for the last one).
            n = torch.tensor([0], device=device if device.type == "cuda" else "cpu")
            if rank == 0 and saver.durable():
                write_s = time.perf_counter() - first_cost[0]
                done = [t for t in timings if t[0] > start]  # a process's first step pays for warm-up
                step_s = float(np.median([t[1] for t in (done or timings or [(step, t2 - t0)])]))
                n[0], plan_report = planned_interval(first_cost[1], step_s, a.mtbf, a.restart_cost, write_s)
                print(f"train: checkpoint every {int(n[0])} steps (pacer plan ckpt: a save blocks {first_cost[1]:.3f} s "
                      f"and is durable after {write_s:.1f} s, step {step_s:.3f} s, MTBF {a.mtbf}, restart "
                      f"{a.restart_cost}: interval {plan_report.get('interval_s', 0):.1f} s)", flush=True)
                pacer.telemetry.event("train.ckpt_interval", {"steps": int(n[0]), "save_s": first_cost[1],
                                                             "write_s": write_s, "step_s": step_s, "plan": plan_report})
            elif rank != 0 and dist.is_initialized():
                saver.durable()  # several ranks commit together
            if dist.is_initialized():
                dist.broadcast(n, 0)
            if int(n[0]):
                every = int(n[0])
        timings.append((step, t2 - t0, t1 - t0, save_s, batch["n_tokens"]))
        if a.slow_first and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep(a.slow_first)
        if a.hold_after is not None and step == a.hold_after and pacer.run.attempt() == 0:
            saver.close()
            print(f"train: holding after step {step} (rank {rank}, pid {os.getpid()})", flush=True)
            while True:
                time.sleep(60)
    saver.close()
    loop_s = time.perf_counter() - t_loop
    for f in (losses, samples):
        if f is not None:
            f.close()
    pacer.telemetry.flush()
    if rank == 0:
        print(f"train: done, {a.steps} steps, last loss {value:.4f}" if a.steps > start else "train: nothing to do",
              flush=True)
        if a.summary:
            write_summary(a, cfg, net, world, timings, loop_s, every, plan_report)
    if dist.is_initialized():
        dist.destroy_process_group()


def write_summary(a, cfg, net, world, timings, loop_s, every, plan_report):
    """Timings of this process's steps: medians without saves and warm-up, shares of data wait and saves."""
    skip = a.warmup_steps_timed
    timed = timings[skip:] if len(timings) > skip else timings
    plain = [t[1] for t in timed if t[3] == 0.0] or [t[1] for t in timed]
    median = float(np.median(plain)) if plain else None
    tokens = float(np.median([t[4] for t in timed])) * world if timed else 0
    saves = [{"step": t[0], "blocking_s": t[3]} for t in timings if t[3] > 0]
    window_s = sum(t[1] + t[3] for t in timed)
    # GPU time lost per checkpoint: over the saves during training. The last step's save is left out: it
    # waits until the checkpoint is durable, at the end, where no step is left to overlap (final_save_s).
    during = [t for t in timed if t[0] != a.steps - 1]
    window_saves = [t for t in during if t[3] > 0]
    lost = sum(t[1] + t[3] for t in during) - len(during) * median if median else None
    mid = [x["blocking_s"] for x in saves[1:] if x["step"] != a.steps - 1]
    total = sum(t[1] + t[3] for t in during)
    s = {"schema": "pacer.example.gpt.train/1", "mode": "baseline" if a.baseline else "pacer", "config": a.config,
         "parameters": net.parameter_count(), "vocab": cfg.vocab_size, "world": world, "batch_size": a.batch_size,
         "seq_len": a.seq_len, "device": str(torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"),
         "dtype": a.dtype, "steps": len(timings), "timed_steps": len(timed), "warmup_steps_left_out": skip,
         "median_step_s": median, "tokens_per_step": tokens, "tokens_per_s": tokens / median if median else None,
         "data_wait_fraction": sum(t[2] for t in during) / total if total else None,
         "ckpt_blocking_fraction": sum(t[3] for t in during) / total if total else None,
         "ckpt_every": every, "first_save": a.first_save, "saves": saves, "timed_saves": len(window_saves),
         "first_save_blocking_s": saves[0]["blocking_s"] if saves else None,
         "later_save_blocking_s": float(np.median(mid)) if mid else None,
         "final_save_s": saves[-1]["blocking_s"] if saves and saves[-1]["step"] == a.steps - 1 else None,
         "time_to_steps_s": window_s, "loop_s": loop_s,
         "lost_per_ckpt_s": lost / len(window_saves) if window_saves and lost is not None else None,
         "mtbf": a.mtbf, "restart_cost": a.restart_cost, "plan_ckpt": plan_report,
         "step_time_s": [t[1] for t in timings], "data_wait_s": [t[2] for t in timings]}
    tmp = a.summary + ".tmp"
    with open(tmp, "w") as f:
        json.dump(s, f, indent=1)
    os.replace(tmp, a.summary)


if __name__ == "__main__":
    main()
