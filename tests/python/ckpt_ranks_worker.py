"""One rank of test_checkpoint_ranks: torch.distributed over gloo from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.

    ckpt_ranks_worker.py ROOT save       replicated model + optimizer state, a row-sharded tensor, a PerRank value,
                                         one save, then each rank loads its own value back
    ckpt_ranks_worker.py ROOT die        rank 1 dies inside the save; rank 0 reports what wait() said
    ckpt_ranks_worker.py ROOT hang       rank 1 stays alive but never commits; rank 0 reports what wait() said
    ckpt_ranks_worker.py ROOT dtensor    torch 2.x: DTensors placed Shard(0) and Replicate(), saved and loaded back into
    ckpt_ranks_worker.py ROOT shared     replicated tensors of a few MiB: read by each rank (host memory over gloo
                                         is not shared by default); then, sharing over gloo, each rank reads its part
                                         of step 2 and gets the rest by broadcast; then step 2 is damaged and every rank falls back to
                                         step 1; then rank 0 loads alone (collective=False) while rank 1 does not load
    ckpt_ranks_worker.py ROOT agree      the ranks see different candidates: rank 1 lacks step 2 (both resume from 1);
                                         rank 0 has a damaged extra copy of step 2 first (both resume from 2); rank 1
                                         has no checkpoint, or a structure that does not fit (both raise, at once)
Prints one JSON line: {"rank", "ok", "error", "seconds"}.
"""
import datetime
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

import pacer

ROWS, COLS = 10, 4
HANG_TIMEOUT = 4.0  # the hung rank's peer gives up after this
TIMEOUT = 60.0  # elsewhere: long enough for a slow disk on a busy 2-core machine


def sharded_rows(rank, world):
    """Uneven rows per rank: 6 and 4 of 10 for two ranks."""
    bounds = [0, 6, ROWS] if world == 2 else [round(ROWS * r / world) for r in range(world + 1)]
    return bounds[rank], bounds[rank + 1]


def dtensors(root, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(11 * COLS, dtype=torch.float32).reshape(11, COLS)  # uneven: 6 and 5 rows
    small = torch.arange(3.0)
    ck = pacer.Checkpointer(root, keep_last=0, timeout=TIMEOUT)
    result = {"rank": rank, "ok": True, "error": None}
    try:
        try:
            ck.save(6, {"bad": distribute_tensor(full, mesh, [Shard(1)])})
            result.update(ok=False, error="Shard(1) was accepted")
        except pacer.Error as e:
            assert "state['bad']: cannot save a DTensor placed as" in str(e), str(e)
        ck.save(7, {"dt": distribute_tensor(full, mesh, [Shard(0)]),
                    "rep": distribute_tensor(small, mesh, [Replicate()])}).wait()
        into = {"dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                "rep": distribute_tensor(torch.zeros(3), mesh, [Replicate()])}
        ck.load(into=into)
        want = full.chunk(world)[rank]
        assert torch.equal(into["dt"].to_local(), want), (into["dt"].to_local(), want)
        assert torch.equal(into["rep"].to_local(), small)
    except pacer.Error as e:
        result.update(ok=False, error=str(e))
    print(json.dumps(result), flush=True)


def shared_loads(root, rank, world):
    """Replicated state, loaded by every rank: the large pieces are read once between them."""
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"a": torch.randn(3 << 18, generator=g), "b": torch.randn(2 << 18, generator=g).to(torch.bfloat16),
                "small": torch.arange(5.0) + step, "own": pacer.PerRank(torch.full((3,), float(rank)))}
    ck = pacer.Checkpointer(root, keep_last=0, chunk_bytes=1 << 20, timeout=TIMEOUT)
    result = {"rank": rank, "ok": True, "error": None}
    try:
        for step in (1, 2):
            ck.save(step, state(step)).wait()
        into = {"a": torch.zeros(3 << 18), "b": torch.zeros(2 << 18, dtype=torch.bfloat16), "small": torch.zeros(5),
                "own": pacer.PerRank(torch.zeros(3))}
        step, _, _ = ck.load(into=into)  # by default host memory is not sent over gloo: each rank reads it
        assert step == 2 and torch.equal(into["a"], state(2)["a"]), step
        result["default"] = dict(ck.last_load)
        pacer.checkpoint._SHARE_OVER_GLOO = True  # the exchange itself, as CUDA tensors over NCCL take it
        step, _, _ = ck.load(into=into)
        want = state(2)
        assert step == 2 and all(torch.equal(into[k], want[k]) for k in ("a", "b", "small")), "step 2 differs"
        assert torch.equal(into["own"].value, torch.full((3,), float(rank))), into["own"].value
        result["first"] = dict(ck.last_load)
        dist.barrier()
        if rank == 0:  # one bit of step 2's data flipped: a bad copy, for every rank
            path = os.path.join(root, "step-000000000002", "rank-00001.bin")
            with open(path, "r+b") as f:
                f.seek(4096 + 17)
                b = f.read(1)
                f.seek(4096 + 17)
                f.write(bytes([b[0] ^ 1]))
        dist.barrier()
        step, _, _ = ck.load(into=into)
        want = state(1)
        assert step == 1 and all(torch.equal(into[k], want[k]) for k in ("a", "b", "small")), f"fell back to {step}"
        result["damaged"] = dict(ck.last_load)
        dist.barrier()
        if rank == 0:
            step, alone, _ = ck.load(collective=False)
            assert step == 1 and torch.equal(alone["a"], want["a"])
            result["alone"] = dict(ck.last_load)
        dist.barrier()
    except (pacer.Error, AssertionError) as e:
        result.update(ok=False, error=str(e))
    print(json.dumps(result), flush=True)


class _Candidates:
    """A Checkpointer's core with this rank's candidates changed, as a node's own view of the steps can differ."""

    def __init__(self, impl, change):
        self.impl, self.change = impl, change

    def __getattr__(self, name):
        return getattr(self.impl, name)

    def candidates(self, step=None):
        return self.change(list(self.impl.candidates(step)))


def step_or_error(ck, into):
    """The step load() resumed from, or its error; and the seconds it took."""
    t0 = time.monotonic()
    try:
        got = ck.load(into=into).step
    except pacer.Error as e:
        got = str(e)
    return got, time.monotonic() - t0


def agree(root, rank, world):
    """Ranks whose candidates differ still resume from one step, or all raise."""
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"a": torch.randn(3 << 18, generator=g), "small": torch.arange(5.0) + step}
    ck = pacer.Checkpointer(root, keep_last=0, chunk_bytes=1 << 20, timeout=TIMEOUT)
    result = {"rank": rank, "ok": True, "error": None}
    pacer.checkpoint._SHARE_OVER_GLOO = True  # the exchange, as CUDA tensors over NCCL take it
    impl = ck._impl
    try:
        for step in (1, 2):
            ck.save(step, state(step)).wait()
        into = {"a": torch.zeros(3 << 18), "small": torch.zeros(5)}
        # Rank 1 does not list step 2 (its listing raced the commit, or a node-local copy): not two steps.
        if rank == 1:
            ck._impl = _Candidates(impl, lambda c: [r for r in c if r.step != 2])
        result["hidden"] = ck.load(into=into).step
        assert torch.equal(into["a"], state(result["hidden"])["a"])
        ck._impl = impl
        dist.barrier()
        # Rank 0 lists a second copy of step 2 first, and that copy is damaged: it reads the next copy, not step 1.
        if rank == 0:
            copy = os.path.join(os.path.dirname(root), "copy")
            shutil.copytree(root, copy)
            for name in os.listdir(os.path.join(copy, "step-000000000002")):
                if name.endswith(".bin"):
                    with open(os.path.join(copy, "step-000000000002", name), "r+b") as f:
                        size = f.seek(0, 2)
                        for at in range(4096 + 17, size, 1 << 15):
                            f.seek(at)
                            b = f.read(1)
                            f.seek(at)
                            f.write(bytes([b[0] ^ 1]))
            other = pacer.checkpoint._Checkpointer(copy, None, 0, 0, 1 << 26, 1 << 20, None, 0)
            ck._impl = _Candidates(impl, lambda c: [r for r in other.candidates(2)] + c)
        result["copies"] = ck.load(into=into).step
        assert torch.equal(into["a"], state(result["copies"])["a"])
        ck._impl = impl
        dist.barrier()
        # Rank 1 finds nothing to load: rank 0 must not resume alone.
        if rank == 1:
            ck._impl = _Candidates(impl, lambda c: [])
        result["nothing"], result["nothing_s"] = step_or_error(ck, into)
        ck._impl = impl
        dist.barrier()
        # Rank 1's structure does not fit the checkpoint: it raises, and so does rank 0, at once.
        bad = {"a": torch.zeros(3 << 18), "small": torch.zeros(6 if rank == 1 else 5)}
        result["mismatch"], result["mismatch_s"] = step_or_error(ck, bad)
        dist.barrier()
        result["after"] = ck.load(into=into).step  # the ranks still agree: nothing was left behind
    except (pacer.Error, AssertionError) as e:
        result.update(ok=False, error=str(e))
    print(json.dumps(result), flush=True)


def main():
    root, mode = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "dtensor":
        dtensors(root, rank, world)
        dist.destroy_process_group()
        return
    if mode in ("shared", "agree"):
        (shared_loads if mode == "shared" else agree)(root, rank, world)
        dist.destroy_process_group()
        return
    torch.manual_seed(0)  # the same replicated state on every rank
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    lo, hi = sharded_rows(rank, world)
    state = {"model": model.state_dict(), "optim": opt.state_dict(),
             "emb": pacer.Shard(full[lo:hi].clone(), lo, (ROWS, COLS)), "world": world,
             "own": pacer.PerRank({"gen": torch.Generator().manual_seed(100 + rank).get_state(), "rank": rank})}
    ck = pacer.Checkpointer(root, keep_last=0, timeout=HANG_TIMEOUT if mode == "hang" else TIMEOUT)
    assert (ck.rank, ck.world_size) == (rank, world), (ck.rank, ck.world_size)
    t0 = time.monotonic()
    result = {"rank": rank, "ok": True, "error": None}
    try:
        h = ck.save(5, state, meta={"ranks": world})
        if rank == 1 and mode == "die":
            os._exit(17)
        if rank == 1 and mode == "hang":
            time.sleep(2 * HANG_TIMEOUT)
            os._exit(0)
        h.wait()
        if mode == "save":  # each rank gets back the value it saved, not rank 0's
            own = pacer.PerRank({"gen": None, "rank": -1})  # None: replaced by what was saved
            ck.load(into={"model": model.state_dict(), "optim": opt.state_dict(),
                          "emb": pacer.Shard(torch.zeros(hi - lo, COLS), lo, (ROWS, COLS)), "world": 0, "own": own})
            want = torch.Generator().manual_seed(100 + rank).get_state()
            assert own.value["rank"] == rank and torch.equal(own.value["gen"], want), own.value["rank"]
    except pacer.Error as e:
        result.update(ok=False, error=str(e))
    result["seconds"] = time.monotonic() - t0
    print(json.dumps(result), flush=True)
    if mode != "save":
        os._exit(0)  # the peer is gone: skip torch.distributed's teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
