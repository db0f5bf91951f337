"""One rank of a data-parallel run (DDP over gloo) for test_checkpoint_ranks' resume test.

    ckpt_ddp_resume.py DATA ROOT full      40 steps, no checkpoint; prints this rank's last 20 losses
    ckpt_ddp_resume.py DATA ROOT first     20 steps, then one collective save of the whole state
    ckpt_ddp_resume.py DATA ROOT resume    fresh objects, load into them, 20 more steps; prints the losses
Rank and world from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE. Each rank reads its own share of the data and
draws its own dropout masks, so its loader position and RNG states are its own (pacer.PerRank); the model,
optimizer and scheduler are replicated.
"""
import datetime
import json
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

import pacer
from ckpt_resume_train import HALF, SEQ, STEPS, VOCAB, train  # the same model and step as the one-rank test


def main():
    data, root, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Dropout(0.2), torch.nn.LayerNorm(32), torch.nn.Linear(32, VOCAB))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = pacer.data.Loader(pacer.data.open(data), batch_size=4, seq_len=SEQ, pack=True, seed=5, threads=1,
                               rank=rank, world_size=world)
    torch.manual_seed(1000 + rank)  # each rank's own dropout masks
    np.random.seed(rank)
    random.seed(rank)

    def state():
        return {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "loader": pacer.PerRank(loader.state_dict()), "rng": pacer.PerRank(pacer.rng_state())}

    def batches():
        while True:
            yield from loader

    ck = pacer.Checkpointer(root, timeout=60)
    if mode == "full":
        print(json.dumps(train(ddp, opt, sched, batches(), STEPS)[HALF:]), flush=True)
    elif mode == "first":
        train(ddp, opt, sched, batches(), HALF)
        ck.save(HALF, state()).wait()
    else:
        s = state()
        step, s, _ = ck.load(into=s)
        assert step == HALF, step
        ddp.module.load_state_dict(s["model"])
        opt.load_state_dict(s["optim"])
        sched.load_state_dict(s["sched"])
        loader.load_state_dict(s["loader"].value)
        pacer.set_rng_state(s["rng"].value)
        print(json.dumps(train(ddp, opt, sched, batches(), STEPS - HALF)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
