#!/usr/bin/env python3
"""Runs workloads of known shape under `pacer monitor` and checks `pacer score` names their bottleneck.

Driver (the default): runs every workload for --device, each as
    pacer monitor --db OUT/W.db --steps OUT/W.steps.jsonl -- PYTHON score_workloads.py --workload W ...
then `pacer score OUT/W.db --json`, prints a table of scores and verdicts with whether each matches
the expected one, and writes OUT/score_workloads.json. Exit code 1 when any verdict is wrong.

Workload (--workload W): the child. It writes one JSON line per training step to --steps-file
(step, t, step_time_s, data_wait_s, comm_s, tokens), the input `pacer monitor --steps` tails, so it
needs neither the pacer Python module nor anything beyond torch.

  gemm    bf16 (GPU) / fp32 (CPU) matrix products back to back       -> compute-bound / host-cpu-bound
  memory  (GPU only) copies and adds over 4 GiB tensors                 -> memory-bound
  input   a slow input pipeline (CPU decode + storage wait), then a short
          GPU/CPU step                                                  -> input-bound
  idle    the process holds the device and sleeps                       -> idle
  prep    a Python loop preparing each batch on the CPU (pure Python, one
          thread), then a short device step; steps carry no data_wait_s,
          as most training loops log them                               -> host-bound (one thread)
  tiny    (GPU only) thousands of tiny kernels (4096-element adds) per step,
          launched from the Python thread                               -> launch-bound
  threads (CPU only) one thread per CPU compressing in C (the GIL released):
          the work is spread, not one thread's                          -> host-cpu-bound
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = {
    "cuda": {"gemm": "compute-bound", "memory": "memory-bound", "input": "input-bound", "idle": "idle",
             "prep": "host-bound", "tiny": "launch-bound"},
    "cpu": {"gemm": "host-cpu-bound", "input": "input-bound", "idle": "idle", "prep": "host-bound",
            "threads": "host-cpu-bound"},
}


class StepLog:
    """JSON lines for `pacer monitor --steps`; flushed per line so the monitor sees each step."""

    def __init__(self, path):
        self.f = open(path, "a", encoding="utf-8")
        self.step = 0

    def write(self, step_time_s, data_wait_s, tokens):
        rec = {"step": self.step, "t": time.time(), "step_time_s": step_time_s, "comm_s": 0.0, "tokens": tokens}
        if data_wait_s is not None:  # None: the loop does not measure it
            rec["data_wait_s"] = data_wait_s
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.step += 1


def workload(args):
    import torch

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    log = StepLog(args.steps_file)
    end = time.time() + args.seconds
    if args.workload == "idle":
        hold = torch.ones(1 << 20, device=dev)  # the context and some memory, then nothing
        sync()
        time.sleep(args.seconds)
        del hold
        return 0
    if args.workload == "gemm":
        n = 8192 if dev.type == "cuda" else 1024
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        reps = 20 if dev.type == "cuda" else 4
        if dev.type == "cpu":
            # Every CPU computing: Debian's torch multiplies in one thread whatever set_num_threads says,
            # so one Python thread per CPU (the GIL is released inside the matmul). The workload stands
            # for host-cpu-bound, not for a single busy thread.
            import threading

            def spin():
                while time.time() < end:
                    torch.mm(a, b)

            for _ in range((os.cpu_count() or 1) - 1):
                threading.Thread(target=spin, daemon=True).start()
        while time.time() < end:
            t0 = time.perf_counter()
            for _ in range(reps):
                c = a @ b
            sync()
            log.write(time.perf_counter() - t0, 0.0, reps * n * n)
        del c
    elif args.workload == "memory":
        if dev.type != "cuda":
            print("memory: GPU only (the catalog has no host memory-bandwidth figure)", file=sys.stderr)
            return 2
        x = torch.empty(1 << 30, device=dev, dtype=torch.float32)  # 4 GiB
        y = torch.empty_like(x)
        while time.time() < end:
            t0 = time.perf_counter()
            for _ in range(10):
                y.copy_(x)
                x.add_(1.0)
            sync()
            log.write(time.perf_counter() - t0, 0.0, 0)
    elif args.workload == "input":
        # The loader: single-threaded decode on the CPU plus a wait on storage,
        # then a short step on the device.
        torch.set_num_threads(1)
        n = 2048 if dev.type == "cuda" else 256
        w = torch.randn(n, n, device=dev)
        while time.time() < end:
            t0 = time.perf_counter()
            raw = torch.randint(0, 255, (256, 1024), dtype=torch.uint8)
            batch = (raw.float() / 255.0).sum(dim=1)
            time.sleep(0.12)
            x = torch.randn(n, n).add_(batch.mean()).to(dev)
            t1 = time.perf_counter()
            for _ in range(5):
                x = torch.tanh(x @ w)
            sync()
            t2 = time.perf_counter()
            log.write(t2 - t0, t1 - t0, n * n)
    elif args.workload == "prep":
        # Each batch is built in pure Python (a toy tokenizer over generated
        # text: one thread, the GIL held), then a short step on the device.
        torch.set_num_threads(1)
        words = ["w%d" % i for i in range(5000)]
        vocab = {w: i for i, w in enumerate(words)}
        w = torch.randn(512, 512, device=dev)
        k = 0
        while time.time() < end:
            t0 = time.perf_counter()
            rows = []
            for r in range(64):
                text = " ".join(words[(k * 7919 + r * 104729 + j * 31) % len(words)] for j in range(512))
                rows.append([vocab[t] % 512 for t in text.split()])
                k += 1
            x = torch.tensor(rows, dtype=torch.float32).to(dev)
            y = torch.tanh(x @ w)
            sync()
            log.write(time.perf_counter() - t0, None, 64 * 512)
        del y
    elif args.workload == "tiny":
        if dev.type != "cuda":
            print("tiny: GPU only (kernel launches)", file=sys.stderr)
            return 2
        x = torch.zeros(4096, device=dev)
        while time.time() < end:
            t0 = time.perf_counter()
            for _ in range(2000):
                x.add_(1.0)
            sync()
            log.write(time.perf_counter() - t0, None, 0)
    elif args.workload == "threads":
        import threading
        import zlib

        data = os.urandom(1 << 20)

        def squeeze():
            while time.time() < end:
                zlib.compress(data, 6)

        pool = [threading.Thread(target=squeeze) for _ in range(os.cpu_count() or 2)]
        for t in pool:
            t.start()
        while time.time() < end:
            t0 = time.perf_counter()
            time.sleep(0.5)
            log.write(time.perf_counter() - t0, None, 0)
        for t in pool:
            t.join()
    return 0


def drive(args):
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    expected = EXPECTED[args.device]
    names = args.only.split(",") if args.only else list(expected)
    rows = []
    for w in names:
        db = os.path.join(out, w + ".db")
        steps = os.path.join(out, w + ".steps.jsonl")
        for p in (db, db + "-wal", db + "-shm", steps):
            if os.path.exists(p):
                os.remove(p)
        open(steps, "w").close()
        cmd = [args.pacer, "monitor", "--interval", args.interval, "--db", db, "--steps", steps, "-q", "--",
               args.python, os.path.abspath(__file__), "--workload", w, "--device", args.device,
               "--seconds", str(args.seconds), "--steps-file", steps]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            rows.append({"workload": w, "expected": expected[w], "verdict": None, "ok": False, "error": "exit %d" % rc})
            continue
        r = subprocess.run([args.pacer, "score", db, "--json"], capture_output=True, text=True)
        if r.returncode != 0:
            rows.append({"workload": w, "expected": expected[w], "verdict": None, "ok": False, "error": r.stderr.strip()})
            continue
        j = json.loads(r.stdout)
        kind = j["verdict"]["kind"]
        rows.append({"workload": w, "expected": expected[w], "verdict": kind, "ok": kind == expected[w],
                     "sentence": j["verdict"]["sentence"],
                     "scores": {s["name"]: s["score"] for s in j["scores"]}, "score": j})
    print("%-8s %-20s %-20s %-4s %s" % ("WORKLOAD", "EXPECTED", "VERDICT", "OK", "SCORES (compute memory comm input host_cpu io)"))
    for r in rows:
        sc = r.get("scores", {})
        fmt = " ".join("-" if sc.get(k) is None else "%.2f" % sc[k]
                       for k in ("compute", "memory", "communication", "input", "host_cpu", "io"))
        print("%-8s %-20s %-20s %-4s %s" % (r["workload"], r["expected"], r["verdict"] or r.get("error"), "yes" if r["ok"] else "NO", fmt))
        if r.get("sentence"):
            print("         " + r["sentence"])
        t = r.get("score", {}).get("busiest_thread")
        if t:
            print("         busiest thread: %s (%s, pid %d tid %d%s) %.0f%% of a core, %.1f threads busy" % (
                t["comm"], "main" if t["main"] else "not main", t["pid"], t["tid"], ", Python" if t["python"] else "",
                100 * t["busy"], t["busy_threads"]))
    result = {"schema": "pacer.bench.score_workloads/1", "host": platform.node(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "device": args.device,
              "seconds": args.seconds, "interval": args.interval, "runs": rows}
    with open(os.path.join(out, "score_workloads.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    ok = all(r["ok"] for r in rows)
    print(("OK" if ok else "FAILED") + ": %d of %d workloads classified as expected" % (sum(r["ok"] for r in rows), len(rows)))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--workload", help="run one workload (the child under pacer monitor)")
    p.add_argument("--steps-file")
    p.add_argument("--only", help="driver: comma-separated workloads")
    p.add_argument("--out", default="score-workloads-out")
    p.add_argument("--interval", default="1s")
    p.add_argument("--pacer", default=os.path.join(HERE, "../build/bin/pacer"))
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    if args.workload:
        return workload(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
