"""A fake training script for `pacer run --hang-timeout` tests: heartbeats, then (attempt 0 only) stops while alive.

    hang_train.py --steps 20 --hang-at 5 [--ranks 2 --hang-rank 1] [--never-beat]

With --ranks N it starts N ranks (LOCAL_RANK/RANK 0..N-1) as children and
waits for them, as a launcher would; only --hang-rank hangs, the others keep
stepping. The hung rank sleeps inside stuck_in_collective() so that the test
can look for that name in the captured stacks.
"""
import argparse
import os
import subprocess
import sys
import time

import pacer.run


def stuck_in_collective():
    time.sleep(3600)


def worker_loop():
    time.sleep(3600)


def train(args, rank):
    if args.fork_worker:
        pacer.run.heartbeat()  # the stack dump is installed before the fork, as in a real loop
        if os.fork() == 0:  # a data loader worker: no rank, never in the rank's stack file
            worker_loop()
            os._exit(0)
    hang_now = pacer.run.attempt() == 0 and rank == args.hang_rank
    for step in range(args.steps):
        if hang_now and step == args.hang_at:
            stuck_in_collective()
        if not args.never_beat:
            pacer.run.heartbeat(step)
        time.sleep(args.step_s)
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
    args = p.parse_args()
    if args.ranks:
        me = [a for a in sys.argv[1:]]
        kids = []
        for r in range(args.ranks):
            env = dict(os.environ, LOCAL_RANK=str(r), RANK=str(r))
            kids.append(subprocess.Popen([sys.executable, __file__, *me, "--ranks", "0"], env=env))
        sys.exit(max(k.wait() for k in kids))
    train(args, int(os.environ.get("RANK", "0")))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
