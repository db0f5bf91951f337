"""A torchrun worker for `pacer run --nodes` tests: gloo all_reduce per step, a heartbeat before it; one rank hangs.

    torchrun --nnodes 2 --node-rank $PACER_NODE_RANK --nproc-per-node 2 --master-addr A --master-port $MASTER_PORT \
        torch_train.py --steps 30 --hang-rank 3 --hang-at 5 --events FILE

torchrun gives each worker RANK, LOCAL_RANK and WORLD_SIZE; pacer's
heartbeat takes its slot from LOCAL_RANK and its rank from RANK. In attempt 0
(PACER_RUN_ATTEMPT) --hang-rank stops before its heartbeat of step
--hang-at, inside stuck_in_collective(); the others then block in that step's
all_reduce. Later attempts run to the end.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import pacer.run


def stuck_in_collective():
    time.sleep(3600)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--events")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.events:
        with open(args.events, "a") as f:
            f.write(json.dumps({"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
                                "node": os.environ.get("PACER_NODE_NAME", ""), "attempt": pacer.run.attempt(),
                                "pid": os.getpid()}) + "\n")
    x = torch.ones(4)
    for step in range(args.steps):
        if pacer.run.attempt() == 0 and rank == args.hang_rank and step == args.hang_at:
            stuck_in_collective()
        pacer.run.heartbeat(step)
        dist.all_reduce(x)
        x.fill_(1)
        time.sleep(args.step_s)
    dist.barrier()
    dist.destroy_process_group()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
