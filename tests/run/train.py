"""A deterministic training loop for the `pacer run` tests (bare and under a real Slurm).

The state after step s is a fixed function of the state after step s-1, so a
run that is stopped, requeued and resumed from a committed step must end with
exactly the bytes of an uninterrupted run. Each line of --events records what
happened (start step, saves, the request seen), for the tests to check.

  train.py --ckpt DIR --steps N [--every K] [--sleep S] [--crash-at STEP] [--crash-always] --events FILE
  train.py --check DIR --steps N    prints EQUAL when DIR's latest checkpoint is step N of an uninterrupted run
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import pacer
import pacer.run


def step_state(w, step):
    return w * 0.999 + np.sin(np.arange(w.size, dtype=np.float64) * 0.01 + step)


def final_state(steps, size=4096):
    w = np.zeros(size, dtype=np.float64)
    for s in range(1, steps + 1):
        w = step_state(w, s)
    return w


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default=None)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--crash-at", type=int, default=0, help="exit 3 once on reaching this step (a marker file remembers)")
    p.add_argument("--crash-always", action="store_true", help="exit 3 at once, every attempt")
    p.add_argument("--ignore-requests", action="store_true", help="never checkpoint on request")
    p.add_argument("--events")
    p.add_argument("--check", metavar="DIR")
    a = p.parse_args()
    if a.check:
        step, blobs, _ = pacer.Checkpointer(a.check).load()
        equal = step == a.steps and np.array_equal(blobs["w"], final_state(a.steps))
        print("EQUAL" if equal else f"DIFFERENT: latest step {step}")
        return
    pacer.run.watch()

    def event(**kv):
        kv.update(pid=os.getpid(), attempt=pacer.run.attempt(), restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        with open(a.events, "a") as f:
            f.write(json.dumps(kv) + "\n")

    root = pacer.run.ckpt_dir(a.ckpt)
    ck = pacer.Checkpointer(root, keep_last=0)
    w = np.zeros(4096, dtype=np.float64)
    start = 0
    if ck.latest() is not None:
        start, blobs, meta = ck.load()
        w = blobs["w"]
        assert meta["step"] == start
    event(what="start", step=start)
    if a.crash_always:
        event(what="crash", step=start)
        sys.stdout.flush()
        os._exit(3)
    saved_on_request = False
    for step in range(start + 1, a.steps + 1):
        w = step_state(w, step)
        if a.crash_at and step == a.crash_at:
            marker = os.path.join(os.path.dirname(a.events), "crashed-once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                event(what="crash", step=step)
                os._exit(3)
        requested = not a.ignore_requests and not saved_on_request and pacer.run.checkpoint_requested()
        if (a.every and step % a.every == 0) or requested or step == a.steps:
            ck.save(step, {"w": w}, meta={"step": step}).wait()
            event(what="save", step=step, requested=requested)
            saved_on_request = saved_on_request or requested
        if a.sleep:
            time.sleep(a.sleep)
    ck.flush()
    event(what="done", step=a.steps)


if __name__ == "__main__":
    main()
