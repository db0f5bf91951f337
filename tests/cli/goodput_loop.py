"""A short training-like loop for the goodput tests: sleeps stand in for loading, compute and saving.

Each step sleeps --wait (reported as data_wait_s) and --compute (plus --slow on
rank --slow-rank), then records the step with pacer.telemetry. With --ckpt it
saves with pacer.Checkpointer every --every steps (after sleeping --save, a
slow save) and resumes from the newest checkpoint; --kill-at STEP SIGKILLs the
process once after recording that step (a marker file next to the checkpoints
remembers), so that `pacer run` restarts it and the steps since the last
checkpoint are done again. --flops F reports F model FLOPs per step (for the
report's MFU).
"""
import argparse
import os
import signal
import time

import numpy as np

import pacer
import pacer.run
import pacer.telemetry as tm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compute", type=float, default=0.03)
    p.add_argument("--wait", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--ckpt")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--save", type=float, default=0.0)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--flops", type=float)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    ck, start, w = None, 0, np.zeros(16)
    if a.ckpt:
        ck = pacer.Checkpointer(pacer.run.ckpt_dir(a.ckpt), keep_last=2)
        if ck.latest() is not None:
            step, blobs, _ = ck.load()
            w, start = blobs["w"], step + 1
            tm.event("train.resumed", {"step": step})
    for step in range(start, a.steps):
        t0 = time.time()
        time.sleep(a.wait)
        t1 = time.time()
        time.sleep(a.compute + (a.slow if rank == a.slow_rank else 0))
        w = w + 1
        t2 = time.time()
        tm.step(step, loss=1.0 / (step + 1), tokens=1024, data_wait_s=t1 - t0, step_time_s=t2 - t0, t=t2, flops=a.flops)
        if step == a.kill_at:
            marker = os.path.join(a.ckpt, "killed-once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                tm.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        if ck is not None and (step + 1) % a.every == 0:
            ts = time.time()
            time.sleep(a.save)
            ck.save(step, {"w": w}).wait()
            tm.event("checkpoint.saved", {"step": step, "save_s": time.time() - ts})
    if ck is not None:
        ck.flush()
    tm.flush()


if __name__ == "__main__":
    main()
