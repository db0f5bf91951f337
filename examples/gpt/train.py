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
import sys
import time

# cuBLAS is deterministic only with a fixed workspace; set before torch initialises CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pacer  # noqa: E402
import pacer.data  # noqa: E402
import pacer.run  # noqa: E402
import pacer.telemetry  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as gpt  # noqa: E402


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
    ap.add_argument("--ckpt-every", type=int, default=50, help="save every N steps (and when pacer run asks)")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="autocast dtype on CUDA (the CPU trains in float32)")
    ap.add_argument("--losses", help="JSON lines file of per-step losses (default: CKPT/losses.jsonl)")
    ap.add_argument("--telemetry-db", help="telemetry catalog (default: $PACER_TELEMETRY_DB or the job's)")
    # For tests: after this step (its checkpoint committed) wait to be killed, so a kill lands at a known step.
    ap.add_argument("--hold-after", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.ckpt = pacer.run.ckpt_dir(a.ckpt)
    if not a.ckpt:
        ap.error("--ckpt is required outside pacer run")
    if a.steps < 1 or a.ckpt_every < 1 or a.batch_size < 1 or a.seq_len < 2:
        ap.error("--steps, --ckpt-every, --batch-size must be >= 1 and --seq-len >= 2")
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


def main(argv=None):
    a = parse_args(argv)
    pacer.run.watch()  # before anything slow: the request signal must not kill us
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
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
    net = gpt.GPT(cfg).to(device)
    model = net
    if dist.is_initialized() and dist.get_world_size() > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    optimizer = make_optimizer(net, a.lr, a.weight_decay)
    sched = cosine_schedule(optimizer, a.warmup, a.steps, a.min_lr_ratio)
    loader = pacer.data.Loader(dataset, batch_size=a.batch_size, seq_len=a.seq_len, pack=True, seed=a.seed,
                               threads=2, prefetch=4, pin_memory=device.type == "cuda")

    ck = pacer.Checkpointer(a.ckpt, keep_last=a.keep_last)
    losses_path = a.losses or os.path.join(a.ckpt, "losses.jsonl")
    start = 0
    if ck.steps():
        step, state, meta = ck.load()
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        loader.load_state_dict(state["loader"])
        pacer.set_rng_state(state["rng"])
        start = step + 1
        if rank == 0:
            rewrite_losses(losses_path, step)
            print(f"train: resumed from step {step} in {a.ckpt} (attempt {pacer.run.attempt()})", flush=True)
            pacer.telemetry.event("train.resumed", {"step": step})
    elif rank == 0 and os.path.exists(losses_path):
        os.unlink(losses_path)
    if rank == 0:
        print(f"train: {a.config}, {net.parameter_count():,} parameters, vocab {vocab}, "
              f"{len(dataset)} documents, {len(loader)} batches per epoch; steps {start}..{a.steps - 1}", flush=True)

    def state():
        return {"model": net.state_dict(), "optim": optimizer.state_dict(), "sched": sched.state_dict(),
                "loader": loader.state_dict(), "rng": pacer.rng_state()}

    losses = open(losses_path, "a") if rank == 0 else None
    pending = None  # the last save, waited for before the next one starts
    answered = False  # a save answered pacer run's pending request
    it = batches(loader)
    model.train()
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        tokens = torch.as_tensor(batch["tokens"]).to(device, non_blocking=True)
        pos = torch.as_tensor(batch["position_ids"]).to(device, non_blocking=True)
        lengths = torch.as_tensor(batch["lengths"]).to(device, non_blocking=True)
        labels = gpt.labels_for(tokens, pos.long(), lengths.long())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and a.dtype == "bfloat16"):
            logits = model(tokens, pos)
        loss = gpt.loss_fn(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), a.grad_clip)
        optimizer.step()
        sched.step()
        if dist.is_initialized():  # report the mean over ranks: the loss of the global batch
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            value = mean.item() / dist.get_world_size()
        else:
            value = loss.item()  # also waits for the GPU: the step time below is the step's
        t2 = time.perf_counter()
        trained = int((labels != -100).sum().item())
        pacer.telemetry.step(step, loss=value, tokens=int(batch["lengths"].sum()), data_wait_s=t1 - t0,
                             step_time_s=t2 - t0, lr=sched.get_last_lr()[0], trained_tokens=trained)
        if losses is not None:
            # float.hex: the exact bits, so a resumed run can be compared without rounding.
            # batch: a digest of this rank's tokens, so a resumed run shows it read the same data.
            losses.write(json.dumps({"step": step, "loss": value, "loss_hex": value.hex(), "lr": sched.get_last_lr()[0],
                                     "epoch": loader.epoch, "batch": hashlib.blake2b(
                                         np.ascontiguousarray(batch["tokens"]).tobytes(), digest_size=8).hexdigest()})
                         + "\n")
            losses.flush()

        requested = pacer.run.checkpoint_requested()
        if dist.is_initialized():  # rank 0 decides: every rank must save the same step
            flag = torch.tensor([int(requested)], device=device if device.type == "cuda" else "cpu")
            dist.broadcast(flag, 0)
            requested = bool(flag.item())
        last = step == a.steps - 1
        if (step + 1) % a.ckpt_every == 0 or last or (requested and not answered):
            if pending is not None:
                pending.wait()
            pending = ck.save(step, state(), meta={"loss": value})
            if requested or last:
                pending.wait()  # pacer run stops us once it sees the step committed
                answered = requested
        if a.hold_after is not None and step == a.hold_after:
            if pending is not None:
                pending.wait()
            print(f"train: holding after step {step}", flush=True)
            while True:
                time.sleep(60)
    if pending is not None:
        pending.wait()
    ck.flush()
    if losses is not None:
        losses.close()
    pacer.telemetry.flush()
    if rank == 0:
        print(f"train: done, {a.steps} steps, last loss {value:.4f}" if a.steps > start else "train: nothing to do",
              flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
