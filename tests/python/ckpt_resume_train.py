"""A tiny language model trained on pacer's loader, for test_checkpoint_state's resume test.

    ckpt_resume_train.py DATA ROOT full      40 steps, no checkpoint; prints the losses
    ckpt_resume_train.py DATA ROOT first     20 steps, then one save of {"model","optim","sched","loader","rng"}
    ckpt_resume_train.py DATA ROOT resume    fresh objects, load into them, 20 more steps; prints the losses
A fourth argument, `cuda`, trains on the GPU (deterministic kernels). Losses
are printed as JSON floats (repr: exact).
"""
import json
import random
import sys

import numpy as np
import torch

import pacer

STEPS, HALF, VOCAB, SEQ = 40, 20, 97, 16
DEVICE = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")


def build(data):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Dropout(0.2), torch.nn.LayerNorm(32), torch.nn.Linear(32, VOCAB)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = pacer.data.Loader(pacer.data.open(data), batch_size=4, seq_len=SEQ, pack=True, seed=5, threads=1)
    return model, opt, sched, loader


def state_of(model, opt, sched, loader):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "loader": loader.state_dict(), "rng": pacer.rng_state()}


def batches(loader):
    while True:
        yield from loader


def train(model, opt, sched, it, steps):
    losses = []
    for _ in range(steps):
        tokens = torch.from_numpy(next(it)["tokens"] % VOCAB).to(DEVICE)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        # Python's and numpy's RNGs take part too: a resume that missed either differs.
        loss = loss * (1 + 1e-3 * (np.random.rand() + random.random()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def main():
    data, root, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        # The embedding's backward adds with atomics unless told otherwise.
        torch.use_deterministic_algorithms(True)
    model, opt, sched, loader = build(data)
    ck = pacer.Checkpointer(root)
    if mode == "full":
        print(json.dumps(train(model, opt, sched, batches(loader), STEPS)[HALF:]))
    elif mode == "first":
        it = batches(loader)
        train(model, opt, sched, it, HALF)
        ck.save(HALF, state_of(model, opt, sched, loader), meta={"note": "half way"}).wait()
    else:
        assert ck.steps() == [HALF], ck.steps()
        state = state_of(model, opt, sched, loader)
        step, state, meta = ck.load(into=state)
        assert step == HALF and meta == {"note": "half way"}, (step, meta)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        loader.load_state_dict(state["loader"])
        pacer.set_rng_state(state["rng"])
        print(json.dumps(train(model, opt, sched, batches(loader), STEPS - HALF)))


if __name__ == "__main__":
    main()
