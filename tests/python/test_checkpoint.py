"""Tests of the pacer Python module: round trips, copy-on-save, tiers, retention, corruption and errors.

Run with the python the module was built for (Debian's, with numpy and torch):
    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_checkpoint
"""
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import warnings

import numpy as np

import pacer

try:
    import torch
except ImportError:  # the numpy tests still run
    torch = None

DATA_FILE = "rank-00000.bin"


def step_dir(root, step):
    return os.path.join(root, f"step-{step:012d}")


def committed_steps(root):
    """Steps that have a committed directory (a manifest) under root."""
    out = []
    for name in os.listdir(root):
        if name.startswith("step-") and os.path.exists(os.path.join(root, name, "MANIFEST.json")):
            out.append(int(name[len("step-"):]))
    return sorted(out)


def flip_byte(path, offset=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@contextlib.contextmanager
def captured_stderr(sink):
    """Collects what the native code writes to file descriptor 2 into sink[0]."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


def random_array(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


class CheckpointTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-py-")
        self.root = os.path.join(self.tmp.name, "persistent")
        self.rng = np.random.default_rng(1234)

    def tearDown(self):
        self.tmp.cleanup()

    def assertArrayIdentical(self, got, want, msg=None):
        self.assertIsInstance(got, np.ndarray, msg)
        self.assertEqual(got.dtype, want.dtype, msg)
        self.assertEqual(got.shape, want.shape, msg)
        # Bytes, not values: catches byte-order and NaN-payload changes too.
        self.assertEqual(got.tobytes(), want.tobytes(), msg)


class RoundTrip(CheckpointTestCase):
    DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64", "bool", "complex64", "complex128"]
    SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (4, 5), (2, 3, 4)]

    def test_numpy_dtypes_and_shapes(self):
        ck = pacer.Checkpointer(self.root)
        blobs = {f"{dt}/{'x'.join(map(str, shape)) or 'scalar'}": np.asarray(random_array(self.rng, dt, shape))
                 for dt in self.DTYPES for shape in self.SHAPES}
        ck.save(1, blobs).wait()
        step, got, meta = ck.load()
        self.assertEqual(step, 1)
        self.assertEqual(meta, {})
        self.assertEqual(set(got), set(blobs))
        for name, want in blobs.items():
            self.assertArrayIdentical(got[name], want, name)
        # The manifest records numpy's dtype names and the shapes.
        listed = {name: (dtype, shape, size) for name, dtype, shape, size in ck.open(1).blobs()}
        for name, want in blobs.items():
            self.assertEqual(listed[name], (want.dtype.name, list(want.shape), want.nbytes), name)

    def test_many_chunks_with_a_small_staging_budget(self):
        # 4 KiB chunks and a budget of two buffers: save() cycles the staging
        # buffers hundreds of times and the blob spans many checksum chunks.
        ck = pacer.Checkpointer(self.root, staging_bytes=8192, chunk_bytes=4096)
        big = random_array(self.rng, "float64", (1000, 131))  # 1,048,000 bytes: not a multiple of the chunk
        small = [random_array(self.rng, "int32", (n,)) for n in (1, 3, 1000, 1025)]
        blobs = {"big": big, **{f"small{i}": a for i, a in enumerate(small)}}
        ck.save(3, blobs).wait()
        _, got, _ = ck.load(3)
        for name, want in blobs.items():
            self.assertArrayIdentical(got[name], want, name)
        with open(os.path.join(step_dir(self.root, 3), "MANIFEST.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["chunk_bytes"], 4096)
        by_name = {b["name"]: b for b in manifest["blobs"]}
        self.assertEqual(len(by_name["big"]["chunks"]), math.ceil(big.nbytes / 4096))
        self.assertEqual(len(by_name["small0"]["chunks"]), 1)

    def test_a_large_load_faults_its_arrays_in_ahead_and_reads_the_same_bytes(self):
        # 72 MiB: load() runs its thread that faults the new arrays in ahead of the readers.
        state = {"a": random_array(self.rng, "float32", (16, 1 << 20)), "b": random_array(self.rng, "int64", (1 << 20,))}
        ck = pacer.Checkpointer(self.root, chunk_bytes=4 << 20, staging_bytes=16 << 20)
        ck.save(1, state).wait()
        got = ck.load(1).state
        for name, want in state.items():
            self.assertArrayIdentical(got[name], want, name)
        into = {k: np.zeros_like(v) for k, v in state.items()}
        ck.load(1, into=into)
        for name, want in state.items():
            self.assertArrayIdentical(into[name], want, name)
        keep = pacer.checkpoint._FAULTERS
        try:
            for faulters in (2, keep):  # several faulting threads (bench/ckpt_load.py compares them), then the default
                pacer.checkpoint._FAULTERS = faulters
                got = ck.load(1).state
                for name, want in state.items():
                    self.assertArrayIdentical(got[name], want, f"{name} with {faulters} faulting threads")
            # A checksum that fails while the faulting threads may still be ahead stops the load; nothing waits for ever.
            flip_byte(os.path.join(step_dir(self.root, 1), DATA_FILE), 40 << 20)
            for faulters in (2, keep):
                pacer.checkpoint._FAULTERS = faulters
                with captured_stderr([]), self.assertRaisesRegex(pacer.Error, "no valid checkpoint"):
                    ck.load(1)
        finally:
            pacer.checkpoint._FAULTERS = keep

    def test_overflow_takes_a_state_larger_than_the_staging_pool(self):
        # A pool of two 4 KiB buffers and a 256 KiB state: without overflow
        # save() waits for the writer; with it, the rest goes to ordinary
        # memory, within its bound, and nothing waits.
        state = {"w": random_array(self.rng, "float32", (64, 1024))}
        for overflow, waits in ((0, True), (1 << 20, False)):
            root = os.path.join(self.root, f"overflow-{overflow}")
            ck = pacer.Checkpointer(root, staging_bytes=8192, chunk_bytes=4096, overflow_bytes=overflow)
            ck.save(1, state).wait()
            s = ck.stats()
            self.assertEqual(s["pool_waits"] > 0, waits, s)
            self.assertLessEqual(s["overflow_bytes"], overflow)
            self.assertEqual(s["overflow_bytes"] > 0, overflow > 0, s)
            self.assertArrayIdentical(ck.load(1).state["w"], state["w"], "w")

    def test_reserve_makes_the_staging_pool_before_the_first_save(self):
        ck = pacer.Checkpointer(self.root, staging_bytes=64 << 10, chunk_bytes=4096)
        self.assertEqual(ck.stats()["staging_bytes"], 0)
        ck.reserve()
        deadline = time.monotonic() + 20
        while ck.stats()["staging_bytes"] < 64 << 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        self.assertEqual(ck.stats()["staging_bytes"], 64 << 10)
        state = {"w": random_array(self.rng, "float32", (8, 1024))}
        ck.save(1, state).wait()
        s = ck.stats()
        self.assertEqual((s["staging_bytes"], s["pool_waits"]), (64 << 10, 0), s)
        self.assertArrayIdentical(ck.load(1).state["w"], state["w"], "w")

    def test_lists_and_non_contiguous_views(self):
        ck = pacer.Checkpointer(self.root)
        base = random_array(self.rng, "float32", (6, 8))
        blobs = {"strided": base[::2, 1::3], "transposed": base.T, "fortran": np.asfortranarray(base)}
        ck.save(1, {**blobs, "list": [[1, 2, 3], [4, 5, 6]]}).wait()
        _, got, _ = ck.load(1)
        for name, value in blobs.items():
            self.assertArrayIdentical(got[name], np.ascontiguousarray(value), name)
        # A list is part of the state's structure, not an array: it comes back as the same list.
        self.assertEqual(got["list"], [[1, 2, 3], [4, 5, 6]])

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_cpu_tensors(self):
        g = torch.Generator().manual_seed(7)
        base = torch.randn(16, 24, generator=g)
        tensors = {
            "f32": torch.randn(33, 17, generator=g),
            "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
            "bf16_scalar": torch.tensor(1.5, dtype=torch.bfloat16),
            "i64": torch.randint(-2**62, 2**62, (100,), generator=g, dtype=torch.int64),
            "f16": torch.randn(9, generator=g).to(torch.float16),
            "bool": torch.rand(11, generator=g) > 0.5,
            "transposed": base.t(),
            "strided": base[1::3, ::5],
            "expanded": torch.arange(4.0).expand(3, 4),
            "with_grad": torch.ones(3, requires_grad=True) * 2,
        }
        self.assertFalse(tensors["transposed"].is_contiguous())
        self.assertFalse(tensors["strided"].is_contiguous())
        ck = pacer.Checkpointer(self.root)
        ck.save(1, tensors).wait()
        _, got, _ = ck.load(1)
        for name, t in tensors.items():
            t = t.detach().contiguous()
            # Tensors come back as CPU tensors of their dtype (numpy arrays come back as numpy arrays).
            self.assertIs(type(got[name]), torch.Tensor, name)
            self.assertEqual((got[name].dtype, tuple(got[name].shape)), (t.dtype, tuple(t.shape)), name)
            self.assertEqual(got[name].reshape(-1).view(torch.uint8).tolist(), t.reshape(-1).view(torch.uint8).tolist(),
                             name)
        dtypes = {name: dtype for name, dtype, _, _ in ck.open(1).blobs()}
        self.assertEqual(dtypes["bf16"], "bfloat16")
        self.assertEqual(dtypes["i64"], "int64")
        self.assertEqual(dtypes["bool"], "bool")

    def test_bytes(self):
        ck = pacer.Checkpointer(self.root)
        blobs = {"bytes": b"hello\x00world\xff", "bytearray": bytearray(range(256)) * 3, "empty": b"",
                 "memoryview": memoryview(np.arange(6, dtype=np.int16)).cast("B")}
        ck.save(1, blobs).wait()
        _, got, _ = ck.load(1)
        listed = {name: (dtype, shape) for name, dtype, shape, _ in ck.open(1).blobs()}
        for name, value in blobs.items():
            want = bytes(value)
            self.assertEqual(listed[name], ("bytes", [len(want)]), name)
            # bytes and bytearray keep their type; a memoryview comes back as bytes.
            self.assertIs(type(got[name]), bytearray if isinstance(value, bytearray) else bytes, name)
            self.assertEqual(bytes(got[name]), want, name)

    def test_meta_round_trip(self):
        ck = pacer.Checkpointer(self.root)
        meta = {"lr": 0.1, "epoch": 3, "name": "r\u00e9sum\u00e9 \u2713", "nested": {"a": [1, 2.5, None, True]},
                "empty": {}, "big": 2**62}
        ck.save(1, {"x": np.zeros(1)}, meta=meta).wait()
        ck.save(2, {"x": np.zeros(1)}).wait()  # no meta: an empty object
        self.assertEqual(ck.load(1)[2], meta)
        self.assertEqual(ck.load(2)[2], {})
        # The manifest's meta holds the user's keys and pacer's record of the state's structure.
        stored = json.loads(ck.open(1).meta_json)
        self.assertEqual(stored.pop("pacer")["schema"], "pacer.state/1")
        self.assertEqual(stored, meta)
        # A new Checkpointer on the same root reads the same.
        del ck
        self.assertEqual(pacer.Checkpointer(self.root).load(1)[2], meta)

    def test_empty_checkpoint_and_read_only_arrays(self):
        ck = pacer.Checkpointer(self.root)
        ck.save(1, {}).wait()
        self.assertEqual(ck.load(1)[:2], (1, {}))
        ro = np.frombuffer(b"\x01\x02\x03\x04" * 4, dtype=np.int32)
        self.assertFalse(ro.flags.writeable)
        ck.save(2, {"ro": ro}).wait()
        self.assertArrayIdentical(ck.load(2)[1]["ro"], ro.copy())

    def test_non_native_byte_order(self):
        # Non-native byte order is converted on save: the manifest's dtypes are little-endian.
        ck = pacer.Checkpointer(self.root)
        want = np.arange(1, 6, dtype=">i4")
        ck.save(1, {"be": want}).wait()
        got = ck.load(1)[1]["be"]
        self.assertEqual(got.tolist(), want.tolist())


class SaveSemantics(CheckpointTestCase):
    def test_wait_done_latest_and_load_by_step(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        self.assertIsNone(ck.latest())
        with self.assertRaisesRegex(pacer.Error, "no valid checkpoint"):
            ck.load()
        data = {}
        for step in (10, 20, 30):
            data[step] = random_array(self.rng, "float32", (64,))
            h = ck.save(step, {"w": data[step]}, meta={"step": step})
            self.assertEqual(h.step, step)
            h.wait()
            self.assertTrue(h.done())
            self.assertEqual(ck.latest(), step)
        self.assertEqual(committed_steps(self.root), [10, 20, 30])
        step, got, meta = ck.load()
        self.assertEqual((step, meta), (30, {"step": 30}))
        self.assertArrayIdentical(got["w"], data[30])
        for step in (10, 20, 30):
            s, got, meta = ck.load(step=step)
            self.assertEqual((s, meta), (step, {"step": step}))
            self.assertArrayIdentical(got["w"], data[step])
        with self.assertRaisesRegex(pacer.Error, "step 25"):
            ck.load(step=25)

    def test_modifying_the_array_after_save_returns(self):
        ck = pacer.Checkpointer(self.root, chunk_bytes=1 << 16)
        a = random_array(self.rng, "float64", (300_000,))  # several chunks
        want = a.copy()
        buf = bytearray(b"x" * 100_000)
        h = ck.save(1, {"a": a, "buf": buf})
        a[:] = -1.0  # straight away: the background writer may not have started
        buf[:] = b"y" * len(buf)
        del a
        h.wait()
        _, got, _ = ck.load(1)
        self.assertArrayIdentical(got["a"], want)
        self.assertEqual(got["buf"], bytearray(b"x" * 100_000))

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_modifying_a_tensor_after_save_returns(self):
        ck = pacer.Checkpointer(self.root)
        t = torch.arange(100_000, dtype=torch.float32)
        h = ck.save(1, {"t": t, "tt": t.view(100, 1000).t()})
        t.zero_()
        h.wait()
        _, got, _ = ck.load(1)
        want = np.arange(100_000, dtype=np.float32)
        self.assertArrayIdentical(got["t"].numpy(), want)
        self.assertArrayIdentical(got["tt"].numpy(), np.ascontiguousarray(want.reshape(100, 1000).T))

    def test_flush_and_destruction_finish_every_save(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        handles = [ck.save(s, {"x": np.full(1000, s, dtype=np.int64)}) for s in (1, 2, 3)]
        ck.flush()
        self.assertTrue(all(h.done() for h in handles))
        self.assertEqual(committed_steps(self.root), [1, 2, 3])
        ck.save(4, {"x": np.full(1000, 4, dtype=np.int64)})
        del ck  # waits for the save in flight
        ck = pacer.Checkpointer(self.root)
        self.assertEqual(ck.latest(), 4)
        self.assertEqual(ck.load()[1]["x"].tolist(), [4] * 1000)

    def test_reader(self):
        ck = pacer.Checkpointer(self.root)
        a = np.arange(10, dtype=np.int32)
        ck.save(5, {"a": a}, meta={"k": 1}).wait()
        r = ck.open()
        self.assertEqual(r.step, 5)
        self.assertEqual(r.dir, step_dir(self.root, 5))
        self.assertEqual(r.blobs(), [("a", "int32", [10], 40)])
        r.verify()
        part = np.empty(4, dtype=np.int32)
        r.read_into("a", part)  # a prefix of the blob
        self.assertEqual(part.tolist(), [0, 1, 2, 3])
        with self.assertRaisesRegex(pacer.Error, "no blob named 'b'"):
            r.read_into("b", part)
        with self.assertRaisesRegex(pacer.Error, "'a'"):
            r.read_into("a", np.empty(11, dtype=np.int32))  # more than the blob holds

    def test_leftovers_of_dead_savers_on_this_host_are_removed(self):
        os.makedirs(self.root)
        killed_prune = os.path.join(self.root, ".deleting-step-000000000003-12345")
        os.makedirs(killed_prune)
        host = socket.gethostname()
        dead = os.path.join(self.root, f".partial-step-000000000009-{host}-999999999-deadbeef")
        foreign = os.path.join(self.root, ".partial-step-000000000009-some-other-host-1-deadbeef")
        for d in (dead, foreign):
            os.makedirs(d)
            with open(os.path.join(d, DATA_FILE), "wb") as f:
                f.write(b"half")
        ck = pacer.Checkpointer(self.root)
        self.assertFalse(os.path.exists(dead))
        self.assertFalse(os.path.exists(killed_prune))
        self.assertTrue(os.path.exists(foreign))  # another host's saver may be alive
        self.assertIsNone(ck.latest())


class Retention(CheckpointTestCase):
    def save_steps(self, ck, steps):
        for s in steps:
            ck.save(s, {"x": np.array([s])}).wait()

    def test_keep_last(self):
        ck = pacer.Checkpointer(self.root, keep_last=2)
        self.save_steps(ck, [1, 2, 3, 4, 5])
        self.assertEqual(committed_steps(self.root), [4, 5])
        self.assertEqual([e for e in os.listdir(self.root) if not e.startswith("step-")], [])

    def test_keep_every(self):
        ck = pacer.Checkpointer(self.root, keep_last=2, keep_every=3)
        self.save_steps(ck, range(1, 8))
        self.assertEqual(committed_steps(self.root), [3, 6, 7])
        self.assertEqual(ck.load(3)[1]["x"].tolist(), [3])

    def test_keep_last_zero_keeps_all(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        self.save_steps(ck, [1, 2, 3, 4])
        self.assertEqual(committed_steps(self.root), [1, 2, 3, 4])


class FastTier(CheckpointTestCase):
    def setUp(self):
        super().setUp()
        self.fast = os.path.join(self.tmp.name, "fast")

    def test_both_tiers_and_fallback_to_persistent(self):
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast, chunk_bytes=4096)
        blobs = {"w": random_array(self.rng, "float32", (5000,)), "b": b"bias"}
        h = ck.save(5, blobs, meta={"tier": "test"})
        h.wait()  # committed on the fast tier
        self.assertEqual(committed_steps(self.fast), [5])
        h.wait_persistent()
        self.assertEqual(committed_steps(self.root), [5])
        for tier in (self.fast, self.root):
            with open(os.path.join(step_dir(tier, 5), DATA_FILE), "rb") as f:
                self.assertEqual(len(f.read()) > blobs["w"].nbytes, True)
        self.assertEqual(ck.open(5).dir, step_dir(self.fast, 5))  # fast tier first
        self.assertEqual(ck.open().dir, step_dir(self.fast, 5))
        step, got, meta = ck.load()
        self.assertEqual((step, meta), (5, {"tier": "test"}))
        self.assertArrayIdentical(got["w"], blobs["w"])

        flip_byte(os.path.join(step_dir(self.fast, 5), DATA_FILE), 12345)
        # load() checks as it reads, warns, and reads the persistent copy.
        with self.assertWarnsRegex(UserWarning, "skipping step 5") as w:
            step, got, meta = ck.load(step=5)
        self.assertIn(step_dir(self.fast, 5), str(w.warning))
        self.assertIn("checksum mismatch", str(w.warning))
        self.assertEqual((step, meta), (5, {"tier": "test"}))
        self.assertArrayIdentical(got["w"], blobs["w"])
        self.assertEqual(got["b"], b"bias")
        with self.assertWarnsRegex(UserWarning, "skipping step 5"):
            self.assertEqual(ck.load()[0], 5)
        # open() and latest() verify first; they warn on stderr.
        err = []
        with captured_stderr(err):
            reader = ck.open(5)
            latest = ck.latest()
        self.assertEqual(latest, 5)
        self.assertEqual(reader.dir, step_dir(self.root, 5))
        self.assertIn("skipping step 5", err[0])
        self.assertIn("checksum mismatch", err[0])
        self.assertIn(os.path.join(step_dir(self.fast, 5), DATA_FILE), err[0])

    def test_fast_tier_only_copy_loads_after_persistent_is_lost(self):
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast)
        ck.save(1, {"x": np.arange(5)}).wait_persistent()
        os.remove(os.path.join(step_dir(self.root, 1), DATA_FILE))
        err = []
        with captured_stderr(err):
            self.assertEqual(ck.load(1)[1]["x"].tolist(), list(range(5)))
            self.assertEqual(ck.open(1).dir, step_dir(self.fast, 1))
        self.assertIn("missing", err[0])

    def test_step_committed_on_the_persistent_tier_only_is_a_duplicate(self):
        # After the node-local tier is wiped, a step the persistent tier holds
        # must not be saved again with other data (two valid copies of one step).
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast)
        ck.save(5, {"x": np.arange(3)}).wait_persistent()
        del ck
        shutil.rmtree(self.fast)
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast)
        try:
            with self.assertRaisesRegex(pacer.Error, "already committed"):
                ck.save(5, {"x": np.zeros(3)})
        finally:
            with captured_stderr([]):
                del ck  # its failed flush warns

    def test_retention_on_both_tiers(self):
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast, keep_last=2)
        for s in range(1, 6):
            ck.save(s, {"x": np.array([s])}).wait_persistent()
            # Both tiers are trimmed by the time wait_persistent() returns.
            self.assertEqual(committed_steps(self.root), list(range(max(1, s - 1), s + 1)))
            self.assertEqual(committed_steps(self.fast), list(range(max(1, s - 1), s + 1)))
        self.assertEqual(committed_steps(self.root), [4, 5])
        self.assertEqual(committed_steps(self.fast), [4, 5])

    def test_steps_only_on_the_fast_tier_are_copied_on_open(self):
        # As after a job killed between the fast commit and the copy.
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast, keep_last=0)
        for s in (1, 2):
            ck.save(s, {"x": np.full(100, s)}).wait_persistent()
        del ck
        shutil.rmtree(step_dir(self.root, 1))
        shutil.rmtree(step_dir(self.root, 2))
        ck = pacer.Checkpointer(self.root, fast_tier=self.fast, keep_last=0)
        ck.flush()
        self.assertEqual(committed_steps(self.root), [1, 2])
        shutil.rmtree(self.fast)
        self.assertEqual(ck.load(1)[1]["x"].tolist(), [1] * 100)
        self.assertEqual(ck.open(2).dir, step_dir(self.root, 2))


class Corruption(CheckpointTestCase):
    def test_corrupt_newest_falls_back_to_older(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        old = random_array(self.rng, "int64", (1000,))
        ck.save(1, {"x": old}).wait()
        ck.save(2, {"x": random_array(self.rng, "int64", (1000,))}).wait()
        flip_byte(os.path.join(step_dir(self.root, 2), DATA_FILE), 100)
        err = []
        with captured_stderr(err):
            latest = ck.latest()
        self.assertEqual(latest, 1)
        self.assertIn("skipping step 2", err[0])
        self.assertIn("blob 'x'", err[0])
        with self.assertWarnsRegex(UserWarning, "skipping step 2"):
            step, got, _ = ck.load()
        self.assertEqual(step, 1)
        self.assertArrayIdentical(got["x"], old)
        # Asked for by number, the error says why.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.assertRaisesRegex(pacer.Error, "step 2") as cm:
                ck.load(step=2)
        self.assertIn("checksum mismatch", str(cm.exception))
        self.assertIn("blob 'x'", str(cm.exception))
        with captured_stderr([]):
            with self.assertRaisesRegex(pacer.Error, "step 2"):
                ck.open(2)
        ck.open(1).verify()  # still fine

    def test_checkpoint_renamed_to_another_step_is_not_that_step(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        ck.save(1, {"x": np.arange(3)}).wait()
        ck.save(2, {"x": np.arange(4)}).wait()
        os.rename(step_dir(self.root, 2), step_dir(self.root, 7))
        err = []
        with captured_stderr(err):
            self.assertEqual(ck.latest(), 1)
            with self.assertRaisesRegex(pacer.Error, "step 7"):
                ck.load(7)
        self.assertIn("manifest is for step 2", err[0])

    def test_torn_manifest_is_not_a_checkpoint(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        ck.save(1, {"x": np.arange(3)}).wait()
        ck.save(2, {"x": np.arange(4)}).wait()
        manifest = os.path.join(step_dir(self.root, 2), "MANIFEST.json")
        with open(manifest, "r+b") as f:
            f.truncate(os.path.getsize(manifest) // 2)
        err = []
        with captured_stderr(err):
            self.assertEqual(ck.latest(), 1)
        self.assertIn("step 2", err[0])

    def test_truncated_data_file(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        ck.save(1, {"x": np.arange(3)}).wait()
        ck.save(2, {"x": np.arange(10_000)}).wait()
        data = os.path.join(step_dir(self.root, 2), DATA_FILE)
        with open(data, "r+b") as f:
            f.truncate(100)
        err = []
        with captured_stderr(err):
            self.assertEqual(ck.load()[0], 1)
        self.assertIn("truncated", err[0])


class HugePageDestinations(CheckpointTestCase):
    def test_load_into_huge_page_destinations_reads_the_same_bytes(self):
        # The advice is off by default (slower on the 2-core VM); the path it takes must still load correctly.
        ck = pacer.Checkpointer(self.root)
        x = random_array(self.rng, "float32", (3 << 20,))  # 12 MiB: whole 2 MiB pages inside
        ck.save(1, {"x": x, "small": random_array(self.rng, "int64", (10,))}).wait()
        keep = pacer.checkpoint._LOAD_HUGE_PAGES
        pacer.checkpoint._LOAD_HUGE_PAGES = True
        try:
            got = ck.load(1).state
        finally:
            pacer.checkpoint._LOAD_HUGE_PAGES = keep
        np.testing.assert_array_equal(got["x"], x)
        self.assertEqual(got["small"].shape, (10,))
        self.assertFalse(pacer.checkpoint._advise_huge_pages(bytearray(4096)))  # no whole huge page: nothing advised


class PruneAndExport(CheckpointTestCase):
    def test_prune_keeps_the_newest_valid_step_behind_a_damaged_one(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        for s in (1, 2, 3):
            ck.save(s, {"x": random_array(self.rng, "int64", (1000,))}).wait()
        flip_byte(os.path.join(step_dir(self.root, 3), DATA_FILE), 100)
        # A save that a dead node left: step 2 is committed since, and it has not changed for two hours.
        stale = os.path.join(self.root, ".partial-step-000000000001-node-gone-7-0000beef")
        os.makedirs(stale)
        old = os.path.getmtime(stale) - 7200
        os.utime(stale, (old, old))
        with captured_stderr([]):
            r = pacer.prune(self.root, keep_last=1, dry_run=True)
        self.assertEqual([p for p, _ in r["removed_partial"]], [stale])
        self.assertIn("nothing in it changed", r["removed_partial"][0][1])
        self.assertTrue(os.path.isdir(stale))
        self.assertEqual(r["newest_valid"], 2)
        self.assertEqual(r["removed"], [1])
        self.assertEqual(r["kept"], [2])
        self.assertEqual([os.path.basename(p) for p, _ in r["damaged"]], [os.path.basename(step_dir(self.root, 3))])
        self.assertIn("checksum", r["damaged"][0][1])
        self.assertTrue(os.path.isdir(step_dir(self.root, 1)))  # a dry run removes nothing
        with captured_stderr([]):
            r = pacer.prune(self.root, keep_last=1)
        self.assertFalse(os.path.exists(step_dir(self.root, 1)))
        self.assertFalse(os.path.exists(stale))
        self.assertTrue(os.path.isdir(step_dir(self.root, 2)))
        self.assertTrue(os.path.isdir(step_dir(self.root, 3)))  # damaged: left for the user
        with captured_stderr([]):
            r = pacer.prune(self.root, keep_last=1, remove_damaged=True)
        self.assertFalse(os.path.exists(step_dir(self.root, 3)))
        self.assertEqual(ck.latest(), 2)
        with self.assertRaisesRegex(pacer.Error, "keep_last"):
            pacer.prune(self.root, keep_last=0)

    def test_export_safetensors_writes_the_model_tensors(self):
        ck = pacer.Checkpointer(self.root)
        w = random_array(self.rng, "float32", (3, 4))
        b = random_array(self.rng, "int64", (5,))
        ck.save(7, {"model": {"layer.w": w, "layer.b": b}, "optim": {"m": random_array(self.rng, "float32", (2,))}}).wait()
        out = os.path.join(self.tmp.name, "hf")
        r = pacer.export_safetensors(self.root, out)
        self.assertEqual(r["step"], 7)
        self.assertEqual(r["tensors"], 2)
        self.assertEqual(r["bytes"], w.nbytes + b.nbytes)
        self.assertEqual([os.path.basename(f) for f in r["files"]], ["model.safetensors"])
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            blob = f.read()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        data = blob[8 + n:]
        self.assertEqual(sorted(k for k in header if k != "__metadata__"), ["layer.b", "layer.w"])
        for name, arr, dt in (("layer.w", w, "F32"), ("layer.b", b, "I64")):
            h = header[name]
            self.assertEqual(h["dtype"], dt)
            self.assertEqual(h["shape"], list(arr.shape))
            lo, hi = h["data_offsets"]
            self.assertEqual(data[lo:hi], arr.tobytes())
        with self.assertRaisesRegex(pacer.Error, "step-000000000009: cannot open"):
            pacer.export_safetensors(self.root, out, step=9)


def _xxh3_64():
    """XXH3-64 from the system's libxxhash (what manifests check themselves with), or None."""
    import ctypes
    import ctypes.util
    for name in ("libxxhash.so.0", ctypes.util.find_library("xxhash")):
        if not name:
            continue
        try:
            f = ctypes.CDLL(name).XXH3_64bits
        except (OSError, AttributeError):
            continue
        f.restype = ctypes.c_uint64
        f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        return lambda b: f(b, len(b))
    return None


def craft_manifest(path, edit):
    """Applies edit(dict) to a manifest and checksums it anew: a crafted manifest that passes its self-check."""
    xxh3 = _xxh3_64()
    if xxh3 is None:
        raise unittest.SkipTest("libxxhash not found: cannot checksum a crafted manifest")

    def checksum(j):
        return f"{xxh3(json.dumps(j, sort_keys=True, separators=(',', ':'), ensure_ascii=False).encode()):016x}"

    with open(path) as f:
        j = json.load(f)
    want = j.pop("manifest_xxh3")
    if checksum(j) != want:
        raise unittest.SkipTest("this json module does not write the manifest's bytes as pacer does")
    edit(j)
    j["manifest_xxh3"] = checksum(j)
    os.remove(path)
    with open(path, "w") as f:
        json.dump(j, f)


def set_shape(node, blob, shape):
    """Sets the shape the stored state gives for `blob` (the tree in the meta)."""
    if isinstance(node, dict):
        if node.get("blob") == blob and "shape" in node:
            node["shape"] = shape
        for v in node.values():
            set_shape(v, blob, shape)
    elif isinstance(node, list):
        for v in node:
            set_shape(v, blob, shape)


class UntrustedInput(CheckpointTestCase):
    """Crafted checkpoints fall back to the older step; none hangs, crashes or allocates beyond the files."""

    def two_steps(self):
        ck = pacer.Checkpointer(self.root, keep_last=0)
        self.old = np.arange(1000, dtype=np.int64)
        ck.save(1, {"x": self.old}).wait()
        ck.save(2, {"x": np.arange(1000, dtype=np.int64) * 2}).wait()
        return ck, os.path.join(step_dir(self.root, 2), "MANIFEST.json")

    def assertFallsBack(self, ck, why):
        err = []
        with captured_stderr(err):
            step, got, _ = ck.load()
            latest = ck.latest()
            steps = ck.steps()
        self.assertEqual((step, latest, steps), (1, 1, [1]))
        self.assertArrayIdentical(got["x"], self.old)
        self.assertIn("skipping step 2", err[0])
        self.assertIn(why, err[0])

    def test_blob_of_two_to_the_62_bytes_is_not_allocated(self):
        ck, manifest = self.two_steps()

        def huge(j):
            j["chunk_bytes"] = 1 << 62
            for b in j["blobs"]:
                b["chunks"] = b["chunks"][:1]
                if b["name"] == "x":
                    b["size"] = 1 << 62
                    b["shape"] = [1 << 59]
            set_shape(j["meta"], "x", [1 << 59])

        craft_manifest(manifest, huge)
        self.assertFallsBack(ck, "outside its file")

    def test_blob_in_a_file_outside_the_step_is_refused(self):
        for name in ("/etc/passwd", "../" + os.path.basename(step_dir(self.root, 1)) + "/" + DATA_FILE):
            with self.subTest(name):
                shutil.rmtree(self.root, ignore_errors=True)
                ck, manifest = self.two_steps()
                size = os.path.getsize(os.path.join(step_dir(self.root, 2), name))

                def elsewhere(j):
                    j["files"] = [{"name": name, "size": size}]
                    for b in j["blobs"]:
                        b["file"] = name

                craft_manifest(manifest, elsewhere)
                self.assertFallsBack(ck, "not a plain name")

    def test_fifo_manifest_does_not_hang(self):
        ck, manifest = self.two_steps()
        os.remove(manifest)
        os.mkfifo(manifest)
        done, freed = threading.Event(), []

        def watchdog():  # frees a reader blocked opening the FIFO, and says so
            if done.wait(10):
                return
            while not done.is_set():
                try:
                    os.close(os.open(manifest, os.O_WRONLY | os.O_NONBLOCK))
                    freed.append(True)
                except OSError:
                    pass
                time.sleep(0.02)

        t = threading.Thread(target=watchdog)
        t.start()
        try:
            with captured_stderr([]):
                got = (ck.latest(), ck.steps())
        finally:
            done.set()
            t.join()
        self.assertFalse(freed, "latest() or steps() blocked opening a FIFO named MANIFEST.json")
        self.assertEqual(got, (1, [1]))

    def test_loads_from_a_read_only_mount(self):
        ck, _ = self.two_steps()
        del ck
        ro = os.path.join(self.tmp.name, "ro")
        os.mkdir(ro)
        mounted = subprocess.run(["mount", "--bind", self.root, ro], capture_output=True).returncode == 0
        if mounted and subprocess.run(["mount", "-o", "remount,bind,ro", ro], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", ro])
            mounted = False
        if not mounted:
            os.rmdir(ro)
            shutil.copytree(self.root, ro)
            for d, dirs, files in os.walk(ro):
                for n in files + dirs:
                    os.chmod(os.path.join(d, n), 0o555 if n in dirs else 0o444)
            os.chmod(ro, 0o555)
            if os.access(ro, os.W_OK):
                shutil.rmtree(ro, ignore_errors=True)
                self.skipTest("cannot bind-mount read-only, and write permission does not bind this user (root)")
        try:
            ck = pacer.Checkpointer(ro)
            self.assertEqual(ck.latest(), 2)
            self.assertEqual(ck.steps(), [2, 1])
            step, got, _ = ck.load(step=1)
            self.assertEqual(step, 1)
            self.assertArrayIdentical(got["x"], self.old)
            with self.assertRaisesRegex(pacer.Error, "not writable"):
                ck.save(3, {"x": self.old})
            del ck
        finally:
            if mounted:
                subprocess.run(["umount", ro]).returncode == 0 or subprocess.run(["umount", "-l", ro])
            else:
                for d, dirs, files in os.walk(ro):
                    os.chmod(d, 0o755)
                os.chmod(ro, 0o755)


class Errors(CheckpointTestCase):
    def test_duplicate_step(self):
        ck = pacer.Checkpointer(self.root)
        ck.save(1, {"x": np.arange(3)}).wait()
        with self.assertRaisesRegex(pacer.Error, "step 1 is already committed"):
            ck.save(1, {"x": np.arange(4)})
        self.assertEqual(ck.load(1)[1]["x"].tolist(), [0, 1, 2])

    def test_duplicate_step_while_the_first_is_in_flight(self):
        ck = pacer.Checkpointer(self.root)
        first = np.arange(200_000)
        h1 = ck.save(1, {"x": first})
        try:
            h2 = ck.save(1, {"x": np.zeros(3)})
        except pacer.Error as e:  # the first one had committed already
            self.assertIn("already committed", str(e))
        else:
            with self.assertRaisesRegex(pacer.Error, "already committed"):
                h2.wait()
        h1.wait()
        self.assertArrayIdentical(ck.load(1)[1]["x"], first)
        self.assertEqual([e for e in os.listdir(self.root) if not e.startswith("step-")], [])

    def test_unsupported_dtypes(self):
        ck = pacer.Checkpointer(self.root)
        for name, value, needle in [
            ("strings", np.array(["ab", "cd"]), "cannot be saved"),
            ("dates", np.array(["2024-01-01"], dtype="datetime64[D]"), "cannot be saved"),
            ("record", np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), "cannot be saved"),
        ]:
            with self.assertRaisesRegex(pacer.Error, needle, msg=name) as cm:
                ck.save(1, {name: value})
            self.assertIn(f"'{name}'", str(cm.exception))
        self.assertIsNone(ck.latest())
        self.assertEqual(os.listdir(self.root), [])

    def test_object_array_raises_pacer_error(self):
        # Object arrays have no bytes to save: a pacer.Error naming the blob.
        ck = pacer.Checkpointer(self.root)
        with self.assertRaisesRegex(pacer.Error, "'objs'"):
            ck.save(1, {"objs": np.array([object(), 1], dtype=object)})

    def test_bad_meta(self):
        ck = pacer.Checkpointer(self.root)
        with self.assertRaisesRegex(pacer.Error, "meta must be a JSON object"):
            ck.save(1, {"x": np.arange(3)}, meta=[1, 2])
        with self.assertRaisesRegex(pacer.Error, "meta cannot be stored as JSON"):
            ck.save(1, {"x": np.arange(3)}, meta={"f": object()})
        with self.assertRaisesRegex(pacer.Error, "meta cannot be stored as JSON"):
            ck.save(1, {"x": np.arange(3)}, meta={"loss": float("nan")})
        self.assertIsNone(ck.latest())

    def test_bad_options(self):
        with self.assertRaisesRegex(pacer.Error, "chunk_bytes"):
            pacer.Checkpointer(self.root, chunk_bytes=100)
        with self.assertRaisesRegex(pacer.Error, "negative"):
            pacer.Checkpointer(self.root, keep_last=-1)
        a_file = os.path.join(self.tmp.name, "file")
        with open(a_file, "w"):
            pass
        with self.assertRaisesRegex(pacer.Error, "file"):
            pacer.Checkpointer(a_file)

    def test_error_type(self):
        self.assertTrue(issubclass(pacer.Error, RuntimeError))


class OptimalInterval(unittest.TestCase):
    @staticmethod
    def daly(delta, m):
        if delta >= 2 * m:
            return m
        x = delta / (2 * m)
        return math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta

    def test_equals_dalys_formula(self):
        for delta, m in [(40, 8 * 3600), (1, 3600), (300, 86400), (5, 60), (0.5, 1e6)]:
            self.assertAlmostEqual(pacer.optimal_interval(delta, m), self.daly(delta, m), delta=1e-9 * self.daly(delta, m))
        # 40 s saves, 8 h MTBF: about 24.9 min, a little below Young's sqrt(2*40*28800) = 1517.9 s.
        v = pacer.optimal_interval(save_cost_s=40, mtbf_s=8 * 3600)
        self.assertAlmostEqual(v, 1491.34, places=2)
        self.assertLess(v, math.sqrt(2 * 40 * 8 * 3600))

    def test_monotonic_in_both_arguments(self):
        costs = [0.1 * 1.5**i for i in range(30)]  # 0.1 s .. ~19 h
        for m in (600.0, 3600.0, 8 * 3600.0, 7 * 86400.0):
            vals = [pacer.optimal_interval(d, m) for d in costs if d < 2 * m]
            self.assertEqual(vals, sorted(vals), f"mtbf {m}")
            self.assertTrue(all(v > 0 for v in vals))
        mtbfs = [60 * 1.5**i for i in range(30)]
        for d in (1.0, 40.0, 600.0):
            vals = [pacer.optimal_interval(d, m) for m in mtbfs if d < 2 * m]
            self.assertEqual(vals, sorted(vals), f"save cost {d}")

    def test_edges(self):
        self.assertEqual(pacer.optimal_interval(7200, 3600), 3600)  # save cost >= 2 x MTBF: the MTBF
        self.assertEqual(pacer.optimal_interval(0, 3600), 0)
        self.assertEqual(pacer.optimal_interval(40, 0), 0)


if __name__ == "__main__":
    unittest.main()
