"""Tests of pacer.data: datasets over tar shards and the deterministic, resumable loader.

Shards are written by `pacer shard pack` ($PACER_BIN) and by Python's tarfile.
Run with the python the module was built for (Debian's, with numpy):
    PYTHONPATH=BUILD/python PACER_BIN=BUILD/bin/pacer /usr/bin/python3 -m unittest -v test_data
"""
import bisect
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
import unittest

import numpy as np

import pacer
import pacer.data

PACER = os.environ.get("PACER_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/pacer"))
N = 103  # prime: batches never divide it evenly


def npy_bytes(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def sample(i):
    """The fields of sample i; every fifth one has no npy field."""
    fields = {"txt": f"sample {i}".encode(), "json": json.dumps({"i": i}).encode()}
    if i % 5:
        fields["npy"] = npy_bytes(np.arange(i % 7 + 1, dtype=np.float32) * i)
    return fields


def write_tree(root, n=N):
    expected = {}
    for i in range(n):
        key = f"g{i % 3}/s{i:04d}"
        expected[key] = sample(i)
        for ext, data in expected[key].items():
            path = os.path.join(root, f"{key}.{ext}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return expected


def keys_of(batches):
    return [k for b in batches for k in b["__key__"]]


class DataTestCase(unittest.TestCase):
    """Packs N samples once into several shards with the CLI."""

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(PACER):
            raise unittest.SkipTest(f"no pacer binary at {PACER} (set PACER_BIN)")
        cls.tmp = tempfile.TemporaryDirectory(prefix="pacer-data-py-")
        src = os.path.join(cls.tmp.name, "src")
        cls.out = os.path.join(cls.tmp.name, "shards")
        cls.expected = write_tree(src)
        r = subprocess.run([PACER, "shard", "pack", src, cls.out, "--target-size", "24KB", "--json"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise AssertionError(f"pacer shard pack failed:\n{r.stdout}{r.stderr}")
        cls.manifest = os.path.join(cls.out, "manifest.json")
        with open(cls.manifest) as f:
            cls.shard_list = json.load(f)["shards"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def open(self):
        return pacer.data.open(self.manifest)

    def loader(self, ds=None, **kw):
        return pacer.data.Loader(ds or self.open(), **kw)


class DatasetTest(DataTestCase):
    def test_len_shards_getitem(self):
        ds = self.open()
        self.assertGreater(len(self.shard_list), 3)
        self.assertEqual(len(ds), N)
        self.assertEqual(ds.shards, [os.path.join(self.out, s["path"]) for s in self.shard_list])
        self.assertEqual(ds.shard_samples, [s["samples"] for s in self.shard_list])
        self.assertEqual(ds.samples_per_shard, ds.shard_samples)
        # Pack writes samples in key order, so the dataset's order is the sorted keys.
        keys = sorted(self.expected)
        for i in [0, 1, 17, N - 1]:
            s = ds[i]
            self.assertEqual(s["__key__"], keys[i])
            want = self.expected[keys[i]]
            self.assertEqual(set(s), {"__key__", *want})
            for ext, data in want.items():
                self.assertIsInstance(s[ext], bytes)
                self.assertEqual(s[ext], data)
        self.assertEqual(ds[-1], ds[N - 1])
        self.assertEqual(ds[np.int64(3)]["__key__"], keys[3])
        with self.assertRaises(IndexError):
            ds[N]
        with self.assertRaises(IndexError):
            ds[-N - 1]
        self.assertEqual([s["__key__"] for s in ds], keys)
        self.assertIn(f"{N} samples", repr(ds))

    def test_specs(self):
        want = [s["__key__"] for s in self.open()]
        n = len(self.shard_list)
        for spec in [os.path.join(self.out, "train-*.tar"), os.path.join(self.out, f"train-{{000000..{n - 1:06d}}}.tar"),
                     [os.path.join(self.out, s["path"]) for s in self.shard_list]]:
            ds = pacer.data.open(spec)
            self.assertEqual([s["__key__"] for s in ds], want, spec)
        ds = pacer.data.open(os.path.join(self.out, "train-{000001,000000}.tar"))
        self.assertEqual(ds.shard_samples, [self.shard_list[1]["samples"], self.shard_list[0]["samples"]])

    def test_open_errors(self):
        self.assertIs(pacer.data.Error, pacer.Error)
        with self.assertRaises(pacer.Error) as cm:
            pacer.data.open(os.path.join(self.tmp.name, "missing.tar"))
        self.assertIn("missing.tar", str(cm.exception))
        with self.assertRaises(pacer.Error):
            pacer.data.open(os.path.join(self.tmp.name, "none-*.tar"))
        with self.assertRaises(pacer.Error):
            pacer.data.open(os.path.join(self.tmp.name, "missing.json"))
        with self.assertRaises(TypeError):
            pacer.data.Dataset(object())


class TarfileShardsTest(unittest.TestCase):
    """Shards from another writer: pax and GNU long names, no index until the first open."""

    def test_foreign_shards(self):
        with tempfile.TemporaryDirectory(prefix="pacer-data-tar-") as tmp:
            expected = {}
            long_dir = "p" * 90 + "/" + "q" * 90
            for s, fmt in enumerate([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]):
                with tarfile.open(os.path.join(tmp, f"w-{s}.tar"), "w", format=fmt) as t:
                    for i in range(10):
                        key = f"{long_dir}/k{s}{i:02d}" if fmt != tarfile.USTAR_FORMAT else f"k{s}{i:02d}"
                        expected[key] = {"cls": str(i).encode(), "npy": npy_bytes(np.full((2, 2), i, dtype=np.int16))}
                        for ext, data in expected[key].items():
                            info = tarfile.TarInfo(f"{key}.{ext}")
                            info.size = len(data)
                            t.addfile(info, io.BytesIO(data))
            ds = pacer.data.open(os.path.join(tmp, "w-{0..2}.tar"))
            self.assertEqual(len(ds), 30)
            self.assertEqual(ds.shard_samples, [10, 10, 10])
            for s in range(3):
                self.assertTrue(os.path.exists(os.path.join(tmp, f"w-{s}.tar.pidx")))
            self.assertEqual({ds[i]["__key__"]: {k: v for k, v in ds[i].items() if k != "__key__"} for i in range(30)}, expected)
            batches = list(pacer.data.Loader(ds, batch_size=4, seed=5))
            self.assertEqual(sorted(keys_of(batches)), sorted(expected))
            for b in batches:
                for key, arr in zip(b["__key__"], b["npy"]):
                    np.testing.assert_array_equal(arr, np.full((2, 2), int(expected[key]["cls"]), dtype=np.int16))
                    self.assertEqual(arr.dtype, np.int16)


def tar_header(name, size=0, typ=b"0", size_field=None):
    """One ustar header block; size_field overrides the 12 size bytes (e.g. GNU base-256)."""
    h = bytearray(512)
    h[0:len(name)] = name.encode()
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else f"{size:011o}\0".encode()
    h[136:148] = b"14000000000\0"
    h[156:157] = typ
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:155] = f"{sum(h):06o}\0".encode()
    return bytes(h)


def tar_member(name, data, typ=b"0"):
    return tar_header(name, len(data), typ) + data + b"\0" * (-len(data) % 512)


def pax_records(**records):
    out = b""
    for k, v in records.items():
        body = f" {k}={v}\n".encode()
        n = len(body) + 1
        while len(str(n)) + len(body) != n:
            n += 1
        out += str(n).encode() + body
    return out


class CraftedShardsTest(unittest.TestCase):
    """Untrusted shards and indexes: errors naming the shard, never a crash, a hang or wrong bytes."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-data-crafted-")

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()

    def write(self, name, data):
        with open(self.path(name), "wb") as f:
            f.write(data)
        return self.path(name)

    def open_in_child(self, spec):
        """pacer.data.open in a child process, so that a hang or a crash fails this test instead of ending the run."""
        code = ("import sys, pacer, pacer.data\n"
                "try:\n    pacer.data.open(sys.argv[1])\nexcept pacer.Error as e:\n    print('pacer.Error:', e)\n")
        return subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, timeout=60)

    def test_sizes_that_wrap_are_errors(self):
        huge = b"\x80" + b"\0" * 3 + b"\xff" * 6 + b"\xfe\x00"  # 2^64 - 512 in GNU base-256
        cases = {
            "b256.tar": tar_member("a.txt", b"A") + tar_header("big.bin", size_field=huge) + b"\0" * 1024,
            "pax.tar": tar_member("PaxHeaders/x.bin", pax_records(size=2**64 - 512), b"x") + tar_member("x.bin", b"data") + b"\0" * 1024,
            "long.tar": tar_header("././@LongLink", typ=b"L", size_field=b"\x80" + b"\0" * 3 + b"\xff" * 8) + b"\0" * 1024,
        }
        for name, data in cases.items():
            shard = self.write(name, data)
            r = self.open_in_child(shard)
            self.assertEqual(r.returncode, 0, f"{name}: {r.stdout}{r.stderr}")
            self.assertIn("pacer.Error:", r.stdout, name)
            self.assertIn(shard, r.stdout, name)

    def test_duplicate_fields_and_sparse_members_name_shard_and_key(self):
        dup = self.write("dup.tar", tar_member("k1.txt", b"a") + tar_member("k2.txt", b"b") + tar_member("k2.txt", b"c") + b"\0" * 1024)
        with self.assertRaisesRegex(pacer.Error, "dup.tar.*'k2' has field 'txt' twice"):
            pacer.data.open(dup)
        sparse = self.write("sparse.tar", tar_member("k1.txt", b"a") + tar_member("k2.bin", b"b", b"S") + b"\0" * 1024)
        with self.assertRaisesRegex(pacer.Error, "sparse.tar.*'k2.bin'.*sparse"):
            pacer.data.open(sparse)
        bad_pax = self.write("badpax.tar", tar_member("PaxHeaders/k.txt", b"zz path=k.txt\n", b"x") + tar_member("k.txt", b"a") + b"\0" * 1024)
        with self.assertRaisesRegex(pacer.Error, "badpax.tar.*pax"):
            pacer.data.open(bad_pax)

    def test_brace_bombs_are_usage_errors(self):
        t0 = time.monotonic()
        with self.assertRaisesRegex(pacer.Error, "64 bits"):
            pacer.data.open(self.path("x-{0..18446744073709551615}.tar"))
        with self.assertRaisesRegex(pacer.Error, "more than 1000000 names"):
            pacer.data.open(self.path("x-{0..9999}{0..9999}.tar"))
        self.assertLess(time.monotonic() - t0, 10)

    def make_shard(self):
        data = b""
        expected = []
        for i in range(3):
            key = f"k{i}"
            fields = {"txt": f"text {i}".encode() * (i + 1), "cls": str(i).encode()}
            for ext, v in fields.items():
                data += tar_member(f"{key}.{ext}", v)
            expected.append((key, fields))
        return self.write("s.tar", data + b"\0" * 1024), expected

    def assert_reads(self, shard, expected, copy):
        loader = pacer.data.Loader(pacer.data.open(shard), batch_size=3, shuffle=False, copy=copy, decode=False)
        (batch,) = list(loader)
        self.assertEqual(batch["__key__"], [k for k, _ in expected])
        for ext in ("txt", "cls"):
            self.assertEqual([bytes(v) for v in batch[ext]], [f[ext] for _, f in expected])

    def test_crafted_and_flipped_indexes_never_return_wrong_bytes(self):
        shard, expected = self.make_shard()
        self.assert_reads(shard, expected, True)
        good = self.read("s.tar.pidx")
        # Sample 0, field 0: 96-byte header, u16 key length, "k0", u16 field count, u16 ext length, "txt", u64 offset, u64 size.
        at = 96 + 2 + 2 + 2 + 2 + 3
        import struct
        for offset, size in [(2**64 - 16, 32), (512, 2**64 - 100), (os.path.getsize(shard) - 2, 8)]:
            for copy in (True, False):
                crafted = bytearray(good)
                crafted[at:at + 16] = struct.pack("<QQ", offset, size)
                self.write("s.tar.pidx", bytes(crafted))
                self.assert_reads(shard, expected, copy)
        for bit in range(0, len(good) * 8, 23):  # each rebuild fsyncs
            crafted = bytearray(good)
            crafted[bit // 8] ^= 1 << (bit % 8)
            self.write("s.tar.pidx", bytes(crafted))
            self.assert_reads(shard, expected, bit % 2 == 0)
            # Rebuilt: the same bytes but for when the shard's headers were hashed (and the header checksum).
            rebuilt = self.read("s.tar.pidx")
            self.assertEqual(rebuilt[:72] + rebuilt[80:88] + rebuilt[96:], good[:72] + good[80:88] + good[96:],
                             f"bit {bit}: the index was not rebuilt")

    def test_same_size_rewrite_is_detected(self):
        shard, _ = self.make_shard()
        pacer.data.open(shard)
        st = os.stat(shard)
        size = st.st_size
        data = b""
        for i in range(3):
            data += tar_member(f"new{i}.txt", f"TEXT {i}".encode() * (i + 1)) + tar_member(f"new{i}.cls", str(9 - i).encode())
        data += b"\0" * (size - len(data))
        self.write("s.tar", data)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the headers differ
        ds = pacer.data.open(shard)
        self.assertEqual([ds[i]["__key__"] for i in range(len(ds))], ["new0", "new1", "new2"])
        self.assertEqual(ds[2]["txt"], b"TEXT 2" * 3)


class LoaderTest(DataTestCase):
    def test_one_epoch_covers_every_key_once(self):
        loader = self.loader(batch_size=7, seed=3)
        self.assertEqual(len(loader), math.ceil(N / 7))
        batches = list(loader)
        self.assertEqual(len(batches), len(loader))
        self.assertEqual([len(b["__key__"]) for b in batches], [7] * (N // 7) + [N % 7])
        keys = keys_of(batches)
        self.assertEqual(len(keys), N)
        self.assertEqual(sorted(keys), sorted(self.expected))
        self.assertNotEqual(keys, sorted(keys))  # shuffled
        for b in batches:
            self.assertEqual(set(b), {"__key__", "txt", "json", "npy"})
            for ext in ["txt", "json", "npy"]:
                self.assertEqual(len(b[ext]), len(b["__key__"]))  # lists line up with the keys
            for j, key in enumerate(b["__key__"]):
                want = self.expected[key]
                self.assertEqual(b["txt"][j], want["txt"])
                self.assertIsInstance(b["json"][j], memoryview)  # a view into the batch's buffer, not a copy
                self.assertTrue(b["json"][j].readonly)
                self.assertEqual(json.loads(bytes(b["json"][j])), json.loads(want["json"]))
                if "npy" not in want:
                    self.assertIsNone(b["npy"][j])

    def test_no_shuffle_and_drop_last(self):
        loader = self.loader(batch_size=10, shuffle=False, drop_last=True)
        self.assertEqual(len(loader), N // 10)
        batches = list(loader)
        self.assertEqual([len(b["__key__"]) for b in batches], [10] * (N // 10))
        self.assertEqual(keys_of(batches), sorted(self.expected)[: N // 10 * 10])

    def test_two_ranks_cover_every_key_once(self):
        ds = self.open()
        for drop_last in (False, True):
            ranks = [self.loader(ds, batch_size=5, seed=11, rank=r, world_size=2, drop_last=drop_last) for r in range(2)]
            self.assertEqual(len(ranks[0]), len(ranks[1]))
            per_rank = [list(r) for r in ranks]
            self.assertEqual(len(per_rank[0]), len(ranks[0]))
            self.assertEqual(len(per_rank[1]), len(ranks[1]))
            k0, k1 = keys_of(per_rank[0]), keys_of(per_rank[1])
            self.assertFalse(set(k0) & set(k1))
            self.assertEqual(len(set(k0)), len(k0))
            self.assertEqual(len(set(k1)), len(k1))
            if drop_last:
                self.assertEqual(len(k0) + len(k1), N // 10 * 10)
            else:
                self.assertEqual(sorted(k0 + k1), sorted(self.expected))
            # Global batch g is rank 0's batch g followed by rank 1's: the single-rank order.
            single = keys_of(self.loader(ds, batch_size=10, seed=11, drop_last=drop_last))
            merged = [k for b0, b1 in zip(per_rank[0], per_rank[1]) for k in b0["__key__"] + b1["__key__"]]
            self.assertEqual(merged, single)

    def test_state_dict_resume(self):
        ds = self.open()
        whole = self.loader(ds, batch_size=6, seed=7)
        uninterrupted = [b["__key__"] for _ in range(2) for b in whole]  # two epochs
        per_epoch = len(whole)
        for stop in [0, 1, 5, per_epoch - 1, per_epoch, per_epoch + 3]:
            first = self.loader(ds, batch_size=6, seed=7)
            got = []
            it = iter(first)
            for _ in range(stop):
                try:
                    got.append(next(it)["__key__"])
                except StopIteration:  # the end of epoch 0: the next loop reads epoch 1
                    it = iter(first)
                    got.append(next(it)["__key__"])
            state = json.loads(json.dumps(first.state_dict()))  # plain JSON data
            self.assertEqual(state["schema"], "pacer.loader/1")
            self.assertEqual(state["seed"], 7)
            del first, it
            second = self.loader(ds, batch_size=6, seed=999)  # the state brings its seed
            second.load_state_dict(state)
            while len(got) < len(uninterrupted):
                before = len(got)
                got += [b["__key__"] for b in second]
                self.assertGreater(len(got), before)
            self.assertEqual(got, uninterrupted, f"resumed after {stop} batches")

    def test_resume_with_another_world_size(self):
        ds = self.open()
        one = self.loader(ds, batch_size=8, seed=2)
        it = iter(one)
        for _ in range(3):
            next(it)
        state = one.state_dict()
        rest_single = keys_of(it)
        ranks = []
        for r in range(2):
            loader = self.loader(ds, batch_size=4, seed=2, rank=r, world_size=2)
            loader.load_state_dict(state)
            ranks.append(list(loader))
        merged = [k for b0, b1 in zip(*ranks) for k in b0["__key__"] + b1["__key__"]]
        self.assertEqual(merged, rest_single)

    def test_state_at_the_end_of_an_epoch(self):
        ds = self.open()
        a = self.loader(ds, batch_size=10, seed=4)
        list(a)
        state = a.state_dict()
        self.assertEqual((state["epoch"], state["position"]), (0, N))
        epoch1 = keys_of(a)
        b = self.loader(ds, batch_size=10, seed=4)
        b.load_state_dict(state)
        self.assertEqual(keys_of(b), epoch1)  # the first loop after loading reads epoch 1
        self.assertEqual(b.epoch, 1)

    def test_next_epoch_differs_in_order(self):
        ds = self.open()
        loader = self.loader(ds, batch_size=16, seed=1)
        e0 = keys_of(loader)
        self.assertEqual(loader.epoch, 0)
        e1 = keys_of(loader)  # a new loop: the next epoch
        self.assertEqual(loader.epoch, 1)
        self.assertNotEqual(e0, e1)
        self.assertEqual(sorted(e0), sorted(e1))
        # Deterministic: (seed, epoch) gives the order.
        self.assertEqual(keys_of(self.loader(ds, batch_size=16, seed=1)), e0)
        other = self.loader(ds, batch_size=16, seed=2)
        self.assertNotEqual(keys_of(other), e0)
        loader.set_epoch(1)
        self.assertEqual(keys_of(loader), e1)
        loader.set_epoch(0)
        self.assertEqual(keys_of(loader), e0)
        # A loop left early continues where it stopped.
        loader.set_epoch(0)
        for i, b in enumerate(loader):
            if i == 2:
                break
        self.assertEqual(keys_of(loader), e0[3 * 16:])

    def test_npy_decoding(self):
        batches = list(self.loader(batch_size=9, seed=0))
        seen = 0
        for b in batches:
            for key, arr in zip(b["__key__"], b["npy"]):
                i = int(key.rsplit("s", 1)[1])
                if i % 5 == 0:
                    self.assertIsNone(arr)
                    continue
                self.assertIsInstance(arr, np.ndarray)
                self.assertEqual(arr.dtype, np.float32)
                np.testing.assert_array_equal(arr, np.arange(i % 7 + 1, dtype=np.float32) * i)
                seen += 1
        self.assertEqual(seen, sum(1 for i in range(N) if i % 5))
        raw = next(iter(self.loader(batch_size=9, seed=0, decode=False)))
        self.assertTrue(all(v is None or isinstance(v, memoryview) for v in raw["npy"]))

    def test_copy_gives_bytes_equal_to_the_views(self):
        views = list(self.loader(batch_size=8, seed=2, decode=False))
        copies = list(self.loader(batch_size=8, seed=2, decode=False, copy=True))
        self.assertEqual([b["__key__"] for b in views], [b["__key__"] for b in copies])
        for v, c in zip(views, copies):
            for ext in ["txt", "json", "npy"]:
                for a, b in zip(v[ext], c[ext]):
                    self.assertTrue(b is None or isinstance(b, bytes))
                    self.assertEqual(a, b)

    def test_views_outlive_the_loader_and_buffers_are_reused_safely(self):
        # Views keep their batch's buffer alive: held batches stay intact while
        # the loader (and its reader threads) go on reading into other buffers.
        loader = self.loader(batch_size=3, seed=1, threads=2, prefetch=2, decode=False)
        held = list(loader)
        del loader
        for b in held:
            for j, key in enumerate(b["__key__"]):
                self.assertEqual(b["txt"][j], self.expected[key]["txt"])

    def test_stats(self):
        loader = self.loader(batch_size=10, seed=0, threads=3, prefetch=2)
        s = loader.stats()
        self.assertEqual(set(s), {"wait_s", "last_wait_s", "batches", "samples", "bytes", "skipped", "queue_depth", "consumer_reads", "elapsed_s",
                                  "tokens", "padding", "truncated", "padding_fraction"})
        self.assertEqual((s["batches"], s["samples"], s["bytes"]), (0, 0, 0))
        batches = list(loader)
        s = loader.stats()
        self.assertEqual(s["batches"], len(batches))
        self.assertEqual(s["samples"], N)
        self.assertEqual(s["bytes"], sum(len(d) for f in self.expected.values() for d in f.values()))
        self.assertEqual(s["skipped"], 0)
        self.assertGreaterEqual(s["wait_s"], s["last_wait_s"])
        self.assertGreaterEqual(s["last_wait_s"], 0)
        self.assertGreater(s["elapsed_s"], 0)
        self.assertIsInstance(s["queue_depth"], int)
        self.assertLessEqual(s["queue_depth"], 2)
        self.assertLessEqual(s["consumer_reads"], s["batches"])

    def test_next_releases_the_gil(self):
        # Another Python thread runs while next() waits for the reader threads:
        # it records times, and some fall inside next() calls. (Were the GIL
        # held throughout next(), none could.)
        loader = self.loader(batch_size=N, seed=0, threads=1, prefetch=1)
        ticks = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0)

        # On a loaded machine the other thread may get no CPU during a short
        # next(): up to 500 calls, until one has a tick inside. A next() that
        # held the GIL would have none however many calls ran.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        t = threading.Thread(target=spin)
        t.start()
        inside = 0
        try:
            for _ in range(500):
                loader.set_epoch(0)  # drops the read-ahead: next() has to wait for the reads
                a = time.perf_counter()
                batch, _ = loader._impl.next()
                b = time.perf_counter()
                self.assertEqual(len(batch["__key__"]), N)
                inside += bisect.bisect_left(ticks, b) - bisect.bisect_right(ticks, a)
                if inside > 0:
                    break
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(interval)
        self.assertGreater(inside, 0)

    def test_loader_errors(self):
        ds = self.open()
        with self.assertRaises(pacer.Error):
            pacer.data.Loader(ds, batch_size=0)
        with self.assertRaises(pacer.Error):
            pacer.data.Loader(ds, rank=2, world_size=2)
        loader = pacer.data.Loader(ds, batch_size=4)
        with self.assertRaises(pacer.Error):
            loader.load_state_dict({"schema": "something/1"})
        state = loader.state_dict()
        with self.assertRaises(pacer.Error):
            loader.load_state_dict(dict(state, samples=N + 1))  # another dataset
        with self.assertRaises(pacer.Error):
            loader.load_state_dict(dict(state, position=N + 1))
        self.assertEqual(len(keys_of(loader)), N)  # still usable

    def test_skip_bad(self):
        with tempfile.TemporaryDirectory(prefix="pacer-data-bad-") as tmp:
            src = os.path.join(tmp, "src")
            write_tree(src, n=40)
            out = os.path.join(tmp, "out")
            r = subprocess.run([PACER, "shard", "pack", src, out, "--target-size", "24KB"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            ds = pacer.data.open(os.path.join(out, "manifest.json"))
            self.assertGreater(len(ds.shards), 1)
            lost = ds.shard_samples[1]
            with open(ds.shards[1], "r+b") as f:  # the shard no longer matches its index
                f.truncate(1024)
            with self.assertRaises(pacer.Error) as cm:
                list(pacer.data.Loader(ds, batch_size=4, seed=0, shuffle=False))
            self.assertIn(ds.shards[1], str(cm.exception))
            loader = pacer.data.Loader(ds, batch_size=4, seed=0, skip_bad=True)
            keys = keys_of(loader)
            self.assertEqual(len(keys), 40 - lost)
            self.assertEqual(loader.stats()["skipped"], lost)

    def test_shard_truncated_while_mapped_is_an_error_not_a_crash(self):
        # Shards are read through a mapping: a shard cut while a loader reads
        # it would raise SIGBUS; it must be an error naming the shard, and the
        # samples it kept still read. In a child process (also with
        # faulthandler on, as pytest and `python -X faulthandler` run), so a
        # crash fails this test instead of ending the run.
        with tempfile.TemporaryDirectory(prefix="pacer-data-cut-") as tmp:
            src = os.path.join(tmp, "src")
            write_tree(src, n=40)
            child = textwrap.dedent("""
                import faulthandler, os, sys
                import pacer, pacer.data
                ds = pacer.data.open(sys.argv[1])
                loader = pacer.data.Loader(ds, batch_size=2, seed=0, shuffle=False, prefetch=1, threads=1)
                it = iter(loader)
                next(it)  # shard 0 is mapped now
                if sys.argv[2] == "faulthandler":
                    # After pacer's handler: it prints a dump, then pacer's handler runs. Only
                    # this thread's: walking the reader threads' frames from a signal handler
                    # while they run crashed faulthandler itself (SIGSEGV) about 1 run in 20.
                    faulthandler.enable(all_threads=False)
                os.truncate(ds.shards[0], 4096 * 2 + 100)
                try:
                    for _ in it:
                        pass
                    print("no error")
                except pacer.Error as e:
                    print("error:", e)
                print("after:", bytes(ds[0]["__key__"], "ascii") != b"")
                skipped = pacer.data.Loader(ds, batch_size=2, seed=0, shuffle=False, skip_bad=True)
                n = sum(len(b["__key__"]) for b in skipped)
                print("read", n, "skipped", skipped.stats()["skipped"], "of", len(ds))
            """)
            for mode in ("plain", "faulthandler"):
                out = os.path.join(tmp, mode)
                r = subprocess.run([PACER, "shard", "pack", src, out, "--target-size", "24KB"], capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stderr)
                r = subprocess.run([sys.executable, "-c", child, os.path.join(out, "manifest.json"), mode],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, f"{mode}: {r.returncode} {r.stdout} {r.stderr}")
                self.assertIn("error:", r.stdout, r.stdout)
                self.assertIn("truncated", r.stdout)
                self.assertIn("train-000000.tar", r.stdout)
                self.assertIn("after: True", r.stdout)
                m = re.search(r"read (\d+) skipped (\d+) of (\d+)", r.stdout)
                self.assertIsNotNone(m, r.stdout)
                read, skipped, total = map(int, m.groups())
                self.assertEqual(read + skipped, total)
                self.assertGreater(skipped, 0)
                self.assertGreater(read, 0)

    def test_a_sigbus_outside_pacer_still_ends_the_process(self):
        # pacer's SIGBUS handler only catches its own guarded copies: a fault
        # elsewhere (here a plain Python mmap of a truncated file) still ends
        # the process with SIGBUS, also with faulthandler installed between
        # two of pacer's installations (each chaining to the other), and
        # without looping.
        with tempfile.TemporaryDirectory(prefix="pacer-data-bus-") as tmp:
            src = os.path.join(tmp, "src")
            write_tree(src, n=20)
            for i in (0, 1):
                r = subprocess.run([PACER, "shard", "pack", src, os.path.join(tmp, f"out{i}")], capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stderr)
            child = textwrap.dedent("""
                import faulthandler, mmap, os, sys
                import pacer.data
                a = pacer.data.open(os.path.join(sys.argv[1], "out0", "manifest.json"))
                a[0]
                faulthandler.enable()
                b = pacer.data.open(os.path.join(sys.argv[1], "out1", "manifest.json"))
                b[0]
                path = os.path.join(sys.argv[1], "victim")
                with open(path, "wb") as f:
                    f.write(b"x" * 3 * 4096)
                f = open(path, "rb")
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                os.truncate(path, 0)
                print(m[2 * 4096])
            """)
            # Under the sanitized tree ASan would catch the SIGBUS itself and
            # abort: let the default action happen there too.
            env = dict(os.environ)
            env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "handle_sigbus=0"]))
            r = subprocess.run([sys.executable, "-c", child, tmp], capture_output=True, text=True, timeout=60, env=env)
            self.assertEqual(r.returncode, -signal.SIGBUS, r.stdout + r.stderr)


class TokenData(unittest.TestCase):
    """Megatron-Core .bin/.idx through pacer.data.open(prefix)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-tokens-")
        self.prefix = os.path.join(self.tmp.name, "corpus_text_document")

    def tearDown(self):
        self.tmp.cleanup()

    def write_by_hand(self, seqs, docs, dtype=np.uint16, code=8):
        # The MMIDIDX layout, written here with struct and numpy, not by pacer.
        import struct
        arrays = [np.asarray(s, dtype=dtype) for s in seqs]
        with open(self.prefix + ".bin", "wb") as f:
            for a in arrays:
                f.write(a.tobytes())
        lengths = np.array([len(a) for a in arrays], dtype=np.int32)
        pointers = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])[:-1]]).astype(np.int64)
        with open(self.prefix + ".idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
            f.write(struct.pack("<Q", len(arrays)) + struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes() + pointers.tobytes() + np.asarray(docs, dtype=np.int64).tobytes())

    def test_open_reads_megatron_layout(self):
        seqs = [[5, 6, 7], [65535], [1, 2, 3, 4]]
        self.write_by_hand(seqs, [0, 1, 3])
        ds = pacer.data.open(self.prefix)
        self.assertIsInstance(ds, pacer.data.TokenDataset)
        self.assertEqual((len(ds), ds.documents, ds.tokens, ds.dtype), (3, 2, 8, "uint16"))
        for i, s in enumerate(seqs):
            np.testing.assert_array_equal(ds[i], np.array(s, dtype=np.uint16))
        self.assertEqual(ds.document(1), (1, 3))
        self.assertFalse(ds[0].flags.writeable)

    def test_writer_round_trip_and_errors(self):
        docs = [[1, 2, 3], [], [100000, 4]]
        pacer.data.write_tokens(self.prefix, docs, dtype="int32")
        ds = pacer.data.open(self.prefix)
        self.assertEqual([list(ds[i]) for i in range(len(ds))], docs)
        with self.assertRaisesRegex(pacer.Error, "100000"):
            pacer.data.write_tokens(self.prefix + "-small", docs, dtype="uint16")
        with open(self.prefix + ".idx", "r+b") as f:
            f.write(b"NOTANIDX")
        with self.assertRaisesRegex(pacer.Error, "MMIDIDX"):
            pacer.data.open(self.prefix)

    def test_corrupt_indexes_are_errors_naming_the_file(self):
        import struct
        seqs = [[5, 6, 7], [9], [1, 2, 3, 4]]
        self.write_by_hand(seqs, [0, 1, 3])
        good = open(self.prefix + ".idx", "rb").read()
        header = 9 + 8 + 1 + 8 + 8
        pointers = header + 3 * 4
        docs = pointers + 3 * 8
        cases = {
            # a pointer between two uint16 elements: every token would be read shifted
            "not on a 2-byte uint16 element": good[:pointers + 8] + struct.pack("<q", 7) + good[pointers + 16:],
            # documents that leave the first or last sequence out of every epoch
            "do not span the 3 sequences": good[:docs] + struct.pack("<qqq", 1, 1, 3),
            "do not span": good[:docs] + struct.pack("<qqq", 0, 1, 2),
            # a sequence count whose byte count would wrap
            "cannot fit": good[:9 + 8 + 1] + struct.pack("<Q", (1 << 62) + 2) + good[9 + 8 + 1 + 8:],
        }
        for why, data in cases.items():
            with open(self.prefix + ".idx", "wb") as f:
                f.write(data)
            with self.assertRaisesRegex(pacer.Error, f"{self.prefix}.idx: .*{why}", msg=why):
                pacer.data.open(self.prefix)
        # Bytes after the document index are allowed (Megatron's multimodal modes live there).
        with open(self.prefix + ".idx", "wb") as f:
            f.write(good + b"\x00\x00\x00")
        self.assertEqual(pacer.data.open(self.prefix).documents, 2)

    def test_document_out_of_range_is_an_index_error(self):
        self.write_by_hand([[5, 6, 7], [9]], [0, 1, 2])
        ds = pacer.data.open(self.prefix)
        self.assertEqual(ds.document(-1), (1, 2))
        with self.assertRaisesRegex(IndexError, "document 2 of a 2-document dataset"):
            ds.document(2)


class TokenLoaderTest(unittest.TestCase):
    """Megatron token data through pacer.data.Loader: packed rows with document boundaries, for torch."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-token-loader-")
        self.prefix = os.path.join(self.tmp.name, "docs")
        # Token t of document d is 1000*d + t + 1: every token names its document and place.
        self.docs = [[1000 * d + t + 1 for t in range(1 + (d * 37 + 11) % 50)] for d in range(120)]
        pacer.data.write_tokens(self.prefix, self.docs, dtype="int32")

    def tearDown(self):
        self.tmp.cleanup()

    def check_batch(self, b, seq_len):
        tokens, pos, cu, docs = b["tokens"], b["position_ids"], b["cu_seqlens"], b["documents"]
        self.assertEqual((tokens.dtype, pos.dtype, cu.dtype, docs.dtype), (np.int64, np.int32, np.int32, np.int64))
        self.assertEqual(tokens.shape[1], seq_len)
        self.assertEqual(tokens.shape, pos.shape)
        self.assertEqual((cu[0], cu[-1], len(cu)), (0, tokens.size, len(docs) + 1))
        flat, flat_pos = tokens.reshape(-1), pos.reshape(-1)
        real = []
        for k, d in enumerate(docs):
            seg = flat[cu[k]:cu[k + 1]]
            np.testing.assert_array_equal(flat_pos[cu[k]:cu[k + 1]], np.arange(len(seg)))
            if d < 0:
                self.assertTrue((seg == 0).all())
            else:
                self.assertTrue(((seg - 1) // 1000 == d).all())
                np.testing.assert_array_equal(np.diff(seg), np.ones(len(seg) - 1))
                real.extend(seg.tolist())
        self.assertEqual(int(b["lengths"].sum()), len(real))
        return real

    def test_packed_epoch_covers_every_token_once_on_two_ranks(self):
        ds = pacer.data.open(self.prefix)
        got = []
        for rank in range(2):
            loader = pacer.data.Loader(ds, batch_size=4, seed=3, rank=rank, world_size=2, seq_len=64, pack=True)
            for b in loader:
                got.extend(self.check_batch(b, 64))
            s = loader.stats()
            self.assertLess(s["padding_fraction"], 0.2)
        self.assertEqual(sorted(got), sorted(t for d in self.docs for t in d))

    def test_resume_and_torch(self):
        import torch

        ds = pacer.data.open(self.prefix)
        whole = [b["tokens"].copy() for b in pacer.data.Loader(ds, batch_size=3, seed=1, seq_len=48, pack=True)]
        loader = pacer.data.Loader(ds, batch_size=3, seed=1, seq_len=48, pack=True)
        it = iter(loader)
        head = [next(it)["tokens"].copy() for _ in range(5)]
        state = loader.state_dict()
        self.assertTrue(state["order"].startswith("packed seq_len=48"))
        again = pacer.data.Loader(ds, batch_size=3, seed=1, seq_len=48, pack=True)
        again.load_state_dict(state)
        rest = [b["tokens"].copy() for b in again]
        self.assertEqual(len(head) + len(rest), len(whole))
        for a, b in zip(head + rest, whole):
            np.testing.assert_array_equal(a, b)
        # device= hands back torch tensors (here on the CPU; CUDA copies are asynchronous from pinned buffers).
        b = next(iter(pacer.data.Loader(ds, batch_size=2, seed=1, seq_len=48, pack=True, device="cpu")))
        self.assertEqual(b["tokens"].dtype, torch.int64)
        self.assertEqual(tuple(b["tokens"].shape), (2, 48))
        emb = torch.nn.Embedding(200000, 4)(b["tokens"])
        self.assertEqual(tuple(emb.shape), (2, 48, 4))

    def test_bucketing_reports_less_padding(self):
        ds = pacer.data.open(self.prefix)
        plain = pacer.data.Loader(ds, batch_size=8, seed=0)
        bucketed = pacer.data.Loader(ds, batch_size=8, seed=0, bucket_window=4)
        for loader in (plain, bucketed):
            got = []
            for b in loader:
                self.assertEqual(b["tokens"].shape[0], len(b["lengths"]))
                got.extend(t for row, n in zip(b["tokens"], b["lengths"]) for t in row[:n].tolist())
            self.assertEqual(sorted(got), sorted(t for d in self.docs for t in d))
        self.assertLess(bucketed.stats()["padding_fraction"], plain.stats()["padding_fraction"])

    def test_empty_last_batch_has_tokens(self):
        pacer.data.write_tokens(self.prefix + "-9", self.docs[:9], dtype="int32")
        ds = pacer.data.open(self.prefix + "-9")
        for kw in ({}, {"seq_len": 16, "pack": True}, {"bucket_window": 1}):
            sizes = []
            for rank in range(4):
                batches = list(pacer.data.Loader(ds, batch_size=2, seed=0, rank=rank, world_size=4, **kw))
                for b in batches:
                    self.assertIn("tokens", b, kw)
                    self.assertEqual((b["tokens"].dtype, b["tokens"].ndim), (np.int64, 2), kw)
                    self.assertEqual((b["position_ids"].dtype, b["position_ids"].shape), (np.int32, b["tokens"].shape))
                    self.assertEqual(len(b["lengths"]), b["tokens"].shape[0])
                sizes.append([b["tokens"].shape[0] for b in batches])
            if not kw.get("pack"):
                # 9 documents at a global batch of 8: the second batch holds one row, on rank 0.
                self.assertEqual(sizes, [[2, 1], [2, 0], [2, 0], [2, 0]], kw)

    def test_bucketed_resume_with_another_global_batch_is_refused(self):
        ds = pacer.data.open(self.prefix)
        loader = pacer.data.Loader(ds, batch_size=4, seed=2, bucket_window=2)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        self.assertIn("global_batch=4", state["order"])
        other = pacer.data.Loader(ds, batch_size=5, seed=2, bucket_window=2)
        with self.assertRaisesRegex(pacer.Error, "global batch 4"):
            other.load_state_dict(state)
        same = pacer.data.Loader(ds, batch_size=2, seed=2, bucket_window=2, world_size=2)
        same.load_state_dict(state)

    def test_messages_name_the_dataset(self):
        pacer.data.write_tokens(self.prefix + "-none", [], dtype="int32")
        with self.assertRaisesRegex(pacer.Error, "-none: the dataset has 0 documents, fewer than the 1 ranks"):
            pacer.data.Loader(pacer.data.open(self.prefix + "-none"))

    def test_bin_truncated_while_open_raises(self):
        ds = pacer.data.open(self.prefix)
        self.assertEqual(list(ds[100]), self.docs[100])
        loader = pacer.data.Loader(ds, batch_size=4, shuffle=False, prefetch=1, threads=1)
        it = iter(loader)
        next(it)
        os.truncate(self.prefix + ".bin", 64)
        with self.assertRaisesRegex(pacer.Error, "docs.bin.*truncated while open"):
            ds[100]
        with self.assertRaisesRegex(pacer.Error, "docs.bin"):
            for _ in it:
                pass
        self.assertEqual(list(ds[0]), self.docs[0])

    def test_bad_options(self):
        ds = pacer.data.open(self.prefix)
        with self.assertRaisesRegex(pacer.Error, "seq_len"):
            pacer.data.Loader(ds, pack=True)
        tar = os.path.join(self.tmp.name, "one.tar")
        with tarfile.open(tar, "w") as t:
            info = tarfile.TarInfo("a.txt")
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
        with self.assertRaisesRegex(ValueError, "token datasets"):
            pacer.data.Loader(tar, seq_len=8)
        with self.assertRaisesRegex(ValueError, "device"):
            pacer.data.Loader(tar, device="cpu")
        # Values the options cannot hold name the option, not a pybind11 cast.
        for kw, why in ((dict(batch_size=-1), "batch_size=-1: not a non-negative integer"), (dict(seq_len=2 ** 64), "seq_len="),
                        (dict(prefetch=-3), "prefetch=-3")):
            with self.assertRaisesRegex(pacer.Error, why, msg=kw):
                pacer.data.Loader(ds, **kw)
        # A bucket window of global batches past 2^64 would wrap to 0 and never advance.
        with self.assertRaisesRegex(pacer.Error, "bucket_window .* does not fit 64 bits"):
            pacer.data.Loader(ds, batch_size=4, seq_len=8, bucket_window=2 ** 62)


class HelpTest(unittest.TestCase):
    """help(pacer.data.Loader) and its neighbours explain every public method and argument."""

    def test_every_public_member_has_a_docstring(self):
        for cls in (pacer.data.Loader, pacer.data.Dataset, pacer.data.TokenDataset):
            for name, value in vars(cls).items():
                if name.startswith("_") and name not in ("__init__", "__iter__", "__len__", "__getitem__"):
                    continue
                fn = value.fget if isinstance(value, property) else value
                # __doc__ itself: inspect.getdoc would take object's for __init__.
                self.assertTrue((getattr(fn, "__doc__", None) or "").strip(), f"{cls.__name__}.{name} has no docstring")
        for fn in (pacer.data.open, pacer.data.write_tokens):
            self.assertTrue((fn.__doc__ or "").strip(), f"{fn.__name__} has no docstring")

    def test_every_loader_argument_is_explained(self):
        import inspect
        import pydoc
        import re

        text = pydoc.render_doc(pacer.data.Loader, renderer=pydoc.plaintext)
        for name in inspect.signature(pacer.data.Loader.__init__).parameters:
            if name != "self":
                self.assertTrue(re.search(rf"\n[ |]*{name}:", text), f"help(pacer.data.Loader) does not explain {name}=")

    def test_the_bindings_have_docstrings(self):
        from pacer import _pacer

        for cls in (_pacer._Loader, _pacer._Dataset, _pacer._TokenDataset):
            for name, value in vars(cls).items():
                # _Dataset has no constructor (_open_dataset opens one).
                if name.startswith("_") and (name != "__init__" or cls is _pacer._Dataset):
                    continue
                doc = (value.__doc__ or "").splitlines()
                if not isinstance(value, property):
                    doc = doc[1:]  # pybind11 puts a method's signature first; the docstring follows it
                lines = [l for l in doc if l.strip() and not l.strip().startswith(("Overloaded", "1.", "2."))]
                self.assertTrue(lines, f"{cls.__name__}.{name} has no docstring")


if __name__ == "__main__":
    unittest.main()
