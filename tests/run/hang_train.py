"""A fake training script for `pacer run --hang-timeout` tests: heartbeats, then (attempt 0 only) stops while alive.

    hang_train.py --steps 20 --hang-at 5 [--ranks 2 --hang-rank 1] [--never-beat] [--ckpt-every K] [--events FILE] [--telemetry]

With --ranks N it starts N ranks (LOCAL_RANK 0..N-1, RANK = PACER_NODE_RANK
x N + LOCAL_RANK) as children and waits for them, as a launcher would; only
--hang-rank (a global rank) hangs, the others keep stepping. --block-others makes
the other ranks stop too once past the hung rank's step
(waiting_for_the_hung_rank), as ranks blocked in that step's collective do. --ckpt-every K
commits a tiny checkpoint every K steps (rank 0; with --dist every rank its part) under $PACER_CKPT_DIR, and
a later attempt resumes after the newest one. The hung rank sleeps inside stuck_in_collective() so that the test
can look for that name in the captured stacks.

--dist runs the ranks as one torch.distributed gloo job (env:// rendezvous:
MASTER_ADDR, or --master-addr, and MASTER_PORT, which the launcher picks when
unset) with a real all_reduce every step, after the step's compute and before
its heartbeat; --hang-in says where the hung rank stops: `compute` (it sleeps
in stuck_in_compute() before the all_reduce, the others block in it) or
`collective` (it enters a barrier that the others skip). --hang-plan
RANK:HOW,... gives the hung rank and --hang-in per attempt (attempt i takes
the i-th; later attempts do not hang).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import pacer.run
import pacer.telemetry


def stuck_in_collective():
    time.sleep(3600)


def waiting_for_the_hung_rank():
    time.sleep(3600)


def stuck_in_compute():
    time.sleep(3600)


def worker_loop():
    time.sleep(3600)


def event(args, rank, what, step):
    """One JSON line per event, for the hang trials (wall clock: one machine)."""
    if args.events:
        with open(args.events, "a") as f:
            f.write(json.dumps({"what": what, "rank": rank, "step": step, "attempt": pacer.run.attempt(),
                                "node": os.environ.get("PACER_NODE_NAME", ""), "unix": time.time()}) + "\n")


def resume(args):
    """The Checkpointer of --ckpt-every (None without) and the step after the newest committed one."""
    if not args.ckpt_every:
        return None, 0
    ck = pacer.Checkpointer(pacer.run.ckpt_dir(None), keep_last=2)
    return ck, (ck.load()[0] + 1 if ck.latest() is not None else 0)


def save(ck, step):
    import numpy as np
    ck.save(step, {"w": np.full(8, step, dtype=np.int64)}, meta={"step": step}).wait()


def planned_hang(args, rank):
    """How this rank hangs in this attempt: None, or heartbeat, compute or collective."""
    a = pacer.run.attempt()
    if args.hang_plan:
        plan = [x.split(":") for x in args.hang_plan.split(",")]
        return plan[a][1] if a < len(plan) and int(plan[a][0]) == rank else None
    return args.hang_in if a == 0 and rank == args.hang_rank else None


def train_dist(args, rank):
    """One gloo job over every rank: a real all_reduce per step."""
    import torch
    import torch.distributed as dist
    if args.master_addr:
        os.environ["MASTER_ADDR"] = args.master_addr
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(args.backend, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    how = planned_hang(args, rank)
    ck, first = resume(args)
    # nccl: a GPU per local rank; the all_reduce only queues work, so the
    # step ends with a read of the result, where the CPU waits (as a loss.item() does).
    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    t = torch.zeros(4, device="cuda" if cuda else "cpu")
    for step in range(first, args.steps):
        hang_now = how and step == args.hang_at
        if hang_now:
            event(args, rank, "hang", step)
        time.sleep(args.step_s)  # the step's compute
        if hang_now and how == "collective":
            dist.barrier()  # the others never enter it
        elif hang_now:
            stuck_in_compute()
        t.fill_(float(step))
        dist.all_reduce(t)
        if cuda:
            float(t[0])
        pacer.run.heartbeat(step)
        if step == first:
            event(args, rank, "first-step", step)
        if ck and step % args.ckpt_every == 0:  # every rank saves its part (a collective commit)
            save(ck, step)
    if ck:
        ck.flush()
    dist.barrier()
    pacer.run.heartbeat()
    # Tearing gloo down and the interpreter's exit take seconds on a loaded
    # machine: past the hang timeout, with no heartbeat.
    print("finished", flush=True)
    os._exit(0)


def train(args, rank):
    if args.fork_worker:
        pacer.run.heartbeat()  # the stack dump is installed before the fork, as in a real loop
        if os.fork() == 0:  # a data loader worker: no rank, never in the rank's stack file
            worker_loop()
            os._exit(0)
    hang_now = planned_hang(args, rank) is not None
    ck, first = resume(args)
    flag = args.events + ".hung" if args.events else None
    for step in range(first, args.steps):
        if hang_now and step == args.hang_at:
            event(args, rank, "hang", step)
            if args.block_others and flag:
                with open(flag + ".tmp", "w") as f:
                    f.write(str(step))
                os.rename(flag + ".tmp", flag)
            stuck_in_collective()
        if args.block_others and flag and pacer.run.attempt() == 0 and os.path.exists(flag):
            with open(flag) as f:
                if step > int(f.read()):  # the collective of the hung rank's step never completes
                    waiting_for_the_hung_rank()
        if args.telemetry:
            pacer.telemetry.step(step)  # a step record is a heartbeat too
        elif not args.never_beat:
            pacer.run.heartbeat(step)
        if step == first:
            event(args, rank, "first-step", step)
        if ck and rank == 0 and step % args.ckpt_every == 0:
            save(ck, step)
        time.sleep(args.step_s)
    if ck:
        ck.flush()
    if args.telemetry:
        pacer.telemetry.close()
    if args.never_beat:
        time.sleep(args.steps * args.step_s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--ranks", type=int, default=0)
    p.add_argument("--hang-rank", type=int, default=0)
    p.add_argument("--never-beat", action="store_true")
    p.add_argument("--fork-worker", action="store_true")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--events")
    p.add_argument("--telemetry", action="store_true", help="pacer.telemetry.step() instead of pacer.run.heartbeat()")
    p.add_argument("--block-others", action="store_true",
                   help="the other ranks stop once past the hung rank's step, as in a collective")
    p.add_argument("--dist", action="store_true", help="a torch.distributed gloo job, an all_reduce per step")
    p.add_argument("--hang-in", choices=["heartbeat", "compute", "collective"], default="heartbeat",
                   help="with --dist: compute (before the all_reduce) or collective (a barrier the others skip)")
    p.add_argument("--hang-plan", help="RANK:HOW,... the hung rank and --hang-in of attempt 0, 1, ...")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="with --dist (nccl: one GPU per rank)")
    p.add_argument("--master-addr", help="with --dist: instead of $MASTER_ADDR (fake nodes on one machine)")
    args = p.parse_args()
    if args.ranks:
        me = [a for a in sys.argv[1:]]
        kids = []
        env = dict(os.environ)
        if args.dist and "MASTER_PORT" not in env:  # one node without a launcher that picks it
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                env["MASTER_PORT"] = str(s.getsockname()[1])
        node_rank = int(os.environ.get("PACER_NODE_RANK", "0"))
        env["WORLD_SIZE"] = str(int(os.environ.get("PACER_NNODES", "1")) * args.ranks)
        for r in range(args.ranks):
            kids.append(subprocess.Popen([sys.executable, __file__, *me, "--ranks", "0"],
                                         env=dict(env, LOCAL_RANK=str(r), RANK=str(node_rank * args.ranks + r))))
        sys.exit(max(k.wait() for k in kids))
    (train_dist if args.dist else train)(args, int(os.environ.get("RANK", "0")))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
