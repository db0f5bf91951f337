"""Several ranks from Python: two processes with torch.distributed over gloo save one checkpoint collectively
(replicated, row-sharded and per-rank state); it loads back at world size 1; a data-parallel run (DDP)
resumed from a collective save repeats the uninterrupted run's losses bit for bit on every rank; a rank that dies or hangs inside the
collective save makes the other return an error within the timeout, and nothing is committed. Under mpirun
without torch.distributed, pacer's MPI world commits.

    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_checkpoint_ranks
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import pacer

try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = dist = None

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_ranks_worker.py")


def has_dtensor():
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.tensor import DTensor, Shard  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - torch 1.13 has neither
        return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipIf(dist is None or not dist.is_available(), "torch.distributed is not available")
class TwoRanks(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-ranks-")
        self.root = os.path.join(self.tmp.name, "ckpt")

    def tearDown(self):
        self.tmp.cleanup()

    def ranks(self, mode, world=2):
        port = free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                       WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, WORKER, self.root, mode], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            lines = [l for l in stdout.splitlines() if l.startswith("{")]
            out.append((p.returncode, json.loads(lines[-1]) if lines else None, stderr))
        return out

    def committed(self):
        if not os.path.isdir(self.root):
            return []
        return sorted(n for n in os.listdir(self.root)
                      if n.startswith("step-") and os.path.exists(os.path.join(self.root, n, "MANIFEST.json")))

    def test_collective_save_loads_at_world_size_one(self):
        for code, res, err in self.ranks("save"):
            self.assertEqual(code, 0, err)
            self.assertTrue(res["ok"], res)
        self.assertEqual(self.committed(), ["step-000000000005"])
        with open(os.path.join(self.root, "step-000000000005", "MANIFEST.json")) as f:
            m = json.load(f)
        self.assertEqual(m["world_size"], 2)
        shards = sorted((b["rank"], b["shard_offset"], b["size"]) for b in m["blobs"] if b["name"] == "emb")
        self.assertEqual(shards, [(0, 0, 6 * 16), (1, 6 * 16, 4 * 16)])

        ck = pacer.Checkpointer(self.root)  # one rank, no torch.distributed
        self.assertEqual(ck.world_size, 1)
        step, state, meta = ck.load()
        self.assertEqual((step, meta, state["world"]), (5, {"ranks": 2}, 2))
        self.assertEqual(state["own"]["rank"], 0)  # rank 0's own value, at world size one
        self.assertTrue(torch.equal(state["own"]["gen"], torch.Generator().manual_seed(100).get_state()))
        full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
        self.assertTrue(torch.equal(state["emb"], full))
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(state["model"][k], v), k)
        self.assertTrue(torch.equal(state["optim"]["state"][0]["momentum_buffer"],
                                    opt.state[model.weight]["momentum_buffer"]))
        # Another split of the rows than the one saved: three rows from the middle.
        part = torch.zeros(3, 4)
        ck.load(into={"model": model.state_dict(), "optim": opt.state_dict(), "emb": pacer.Shard(part, 4, (10, 4)),
                      "world": 0})
        self.assertTrue(torch.equal(part, full[4:7]))

    def test_replicated_state_is_read_once_between_the_ranks(self):
        out = self.ranks("shared")
        for code, res, err in out:
            self.assertEqual(code, 0, err)
            self.assertTrue(res["ok"], (res, err))
        large = (3 << 18) * 4 + (2 << 18) * 2  # "a" and "b": shared; "small" and each rank's own: read by each
        for _, res, _ in out:  # the default over gloo: every rank reads for itself
            self.assertFalse(res["default"]["shared"], res)
            self.assertGreater(res["default"]["bytes_read"], large)
            self.assertEqual(res["default"]["bytes_received"], 0)
        first = [res["first"] for _, res, _ in out]
        for f in first:
            self.assertTrue(f["shared"], f)
            self.assertEqual(f["step"], 2)
            self.assertLess(f["bytes_read"], large)  # not the whole state on any rank
        self.assertEqual(sum(f["bytes_read"] - f["bytes_alone"] for f in first), large)  # every shared byte read once
        self.assertTrue(all(f["bytes_received"] > 0 for f in first), first)  # and each rank got some from the other
        self.assertEqual([f["bytes_read"] - f["bytes_alone"] + f["bytes_received"] for f in first], [large, large])
        # The damaged step: whichever rank read the bad piece, every rank skips step 2 and all resume from step 1,
        # still reading it once between them.
        for _, res, err in out:
            self.assertEqual(res["damaged"]["step"], 1, res)
            self.assertTrue(res["damaged"]["shared"], res)
            self.assertIn("skipping step 2", err)
        self.assertTrue(any("checksum mismatch" in err for _, _, err in out), [e for _, _, e in out])
        self.assertTrue(any("another rank could not read its part of step 2" in err for _, _, err in out),
                        [e for _, _, e in out])
        alone = out[0][1]["alone"]
        self.assertFalse(alone["shared"])
        self.assertGreaterEqual(alone["bytes_read"], large)

    def test_ranks_that_list_different_candidates_still_resume_from_one_step(self):
        out = self.ranks("agree")
        for code, res, err in out:
            self.assertEqual(code, 0, err)
            self.assertTrue(res["ok"], (res, err))
        # Rank 1 does not list step 2: both resume from step 1, not rank 0 from 2 and rank 1 from 1.
        self.assertEqual([res["hidden"] for _, res, _ in out], [1, 1], out)
        self.assertIn("skipping step 2", out[0][2])
        # Rank 0's first copy of step 2 is damaged: it reads its other copy and both resume from step 2.
        self.assertEqual([res["copies"] for _, res, _ in out], [2, 2], out)
        self.assertIn("checksum mismatch", out[0][2])
        # A rank with nothing to load, or whose structure does not fit: every rank raises, none waits for the timeout.
        self.assertIn("no valid checkpoint", out[1][1]["nothing"])
        self.assertIn("rank 1", out[0][1]["nothing"])
        self.assertIn("'small'", out[1][1]["mismatch"])
        self.assertIn("rank 1", out[0][1]["mismatch"])
        for _, res, _ in out:
            self.assertLess(res["nothing_s"], 10, res)
            self.assertLess(res["mismatch_s"], 10, res)
            self.assertEqual(res["after"], 2, res)

    def test_data_parallel_resume_is_bit_identical_on_every_rank(self):
        data = os.path.join(self.tmp.name, "tokens")
        rng = np.random.default_rng(0)
        pacer.data.write_tokens(data, [rng.integers(1, 97, size=int(n)).tolist()
                                       for n in rng.integers(5, 40, size=300)], dtype="int32")

        def run(root, mode, world=2):
            port = free_port()
            procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_ddp_resume.py"), data, root, mode],
                                      env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                               WORLD_SIZE=str(world), OMP_NUM_THREADS="1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
            out = []
            for p in procs:
                stdout, stderr = p.communicate(timeout=180)
                self.assertEqual(p.returncode, 0, stderr)
                out.append(json.loads(stdout) if stdout.strip() else None)
            return out

        full = run(os.path.join(self.tmp.name, "unused"), "full")
        run(self.root, "first")
        resumed = run(self.root, "resume")
        self.assertEqual(len(full[0]), 20)
        self.assertNotEqual(full[0], full[1])  # the ranks' losses differ: their data and dropout are their own
        self.assertEqual(resumed, full)  # == on floats, every rank: bit-identical

    @unittest.skipIf(dist is None or not has_dtensor(), "torch has no public DTensor (torch < 2.4)")
    def test_dtensors_shard0_and_replicate(self):
        for code, res, err in self.ranks("dtensor"):
            self.assertEqual(code, 0, err)
            self.assertTrue(res["ok"], res)
        _, state, _ = pacer.Checkpointer(self.root).load(7)
        self.assertTrue(torch.equal(state["dt"], torch.arange(44.0).reshape(11, 4)))
        self.assertTrue(torch.equal(state["rep"], torch.arange(3.0)))

    def check_nothing_committed(self, results, what):
        code, res, err = results[0]
        self.assertEqual(code, 0, err)
        self.assertIsNotNone(res, err)
        self.assertFalse(res["ok"], f"{what}: rank 0's save succeeded")
        self.assertIn("nothing was committed", res["error"])
        self.assertLess(res["seconds"], 30, f"{what}: rank 0 waited {res['seconds']:.1f} s")
        self.assertEqual(self.committed(), [])
        self.assertIsNone(pacer.Checkpointer(self.root).latest())

    def test_a_rank_that_dies_during_the_save(self):
        results = self.ranks("die")
        self.assertEqual(results[1][0], 17)
        self.check_nothing_committed(results, "a dead rank")

    def test_a_rank_that_hangs_during_the_save(self):
        t0 = time.monotonic()
        results = self.ranks("hang")
        self.check_nothing_committed(results, "a hung rank")
        # Rank 0 gave up after the communicator's timeout (4 s), not after torch's default 30 min.
        self.assertLess(results[0][1]["seconds"], 20)
        self.assertLess(time.monotonic() - t0, 60)


MPI_RANK = r"""
import sys
import numpy as np
import pacer
ck = pacer.Checkpointer(sys.argv[1], keep_last=0)
assert ck.world_size == 2, ck.world_size
full = np.arange(40, dtype=np.float32).reshape(10, 4)
lo, hi = [(0, 6), (6, 10)][ck.rank]
ck.save(3, {"w": np.ones(5), "s": pacer.Shard(full[lo:hi], lo, (10, 4))}).wait()
"""


@unittest.skipIf(shutil.which("mpirun") is None or not pacer._pacer.built_with_mpi(), "no mpirun, or pacer without MPI")
class MpiRanks(unittest.TestCase):
    def test_mpirun_without_torch_distributed(self):
        with tempfile.TemporaryDirectory(prefix="pacer-mpi-") as tmp:
            root = os.path.join(tmp, "ckpt")
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       OMPI_MCA_plm="isolated", OMPI_MCA_btl_vader_single_copy_mechanism="none",
                       OMPI_MCA_rmaps_base_oversubscribe="1")
            r = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, "-c", MPI_RANK, root], env=env,
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            ck = pacer.Checkpointer(root)
            self.assertEqual(ck.open().world_size, 2)
            step, state, _ = ck.load()
            self.assertEqual(step, 3)
            self.assertEqual(state["s"].tolist(), np.arange(40, dtype=np.float32).reshape(10, 4).tolist())


if __name__ == "__main__":
    unittest.main()
