"""A fake training script for `pacer run --hang-timeout` tests: heartbeats, then (attempt 0 only) stops while alive.

    hang_train.py --steps 20 --hang-at 5 [--ranks 2 --hang-rank 1] [--never-beat] [--ckpt-every K] [--events FILE] [--telemetry]

With --ranks N it starts N ranks (LOCAL_RANK 0..N-1, RANK = PACER_NODE_RANK
x N + LOCAL_RANK) as children and waits for them, as a launcher would; only
--hang-rank (a global rank) hangs, the others keep stepping. --block-others makes
the other ranks stop too once past the hung rank's step
(waiting_for_the_hung_rank), as ranks blocked in that step's collective do. --ckpt-every K
commits a tiny checkpoint every K steps (rank 0) under $PACER_CKPT_DIR, and
a later attempt resumes after the newest one. The hung rank sleeps inside stuck_in_collective() so that the test
can look for that name in the captured stacks.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import pacer.run
import pacer.telemetry


def stuck_in_collective():
    time.sleep(3600)


def waiting_for_the_hung_rank():
    time.sleep(3600)


def worker_loop():
    time.sleep(3600)


def event(args, rank, what, step):
    """One JSON line per event, for the hang trials (wall clock: one machine)."""
    if args.events:
        with open(args.events, "a") as f:
            f.write(json.dumps({"what": what, "rank": rank, "step": step, "attempt": pacer.run.attempt(),
                                "node": os.environ.get("PACER_NODE_NAME", ""), "unix": time.time()}) + "\n")


def train(args, rank):
    if args.fork_worker:
        pacer.run.heartbeat()  # the stack dump is installed before the fork, as in a real loop
        if os.fork() == 0:  # a data loader worker: no rank, never in the rank's stack file
            worker_loop()
            os._exit(0)
    hang_now = pacer.run.attempt() == 0 and rank == args.hang_rank
    ck = None
    first = 0
    if args.ckpt_every:
        import numpy as np
        ck = pacer.Checkpointer(pacer.run.ckpt_dir(None), keep_last=2)
        if ck.latest() is not None:
            first = ck.load()[0] + 1
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
            ck.save(step, {"w": np.full(8, step, dtype=np.int64)}, meta={"step": step}).wait()
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
    args = p.parse_args()
    if args.ranks:
        me = [a for a in sys.argv[1:]]
        kids = []
        for r in range(args.ranks):
            node_rank = int(os.environ.get("PACER_NODE_RANK", "0"))
            env = dict(os.environ, LOCAL_RANK=str(r), RANK=str(node_rank * args.ranks + r))
            kids.append(subprocess.Popen([sys.executable, __file__, *me, "--ranks", "0"], env=env))
        sys.exit(max(k.wait() for k in kids))
    train(args, int(os.environ.get("RANK", "0")))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
