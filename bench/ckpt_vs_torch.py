"""pacer checkpoints next to torch.save/torch.load and the disk's own limit (dd).

Run through bench/ckpt_vs_torch.sh, which picks the python, the build and the
scratch directory and removes the scratch directory on exit:

    bash bench/ckpt_vs_torch.sh [BUILD_DIR]

Every round saves the same tensors (random float32, never zeros) with each
tool into the same directory, with the order of the tools rotating; loads are
timed from a cold page cache. See bench/README.md.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import pacer

MB = 1e6
MIB = 1 << 20


def log(msg):
    print(f"ckpt_vs_torch: {msg}", flush=True)


def now():
    return time.perf_counter()


# ---------------------------------------------------------------------------
# Page cache control.

def try_drop_caches():
    """Writes 1 to /proc/sys/vm/drop_caches; returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def files_under(path):
    if os.path.isfile(path):
        return [path]
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def evict(path, state):
    """Makes every file under path cold: fsync, then POSIX_FADV_DONTNEED, then
    (where permitted) drop_caches. Returns the bytes still resident (fincore)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if state["drop_caches"] is None or state["drop_caches"] == "ok":
        why = try_drop_caches()
        state["drop_caches"] = "ok" if why is None else why
    return resident_bytes(path)


def resident_bytes(path):
    """Bytes of the files under path in the page cache, from fincore(1); None if unavailable."""
    files = files_under(path)
    if not files or not shutil.which("fincore"):
        return None
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return sum(int(x) for x in r.stdout.split())


def warm(path):
    """Reads a file so that it sits in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


SETTLE_S = 3.0


def settle():
    """The same starting point for every timed step: dirty data written back,
    the journal committed (and its discards sent), and SETTLE_S seconds idle.
    On a VM whose balloon reports free pages to the host, the idle time also
    lets freed memory go back to the host, so that every tool pays the same
    first-touch cost for the memory it allocates (see bench/README.md)."""
    os.sync()
    time.sleep(SETTLE_S)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# The three contenders.

def run_dd(args):
    """Runs dd; returns (seconds dd reports, wall seconds, stderr)."""
    t0 = now()
    r = subprocess.run(args, capture_output=True, text=True)
    wall = now() - t0
    if r.returncode != 0:
        raise SystemExit(f"ckpt_vs_torch: {' '.join(args)} failed: {r.stderr}")
    m = re.search(r"copied, ([0-9.]+) s", r.stderr)
    return (float(m.group(1)) if m else wall), wall, r.stderr.strip().splitlines()[-1]


def dd_write(src, dst, total):
    # Buffered writes from a source file in the page cache, fsync before dd
    # exits: the same path to disk pacer and torch.save take.
    warm(src)
    settle()
    args = ["dd", f"if={src}", f"of={dst}", "bs=4M", "conv=fsync"]
    dd_s, wall, line = run_dd(args)
    if os.path.getsize(dst) != total:
        raise SystemExit(f"ckpt_vs_torch: dd wrote {os.path.getsize(dst)} bytes, expected {total}")
    return {"dd_s": dd_s, "wall_s": wall, "dd_line": line, "cmd": " ".join(args)}


def dd_write_direct(src, dst):
    warm(src)
    settle()
    args = ["dd", f"if={src}", f"of={dst}", "bs=4M", "oflag=direct", "conv=fsync"]
    dd_s, wall, line = run_dd(args)
    return {"dd_s": dd_s, "wall_s": wall, "dd_line": line, "cmd": " ".join(args)}


def dd_read_cold(path, state):
    res = evict(path, state)
    settle()
    args = ["dd", f"if={path}", "of=/dev/null", "bs=4M"]
    dd_s, wall, line = run_dd(args)
    return {"dd_s": dd_s, "wall_s": wall, "dd_line": line, "resident_before": res, "cmd": " ".join(args)}


def torch_round(tensors, path, state, check):
    settle()
    t0 = now()
    torch.save(tensors, path)
    t1 = now()
    fsync_path(path)
    fsync_dir(os.path.dirname(path))
    t2 = now()
    res = evict(path, state)
    settle()
    t3 = now()
    loaded = torch.load(path)
    t4 = now()
    ok = None
    if check:
        ok = loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    del loaded
    file_bytes = os.path.getsize(path)
    os.remove(path)
    return {"save_s": t1 - t0, "save_fsync_s": t2 - t0, "load_cold_s": t4 - t3, "resident_before_load": res,
            "file_bytes": file_bytes, "load_equal": ok}


def pacer_round(ck, root, step, tensors, state, check):
    for name in os.listdir(root):  # earlier rounds' steps: same directory state for every round
        if name.startswith("step-"):
            shutil.rmtree(os.path.join(root, name))
    settle()
    waits0 = ck.stats()["pool_waits"]
    t0 = now()
    h = ck.save(step, tensors)
    t1 = now()
    h.wait()
    t2 = now()
    pool_waits = ck.stats()["pool_waits"] - waits0
    step_dir = os.path.join(root, f"step-{step:012d}")
    res = evict(step_dir, state)
    settle()
    t3 = now()
    got_step, loaded, _ = ck.load(step)
    t4 = now()
    ok = None
    if check:
        ok = got_step == step and loaded.keys() == tensors.keys() and all(
            np.array_equal(loaded[k], tensors[k].numpy()) for k in tensors)
    del loaded
    file_bytes = sum(os.path.getsize(f) for f in files_under(step_dir))
    # dd of the checkpoint's own files from a cold cache (the issue's "dd of
    # the files"): the same bytes, on the same blocks, as pacer's load read.
    data = [f for f in files_under(step_dir) if f.endswith(".bin")]
    dd_files = [dd_read_cold(f, state) for f in data]
    return {"save_blocking_s": t1 - t0, "save_durable_s": t2 - t0, "load_cold_s": t4 - t3, "pool_waits": pool_waits,
            "resident_before_load": res, "file_bytes": file_bytes, "load_equal": ok,
            "dd_read_files_cold_s": sum(d["dd_s"] for d in dd_files), "extents": extents(data)}


def extents(paths):
    """Extents per file (filefrag), or None where it is missing: a file in many pieces reads back slower."""
    if not shutil.which("filefrag"):
        return None
    out = {}
    for p in paths:
        r = subprocess.run(["filefrag", p], capture_output=True, text=True)
        m = re.search(r"(\d+) extents? found", r.stdout)
        out[os.path.basename(p)] = int(m.group(1)) if m else None
    return out


def pacer_load_split(ck, root, step, names_sizes, state):
    """Where a cold pacer load's time goes, each part from a cold cache:
    - read_into of every blob into np.empty arrays (what load() does: it reads
      each byte once and checks it as it reads), through a Reader from the
      module's candidate list (the private _impl.candidates: no verify pass);
    - the same into torch.empty buffers (numpy asks the kernel for transparent
      huge pages for large arrays, torch does not);
    - verify() of a candidate Reader: every checksum into two reused buffers
      (disk + hashing, no new memory);
    - verify() again with the files read into the page cache first (hashing +
      copying; open() reads with O_DIRECT and leaves nothing cached)."""
    step_dir = os.path.join(root, f"step-{step:012d}")
    out = {}

    def cold():
        res = evict(step_dir, state)
        settle()
        return res

    for label, alloc in (("read_into_np_empty_cold_s", lambda n: np.empty(n, dtype=np.uint8)),
                         ("read_into_torch_empty_cold_s", lambda n: torch.empty(n, dtype=torch.uint8).numpy())):
        out[label.replace("_s", "_resident_before")] = cold()
        t0 = now()
        r = ck._impl.candidates(step)[0]
        bufs = [alloc(size) for _, size in names_sizes]
        for (name, _), b in zip(names_sizes, bufs):
            r.read_into(name, b)
        out[label] = now() - t0
        del bufs, r
    # load() with and without its thread that faults the new arrays in ahead
    # of the readers, alternated, 3 each (the private switch is the size from
    # which load() starts that thread).
    keep = pacer.checkpoint._PREFAULT_FROM
    runs = {"load_fault_ahead_cold_s": [], "load_no_fault_ahead_cold_s": []}
    try:
        for i in range(6):
            key = list(runs)[(i + i // 2) % 2]
            pacer.checkpoint._PREFAULT_FROM = keep if key == "load_fault_ahead_cold_s" else 1 << 62
            cold()
            t0 = now()
            loaded = ck.load(step)
            runs[key].append(now() - t0)
            del loaded
    finally:
        pacer.checkpoint._PREFAULT_FROM = keep
    for key, v in runs.items():
        out[key] = statistics.median(v)
        out[key.replace("_s", "_runs_s")] = v
    cold()
    t0 = now()
    # Reader.verify() of a candidate, not ck.open(): open() answers from the
    # process's cache of checks for a step this process wrote.
    r = ck._impl.candidates(step)[0]
    r.verify()
    out["open_verify_cold_s"] = now() - t0
    for f in files_under(step_dir):
        warm(f)
    out["verify_warm_resident_before"] = resident_bytes(step_dir)
    t0 = now()
    r.verify()
    out["verify_warm_s"] = now() - t0
    return out


# ---------------------------------------------------------------------------

def main():
    global SETTLE_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", required=True, help="directory to write in (emptied and removed at the end)")
    ap.add_argument("--bytes", type=int, default=2 << 30, help="total tensor bytes (default 2 GiB)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--staging", type=int, default=0,
                    help="pacer's staging budget in bytes (0: the tensors plus a chunk each, so save() never waits for the disk)")
    ap.add_argument("--overflow", type=int, default=0,
                    help="pacer's overflow_bytes: ordinary memory beyond the staging budget (0: none, save() waits for the disk)")
    ap.add_argument("--settle", type=float, default=3.0, help="idle seconds before every timed step")
    ap.add_argument("--facts", default="{}", help="JSON of machine facts gathered by the wrapper")
    ap.add_argument("--command", default="", help="how the benchmark was invoked")
    a = ap.parse_args()
    SETTLE_S = a.settle

    n = a.tensors
    per = a.bytes // n // 4 * 4
    total = per * n
    scratch = a.scratch
    os.makedirs(scratch, exist_ok=True)
    src = os.path.join(scratch, "dd-source.bin")
    dd_dst = os.path.join(scratch, "dd-target.bin")
    torch_file = os.path.join(scratch, "torch-ckpt.pt")
    pacer_root = os.path.join(scratch, "pacer")
    state = {"drop_caches": None}

    try:
        log(f"{n} float32 tensors, {total / MIB:,.0f} MiB in all, {a.rounds} rounds, in {scratch}")
        rng = np.random.default_rng(20261129)
        tensors = {}
        for i in range(n):
            arr = rng.standard_normal(per // 4, dtype=np.float32)
            arr[arr == 0] = 1.0  # never zeros (a zero page would flatter any tool)
            tensors[f"layer{i:02d}.weight"] = torch.from_numpy(arr)
        # The dd source: the same bytes, written once and kept in the page cache.
        with open(src, "wb") as f:
            for t in tensors.values():
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        with open(src, "rb") as f:
            while f.read(64 << 20):
                pass
        src_resident = resident_bytes(src)

        # Single-thread memcpy of the same bytes into warm memory: the floor
        # for the time save() blocks, which copies everything once.
        dst = {k: np.empty_like(t.numpy()) for k, t in tensors.items()}
        for k, t in tensors.items():
            np.copyto(dst[k], t.numpy())
        memcpy_s = []
        for _ in range(3):
            t0 = now()
            for k, t in tensors.items():
                np.copyto(dst[k], t.numpy())
            memcpy_s.append(now() - t0)
        del dst
        # First touch of memory after an idle pause (what a fresh allocation
        # or new page-cache pages cost here), then of the same memory again.
        settle()
        t0 = now()
        fresh = np.ones(total // 4, dtype=np.float32)
        first_touch_s = now() - t0
        del fresh
        t0 = now()
        fresh = np.ones(total // 4, dtype=np.float32)
        retouch_s = now() - t0
        del fresh

        # Default >= total: save() never waits for the writer; smaller measures a checkpoint larger than the pool.
        staging = a.staging or total + (64 << 20) * (n + 1)
        ck = pacer.Checkpointer(pacer_root, keep_last=0, staging_bytes=staging, overflow_bytes=a.overflow)
        # Warm-up: allocates and faults in the staging buffers (and the overflow's).
        t0 = now()
        ck.save(0, tensors).wait()
        warmup_s = now() - t0
        shutil.rmtree(os.path.join(pacer_root, "step-000000000000"))

        order = ["dd", "torch", "pacer"]
        rows = []
        for r in range(1, a.rounds + 1):
            rot = order[(r - 1) % 3:] + order[:(r - 1) % 3]
            log(f"round {r}/{a.rounds}: {' -> '.join(rot)}")
            # The machine may be shared (other builds): record how busy it was.
            row = {"round": r, "order": rot, "loadavg_1m_at_start": os.getloadavg()[0]}
            for who in rot:
                if who == "dd":
                    row["dd"] = dd_write(src, dd_dst, total)
                    row["dd_read_cold"] = dd_read_cold(dd_dst, state)
                    os.remove(dd_dst)
                    row["dd_direct"] = dd_write_direct(src, dd_dst)
                    os.remove(dd_dst)
                elif who == "torch":
                    row["torch"] = torch_round(tensors, torch_file, state, check=True)
                else:
                    row["pacer"] = pacer_round(ck, pacer_root, r, tensors, state, check=True)
            rows.append(row)
            for who in ("torch", "pacer"):
                if row[who]["load_equal"] is not True:
                    raise SystemExit(f"ckpt_vs_torch: {who} loaded different data in round {r}")
        # Diagnosis, after the timed rounds: how a cold pacer load splits.
        split = pacer_load_split(ck, pacer_root, a.rounds, [(k, t.numel() * 4) for k, t in tensors.items()], state)
        ck.flush()
        del ck
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    touch = {"first_touch_after_idle_s": first_touch_s, "retouch_at_once_s": retouch_s}
    write_results(a, rows, total, n, per, memcpy_s, warmup_s, split, src_resident, state, staging, touch)


def write_results(a, rows, total, n, per, memcpy_s, warmup_s, split, src_resident, state, staging, touch):
    med = statistics.median

    def mbps(s):
        return total / s / MB

    def series(path):
        out = []
        for row in rows:
            v = row
            for k in path:
                v = v[k]
            out.append(v)
        return out

    dd_s = med(series(["dd", "dd_s"]))
    dd_direct_s = med(series(["dd_direct", "dd_s"]))
    dd_read_s = med(series(["dd_read_cold", "dd_s"]))
    dd_files_s = med(series(["pacer", "dd_read_files_cold_s"]))
    t_save = med(series(["torch", "save_s"]))
    t_save_fsync = med(series(["torch", "save_fsync_s"]))
    t_load = med(series(["torch", "load_cold_s"]))
    p_block = med(series(["pacer", "save_blocking_s"]))
    p_durable = med(series(["pacer", "save_durable_s"]))
    p_load = med(series(["pacer", "load_cold_s"]))

    figures = {
        "dd_write_fsync_MBps": mbps(dd_s),
        "dd_write_direct_MBps": mbps(dd_direct_s),
        "dd_read_cold_MBps": mbps(dd_read_s),
        "dd_read_pacer_files_cold_MBps": mbps(dd_files_s),
        "torch_save_no_fsync_MBps": mbps(t_save),
        "torch_save_fsync_MBps": mbps(t_save_fsync),
        "torch_load_cold_MBps": mbps(t_load),
        "pacer_save_durable_MBps": mbps(p_durable),
        "pacer_save_blocking_s": p_block,
        "pacer_load_cold_MBps": mbps(p_load),
        "memcpy_1thread_MBps": mbps(med(memcpy_s)),
        "first_touch_after_idle_MBps": mbps(touch["first_touch_after_idle_s"]),
        "retouch_at_once_MBps": mbps(touch["retouch_at_once_s"]),
    }
    medians_s = {"dd_write_fsync": dd_s, "dd_write_direct": dd_direct_s, "dd_read_cold": dd_read_s,
                 "dd_read_pacer_files_cold": dd_files_s,
                 "torch_save": t_save, "torch_save_fsync": t_save_fsync, "torch_load_cold": t_load,
                 "pacer_save_blocking": p_block, "pacer_save_durable": p_durable, "pacer_load_cold": p_load,
                 "memcpy_1thread": med(memcpy_s)}
    targets = [
        {"target": "save >= 90% of dd (pacer save+wait MB/s / dd conv=fsync MB/s)",
         "value": dd_s / p_durable, "goal": ">= 0.90"},
        {"target": "load >= 1.3x torch.load, cold cache (pacer load MB/s / torch.load MB/s)",
         "value": t_load / p_load, "goal": ">= 1.3"},
        {"target": "load >= 0.8x dd of the checkpoint's files, cold cache (pacer load MB/s / cold dd read MB/s)",
         "value": dd_files_s / p_load, "goal": ">= 0.8"},
        {"target": "(for information) load >= 0.8x dd of the copy dd wrote, cold cache",
         "value": dd_read_s / p_load, "goal": ">= 0.8", "info": True},
        {"target": "(stricter, for information) save >= 90% of dd oflag=direct",
         "value": dd_direct_s / p_durable, "goal": ">= 0.90", "info": True},
        {"target": "blocking <= 5% of a synchronous save: reference torch.save + fsync",
         "value": p_block / t_save_fsync, "goal": "<= 0.05"},
        {"target": "blocking <= 5% of a synchronous save: reference pacer save + wait",
         "value": p_block / p_durable, "goal": "<= 0.05"},
    ]
    for t in targets:
        goal = float(t["goal"].split()[1])
        t["met"] = t["value"] >= goal if t["goal"].startswith(">=") else t["value"] <= goal
    ratios = {
        "pacer_over_dd_save": dd_s / p_durable,
        "pacer_over_dd_direct_save": dd_direct_s / p_durable,
        "pacer_over_torch_save_fsync": t_save_fsync / p_durable,
        "pacer_over_torch_save_no_fsync": t_save / p_durable,
        "pacer_over_torch_load_cold": t_load / p_load,
        "pacer_load_over_dd_read_cold": dd_read_s / p_load,
        "pacer_load_over_dd_read_pacer_files_cold": dd_files_s / p_load,
        "blocking_over_torch_save_fsync": p_block / t_save_fsync,
        "blocking_over_pacer_save_durable": p_block / p_durable,
        "blocking_over_memcpy": p_block / med(memcpy_s),
    }
    facts = json.loads(a.facts)
    day = datetime.datetime.now(datetime.timezone.utc)
    doc = {
        "benchmark": "ckpt_vs_torch",
        "date": day.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": a.command,
        "machine": {"hostname": socket.gethostname(), "nproc": os.cpu_count(), "kernel": platform.release(),
                    "python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
                    "pacer": pacer.__version__, **facts},
        "params": {"rounds": a.rounds, "tensors": n, "tensor_bytes": per, "total_bytes": total, "dtype": "float32",
                   "data": "numpy default_rng(20261129).standard_normal, zeros replaced by 1.0",
                   "pacer_options": {"keep_last": 0, "staging_bytes": staging, "overflow_bytes": a.overflow,
                                     "chunk_bytes": 64 << 20},
                   "order": "rotates each round: dd, torch, pacer / torch, pacer, dd / pacer, dd, torch"},
        "method": {
            "bytes": "MB/s = total tensor bytes / seconds / 1e6 for every tool (file overheads not counted)",
            "dd": "dd if=<the same bytes, one file in the page cache> of=<new file> bs=4M conv=fsync; seconds as "
                  "dd reports them (open to exit of the copy, fsync included). oflag=direct and a cold read "
                  "(dd of=/dev/null) are recorded for information",
            "torch": "torch.save(dict, path) (then fsync of the file and of its directory: save_fsync_s); "
                     "torch.load(path) after evicting the file",
            "pacer": f"Checkpointer(root, keep_last=0, staging_bytes={staging}, {'>=' if staging >= total else '<'} total, "
                     f"overflow_bytes={a.overflow}); "
                     "one warm-up save first; "
                     "save_blocking_s = save() returning; save_durable_s = save() + wait(); pool_waits = times "
                     "that save() found staging full and waited for the writer; load_cold_s = "
                     "ck.load(step) after evicting the step directory",
            "cold_cache": "each file: fsync, posix_fadvise(POSIX_FADV_DONTNEED); then echo 1 > "
                          "/proc/sys/vm/drop_caches where permitted. fincore(1) records the bytes still resident",
            "drop_caches": state["drop_caches"] if state["drop_caches"] is not None else "not tried",
            "memcpy": "np.copyto of every tensor into warm arrays, one thread: the floor for save()'s copy",
            "settle": f"before every timed step: os.sync() and {SETTLE_S:g} s idle; the dd source is re-read "
                      "into the page cache before each dd write",
            "first_touch": "np.ones of total bytes after the idle pause, then again at once: what new memory "
                           "(fresh arrays, new page-cache pages) costs on this machine",
        },
        "memory_touch_s": touch,
        "dd_source_resident_bytes": src_resident,
        "pacer_warmup_save_s": warmup_s,
        "memcpy_1thread_s": memcpy_s,
        "medians_s": medians_s,
        "figures": figures,
        "ratios": ratios,
        "targets": targets,
        "pacer_load_split": split,
        "rounds": rows,
    }
    with open(a.out_json, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")

    def f1(x):
        return f"{x:,.1f}"

    def f2(x):
        return f"{x:.2f}"

    def f3(x):
        return f"{x:.3f}"

    m = doc["machine"]
    loads = ", ".join(f"{row['loadavg_1m_at_start']:.1f}" for row in rows)
    cold = ("fsync + POSIX_FADV_DONTNEED per file" +
            (" + drop_caches" if state["drop_caches"] == "ok" else f"; drop_caches not permitted ({state['drop_caches']})"))
    md = [
        f"# pacer checkpoints vs torch.save/torch.load and dd, {day.strftime('%Y-%m-%d')}",
        "",
        f"Machine: `{m['hostname']}`, {m['nproc']} CPUs ({m.get('cpu_model', '?')}), {m.get('mem_total', '?')} RAM, "
        f"kernel {m['kernel']}; files on {m.get('fs_type', '?')} on {m.get('device', '?')}. "
        f"Python {m['python']}, numpy {m['numpy']}, torch {m['torch']}, pacer {m['pacer']} ({m.get('pacer_commit', '?')}).",
        f"Data: {n} float32 tensors of {per / MIB:,.0f} MiB ({total / MIB:,.0f} MiB in all), random normal. "
        f"{a.rounds} rounds, tool order rotating, medians shown; before every timed step `sync` and {SETTLE_S:g} s idle. "
        f"Cold cache: {cold}. "
        f"Generated by `{a.command}`; raw numbers in `{os.path.basename(a.out_json)}`. "
        f"Load average (1 min) at the start of each round: {loads} on {m['nproc']} CPUs.",
        "",
        "| figure | seconds | MB/s |",
        "|---|---:|---:|",
        f"| dd write, bs=4M conv=fsync (disk limit for buffered writes) | {f3(dd_s)} | {f1(mbps(dd_s))} |",
        f"| dd write, bs=4M oflag=direct conv=fsync (info) | {f3(dd_direct_s)} | {f1(mbps(dd_direct_s))} |",
        f"| dd read, cold, bs=4M, of the checkpoint's data files | {f3(dd_files_s)} | {f1(mbps(dd_files_s))} |",
        f"| dd read, cold, bs=4M, of the file dd wrote (info) | {f3(dd_read_s)} | {f1(mbps(dd_read_s))} |",
        f"| torch.save (no fsync) | {f3(t_save)} | {f1(mbps(t_save))} |",
        f"| torch.save + fsync | {f3(t_save_fsync)} | {f1(mbps(t_save_fsync))} |",
        f"| torch.load, cold | {f3(t_load)} | {f1(mbps(t_load))} |",
        f"| pacer save() blocking | {f3(p_block)} | {f1(mbps(p_block))} |",
        f"| pacer save() + wait() (durable, committed) | {f3(p_durable)} | {f1(mbps(p_durable))} |",
        f"| pacer load(step), cold | {f3(p_load)} | {f1(mbps(p_load))} |",
        f"| memcpy, 1 thread, same bytes (info: floor for save() blocking) | {f3(med(memcpy_s))} | {f1(mbps(med(memcpy_s)))} |",
        f"| first touch of new memory after {SETTLE_S:g} s idle (info) | {f3(touch['first_touch_after_idle_s'])} | "
        f"{f1(figures['first_touch_after_idle_MBps'])} |",
        f"| the same, touched again at once (info) | {f3(touch['retouch_at_once_s'])} | "
        f"{f1(figures['retouch_at_once_MBps'])} |",
        "",
        "| target | value | goal | met |",
        "|---|---:|---:|---|",
    ]
    for t in targets:
        md.append(f"| {t['target']} | {f3(t['value'])} | {t['goal']} | {'yes' if t['met'] else 'NO'} |")
    md += [
        "",
        "Other ratios: "
        f"pacer save / torch.save+fsync = {f2(ratios['pacer_over_torch_save_fsync'])}x, "
        f"pacer save / torch.save without fsync = {f2(ratios['pacer_over_torch_save_no_fsync'])}x, "
        f"pacer cold load / cold dd read of the file dd wrote = {f3(ratios['pacer_load_over_dd_read_cold'])}, "
        f"save() blocking / 1-thread memcpy = {f2(ratios['blocking_over_memcpy'])}.",
        "",
        "Where a cold pacer load goes (after the rounds, last step, each from a cold cache): `read_into` of every "
        f"blob into `np.empty` arrays, as `load()` does: {f3(split['read_into_np_empty_cold_s'])} s; the same into "
        f"`torch.empty` buffers: {f3(split['read_into_torch_empty_cold_s'])} s; `verify()` of the step, which checks every "
        f"checksum into two reused buffers: {f3(split['open_verify_cold_s'])} s; `verify()` again with the files "
        f"read into the page cache first: {f3(split['verify_warm_s'])} s. `load()` with its thread that faults the new "
        f"arrays in ahead of the readers: {f3(split['load_fault_ahead_cold_s'])} s, without it: "
        f"{f3(split['load_no_fault_ahead_cold_s'])} s (medians of 3 each, alternated).",
        "",
        "## Per round",
        "",
        "| round | order | dd s | dd direct s | dd read s | torch.save s | +fsync s | torch.load s | "
        "pacer blocking s | pool waits | pacer durable s | pacer load s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        md.append(f"| {row['round']} | {', '.join(row['order'])} | {f3(row['dd']['dd_s'])} | "
                  f"{f3(row['dd_direct']['dd_s'])} | {f3(row['dd_read_cold']['dd_s'])} | {f3(row['torch']['save_s'])} | "
                  f"{f3(row['torch']['save_fsync_s'])} | {f3(row['torch']['load_cold_s'])} | "
                  f"{f3(row['pacer']['save_blocking_s'])} | {row['pacer']['pool_waits']} | {f3(row['pacer']['save_durable_s'])} | "
                  f"{f3(row['pacer']['load_cold_s'])} |")
    md += [
        "",
        "Bytes still in the page cache when each cold load started (fincore): "
        + ", ".join(f"round {row['round']}: torch {row['torch']['resident_before_load']}, "
                    f"pacer {row['pacer']['resident_before_load']}, dd {row['dd_read_cold']['resident_before']}"
                    for row in rows) + ".",
        "",
        "## Commands",
        "",
        "```",
        f"dd write:  {rows[0]['dd']['cmd']}",
        f"dd direct: {rows[0]['dd_direct']['cmd']}",
        f"dd read:   {rows[0]['dd_read_cold']['cmd']}",
        "torch:     torch.save(tensors, path); fsync(path); fsync(dir) | evict | torch.load(path)",
        "pacer:     ck = pacer.Checkpointer(root, keep_last=0, staging_bytes=%d, overflow_bytes=%d); "
        "ck.save(step, tensors).wait() | evict | ck.load(step)" % (staging, a.overflow),
        "```",
    ]
    with open(a.out_md, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md[:24 + len(targets)]))


if __name__ == "__main__":
    main()
