"""Tests of pacer.data's PyTorch habits: rank from the environment, pickling, DataLoader workers,
decoding and mapping, tar shards in any member order, gzip shards.

Run with the python the module was built for (Debian's, with numpy, torch and Pillow):
    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_data_habits
"""
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import unittest
from unittest import mock

import numpy as np

import pacer
import pacer.data
from pacer import _dist

try:
    import torch
    import torch.utils.data
except ImportError:  # the tests that need torch skip
    torch = None

try:
    import PIL.Image
except ImportError:
    PIL = None

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMI_RANK", "PMI_SIZE")


def clean_environ(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    return env


def write_tar(path, members, mode="w"):
    """members: (name, bytes) in the order they are written."""
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def text_samples(n, start=0):
    return [(f"s{i:04d}", {"txt": f"sample {i}".encode(), "cls": str(i % 10).encode()}) for i in range(start, start + n)]


def members_of(samples):
    return [(f"{key}.{ext}", data) for key, fields in samples for ext, data in fields.items()]


class Tmp(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-habits-")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def shards(self, n_shards=3, per_shard=20):
        paths = []
        for s in range(n_shards):
            paths.append(write_tar(self.path(f"shard-{s}.tar"), members_of(text_samples(per_shard, s * per_shard))))
        return paths


# ---- rank and world size ----------------------------------------------------------


class RankTest(Tmp):
    def test_launcher_variables_in_order(self):
        self.assertIsNone(_dist.environment_rank({}))
        self.assertEqual(_dist.environment_rank({"RANK": "3", "WORLD_SIZE": "8"})[:2], (3, 8))
        self.assertEqual(_dist.environment_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"})[:2], (5, 6))
        self.assertEqual(_dist.environment_rank({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})[:2], (1, 4))
        self.assertEqual(_dist.environment_rank({"PMI_RANK": "2", "PMI_SIZE": "3"})[:2], (2, 3))
        # torchrun's variables are trusted before Slurm's (torchrun inside srun sets both).
        both = {"RANK": "7", "WORLD_SIZE": "16", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
        self.assertEqual(_dist.environment_rank(both)[:2], (7, 16))
        # A launcher that set only one of its two variables is not used.
        self.assertEqual(_dist.environment_rank({"RANK": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})[:2], (1, 2))
        with self.assertRaises(pacer.Error) as e:
            _dist.environment_rank({"RANK": "one", "WORLD_SIZE": "2"})
        self.assertIn("RANK", str(e.exception))

    def test_loader_takes_rank_from_the_environment_and_explicit_wins(self):
        paths = self.shards(2, 10)
        ds = pacer.data.open(paths)
        with mock.patch.dict(os.environ, clean_environ(), clear=True):
            self.assertEqual(_dist.resolve_rank(), (0, 1))
            everything = [k for b in pacer.data.Loader(ds, batch_size=2, seed=1) for k in b["__key__"]]
            self.assertEqual(len(everything), 20)
        parts = []
        for r in range(2):
            with mock.patch.dict(os.environ, clean_environ(SLURM_PROCID=str(r), SLURM_NTASKS="2"), clear=True):
                loader = pacer.data.Loader(ds, batch_size=2, seed=1)
                parts.append([k for b in loader for k in b["__key__"]])
        self.assertEqual(len(parts[0]), 10)
        self.assertEqual(sorted(parts[0] + parts[1]), sorted(everything))
        # Explicit arguments win over the environment.
        with mock.patch.dict(os.environ, clean_environ(RANK="1", WORLD_SIZE="2"), clear=True):
            alone = pacer.data.Loader(ds, batch_size=2, seed=1, rank=0, world_size=1)
            self.assertEqual(len([k for b in alone for k in b["__key__"]]), 20)
            # One explicit value with the other from the environment must agree with it:
            # rank 0 of the launcher's 2 on its rank 1 would read rank 0's half twice.
            self.assertEqual(_dist.resolve_rank(rank=1), (1, 2))
            self.assertEqual(_dist.resolve_rank(world_size=2), (1, 2))
            with self.assertRaises(pacer.Error) as e:
                _dist.resolve_rank(rank=0)
            self.assertIn("RANK/WORLD_SIZE says this is rank 1 of 2", str(e.exception))
            with self.assertRaises(pacer.Error) as e:
                pacer.data.Loader(ds, rank=None, world_size=4)
            self.assertIn("world_size=4 but RANK/WORLD_SIZE says the world has 2 ranks", str(e.exception))
        # A launcher variable without its partner is an error where a value would come from it.
        with mock.patch.dict(os.environ, clean_environ(RANK="1"), clear=True):
            with self.assertRaises(pacer.Error) as e:
                pacer.data.Loader(ds, batch_size=2)
            self.assertIn("RANK='1' without WORLD_SIZE", str(e.exception))
            self.assertEqual(_dist.resolve_rank(rank=0, world_size=1), (0, 1))

    @unittest.skipIf(torch is None, "needs torch")
    def test_torch_distributed_decides_and_a_contradiction_is_an_error(self):
        # Two gloo ranks in child processes; each opens a Loader without rank or world_size.
        paths = self.shards(2, 10)
        script = textwrap.dedent("""
            import json, os, sys
            import torch.distributed as dist
            import pacer, pacer.data
            rank = int(sys.argv[1])
            # The environment says otherwise: torch.distributed must win.
            os.environ.update(SLURM_PROCID="0", SLURM_NTASKS="1")
            dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
            ds = pacer.data.open(json.loads(sys.argv[3]))
            loader = pacer.data.Loader(ds, batch_size=2, seed=3)
            keys = [k for b in loader for k in b["__key__"]]
            errors = []
            for kw in ({"rank": 1 - rank}, {"world_size": 3}):
                try:
                    pacer.data.Loader(ds, **kw)
                except pacer.Error as e:
                    errors.append(str(e))
            print(json.dumps({"keys": keys, "errors": errors}))
            dist.barrier()
            dist.destroy_process_group()
        """)
        store = self.path("store")
        env = clean_environ(PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        procs = [subprocess.Popen([sys.executable, "-c", script, str(r), store, json.dumps(paths)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            self.assertEqual(p.returncode, 0, stderr)
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        self.assertEqual(len(out[0]["keys"]), 10)
        self.assertEqual(sorted(out[0]["keys"] + out[1]["keys"]), [f"s{i:04d}" for i in range(20)])
        for r in range(2):
            self.assertEqual(len(out[r]["errors"]), 2)
            self.assertIn(f"rank={1 - r}", out[r]["errors"][0])
            self.assertIn(f"rank {r} of 2", out[r]["errors"][0])
            self.assertIn("world_size=3", out[r]["errors"][1])
            self.assertIn("2 ranks", out[r]["errors"][1])


# ---- pickling and DataLoader workers ----------------------------------------------


def keys(batches):
    return [k for b in batches for k in b["__key__"]]


def _spawned_loader_keys(index, path, out):
    """torch.multiprocessing.spawn target: unpickles a Loader and reads the rest of its epoch."""
    with open(path, "rb") as f:
        loader = pickle.load(f)
    with open(out, "w") as f:
        json.dump(keys(loader), f)


class PickleTest(Tmp):
    def test_dataset_and_token_dataset_pickle_by_path(self):
        paths = self.shards(2, 5)
        ds = pacer.data.open(self.path("shard-{0..1}.tar"))
        again = pickle.loads(pickle.dumps(ds))
        self.assertIsInstance(again, pacer.data.Dataset)
        self.assertEqual(len(again), 10)
        self.assertEqual([again[i] for i in range(10)], [ds[i] for i in range(10)])
        # Paths are kept absolute: a copy unpickled elsewhere opens the same files.
        cwd = os.getcwd()
        try:
            os.chdir(self.dir)
            rel = pacer.data.open(["shard-0.tar", "shard-1.tar"])
            blob = pickle.dumps(rel)
            os.chdir("/")
            self.assertEqual(pickle.loads(blob)[3], ds[3])
        finally:
            os.chdir(cwd)
        prefix = self.path("tokens")
        pacer.data.write_tokens(prefix, [[1, 2, 3], [4, 5]])
        tds = pickle.loads(pickle.dumps(pacer.data.open(prefix)))
        self.assertIsInstance(tds, pacer.data.TokenDataset)
        self.assertEqual(tds[1].tolist(), [4, 5])
        del paths

    def test_loader_pickles_and_continues_where_it_was(self):
        self.shards(3, 20)
        loader = pacer.data.Loader(self.path("shard-{0..2}.tar"), batch_size=4, seed=9, rank=1, world_size=2)
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        copy = pickle.loads(pickle.dumps(loader))
        self.assertEqual(copy.state_dict(), loader.state_dict())
        rest = keys(it)
        self.assertEqual(keys(copy), rest)
        self.assertEqual(len(keys(first)) + len(rest), 30)
        # A pickled loader keeps the rank it resolved, not whatever the unpickling process has.
        with mock.patch.dict(os.environ, clean_environ(RANK="0", WORLD_SIZE="1"), clear=True):
            self.assertEqual(pickle.loads(pickle.dumps(copy))._args["rank"], 1)

    @unittest.skipIf(torch is None, "needs torch")
    def test_torch_dataloader_workers_over_a_dataset(self):
        self.shards(3, 20)
        ds = pacer.data.open(self.path("shard-{0..2}.tar"))
        expected = sorted(ds[i]["__key__"] for i in range(len(ds)))
        for context in (None, "spawn"):
            dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=context)
            got = []
            for batch in dl:
                got.extend(batch["__key__"])
                for key, txt in zip(batch["__key__"], batch["txt"]):
                    self.assertEqual(txt, f"sample {int(key[1:])}".encode())
            self.assertEqual(sorted(got), expected, context)

    @unittest.skipIf(torch is None, "needs torch")
    def test_torch_multiprocessing_spawn_continues_a_loader(self):
        import torch.multiprocessing as tmp

        self.shards(2, 20)
        loader = pacer.data.Loader(self.path("shard-{0..1}.tar"), batch_size=5, seed=2)
        it = iter(loader)
        head = keys([next(it), next(it)])
        path, out = self.path("loader.pkl"), self.path("keys.json")
        with open(path, "wb") as f:
            pickle.dump(loader, f)
        tmp.spawn(_spawned_loader_keys, args=(path, out), nprocs=1)
        with open(out) as f:
            tail = json.load(f)
        self.assertEqual(tail, keys(it))
        self.assertEqual(sorted(head + tail), [f"s{i:04d}" for i in range(40)])


# ---- decoding, to_tuple, map --------------------------------------------------------


def npy(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def image(kind, i):
    im = PIL.Image.new("RGB", (4 + i % 3, 3), (i * 10 % 256, 20, 30))
    buf = io.BytesIO()
    im.save(buf, format={"jpg": "JPEG", "png": "PNG"}[kind])
    return buf.getvalue()


def mapped_sample(sample):
    """A picklable map function: the class and the text's length."""
    return sample[1] * 100 + len(sample[0])


def failing_map(sample):
    raise RuntimeError(f"cannot map {sample['__key__']}")


class DecodeTest(Tmp):
    N = 24

    def setUp(self):
        super().setUp()
        if PIL is None:
            self.skipTest("needs Pillow (python3-pil)")
        samples = []
        for i in range(self.N):
            kind = ("jpg", "png")[i % 2]
            fields = {kind: image(kind, i), "cls": f"{i % 7}\n".encode(), "json": json.dumps({"i": i}).encode(),
                      "txt": f"text {i} é".encode(), "npy": npy(np.arange(3) * i), "seg.png": image("png", i)}
            if torch is not None and i % 4 == 0:
                buf = io.BytesIO()
                torch.save({"t": torch.full((2,), float(i))}, buf)
                fields["pth"] = buf.getvalue()
            samples.append((f"k{i:03d}", fields))
        self.spec = [write_tar(self.path(f"img-{s}.tar"), members_of(samples[s * 12:(s + 1) * 12])) for s in range(2)]

    def test_every_webdataset_extension_decodes(self):
        loader = pacer.data.Loader(self.spec, batch_size=5, seed=0, decode="rgb8")
        seen = 0
        for b in loader:
            for j, key in enumerate(b["__key__"]):
                i = int(key[1:])
                self.assertEqual(b["cls"][j], i % 7)
                self.assertEqual(b["json"][j], {"i": i})
                self.assertEqual(b["txt"][j], f"text {i} é")
                np.testing.assert_array_equal(b["npy"][j], np.arange(3) * i)
                img = b["jpg" if i % 2 == 0 else "png"][j]
                self.assertIsInstance(img, np.ndarray)
                self.assertEqual(img.shape, (3, 4 + i % 3, 3))
                self.assertEqual(img.dtype, np.uint8)
                self.assertIsNone(b["png" if i % 2 == 0 else "jpg"][j])
                if i % 2:  # png is lossless
                    self.assertEqual(tuple(img[0, 0]), (i * 10 % 256, 20, 30))
                self.assertEqual(b["seg.png"][j].shape, (3, 4 + i % 3, 3), "the extension's last part picks the decoder")
                if torch is not None and i % 4 == 0:
                    self.assertTrue(torch.equal(b["pth"][j]["t"], torch.full((2,), float(i))))
                seen += 1
        self.assertEqual(seen, self.N)

    def test_image_modes_and_custom_decoders(self):
        b = next(iter(pacer.data.Loader(self.spec, batch_size=4, shuffle=False, decode="pil")))
        self.assertIsInstance(b["jpg"][0], PIL.Image.Image)
        self.assertEqual(b["jpg"][0].size, (4, 3))
        b = next(iter(pacer.data.Loader(self.spec, batch_size=4, shuffle=False, decode="l8",
                                        decoders={"txt": lambda v: bytes(v).upper()})))
        self.assertEqual(b["png"][1].shape, (3, 5))
        self.assertEqual(b["txt"][0], "text 0 é".encode().upper())
        if torch is not None:
            b = next(iter(pacer.data.Loader(self.spec, batch_size=4, shuffle=False, decode="torchrgb")))
            self.assertEqual(tuple(b["png"][1].shape), (3, 3, 5))
            self.assertEqual(b["png"][1].dtype, torch.float32)
            self.assertAlmostEqual(float(b["png"][1][1, 0, 0]), 20 / 255, places=5)
        # decode=True still decodes only npy; other fields stay views.
        b = next(iter(pacer.data.Loader(self.spec, batch_size=4, shuffle=False)))
        self.assertIsInstance(b["npy"][0], np.ndarray)
        self.assertIsInstance(b["json"][0], memoryview)
        self.assertEqual(pacer.data.decode_sample(pacer.data.open(self.spec)[2], "rgb8")["cls"], 2)
        with self.assertRaises(ValueError):
            pacer.data.Loader(self.spec, decode="jpeg2000")

    def test_to_tuple_map_and_collate(self):
        loader = pacer.data.Loader(self.spec, batch_size=6, seed=4, decode="rgb8", to_tuple=("jpg;png", "cls"))
        for images, classes in loader:
            self.assertEqual(len(images), len(classes))
            self.assertTrue(all(isinstance(x, np.ndarray) for x in images))
        mapped = pacer.data.Loader(self.spec, batch_size=6, seed=4, decode="rgb8", to_tuple=("txt", "cls"), map=mapped_sample)
        values = sorted(v for b in mapped for v in b)
        self.assertEqual(values, sorted((i % 7) * 100 + len(f"text {i} é") for i in range(self.N)))
        if torch is not None:
            collated = pacer.data.Loader(self.spec, batch_size=6, shuffle=False, decode="rgb8", to_tuple=("npy", "cls"),
                                         collate=torch.utils.data.default_collate)
            arrays, classes = next(iter(collated))
            self.assertEqual(tuple(arrays.shape), (6, 3))
            self.assertEqual(classes.tolist(), [i % 7 for i in range(6)])
        with self.assertRaises(pacer.Error) as e:
            list(pacer.data.Loader(self.spec, batch_size=6, decode="rgb8", to_tuple=("webp", "cls")))
        self.assertIn("has no field 'webp'", str(e.exception))

    def test_bad_fields_name_the_sample(self):
        path = write_tar(self.path("bad.tar"), [("a.json", b"{}"), ("b.json", b"{not json"), ("c.cls", b"seven")])
        with self.assertRaises(pacer.Error) as e:
            list(pacer.data.Loader(path, batch_size=3, shuffle=False, decode="rgb8"))
        self.assertIn("'b'", str(e.exception))
        self.assertIn("'json'", str(e.exception))

    def check_exact_resume(self, **kw):
        """With the stages run ahead of the consumer, state_dict() is still where the consumer is."""
        def make():
            return pacer.data.Loader(self.spec, batch_size=3, seed=6, decode="rgb8", to_tuple=("txt",), **kw)

        whole = [b[0] for b in make()]
        loader = make()
        it = iter(loader)
        got = [next(it)[0] for _ in range(3)]
        state = loader.state_dict()
        self.assertEqual(state["position"], 9)
        resumed = make()
        resumed.load_state_dict(state)
        self.assertEqual(got + [b[0] for b in resumed], whole)
        # Leaving a loop early and looping again continues with the next batch, too.
        for b in it:
            got.append(b[0])
            break
        self.assertEqual(got + [b[0] for b in loader], whole)
        self.assertEqual(len(whole), self.N // 3)
        loader.close()

    def test_map_threads_keep_order_and_exact_resume(self):
        self.check_exact_resume(map_threads=2)

    def test_map_workers_keep_order_and_exact_resume(self):
        self.check_exact_resume(map_workers=2)
        self.check_exact_resume(map_workers=1, map_context="spawn")

    def test_map_errors_reach_the_consumer(self):
        with self.assertRaises(RuntimeError) as e:
            list(pacer.data.Loader(self.spec, batch_size=4, shuffle=False, map=failing_map, map_workers=1))
        self.assertIn("cannot map k000", str(e.exception))
        with self.assertRaises(ValueError):
            pacer.data.Loader(self.spec, map=failing_map, map_threads=1, map_workers=1)


# ---- member order and gzip ------------------------------------------------------------


class ShardFormsTest(Tmp):
    def test_gnu_tar_in_directory_order_groups_by_key(self):
        # The report: tar of a directory listing every .txt, then every .json.
        src = self.path("src")
        os.makedirs(src)
        names = []
        for ext in ("txt", "json"):
            for i in range(50):
                with open(os.path.join(src, f"{i:03d}.{ext}"), "w") as f:
                    f.write(f"{ext} {i}")
                names.append(f"{i:03d}.{ext}")
        with open(self.path("list"), "w") as f:
            f.write("\n".join(names) + "\n")
        shard = self.path("natural.tar")
        subprocess.run(["tar", "--no-recursion", "-cf", shard, "-T", self.path("list")], cwd=src, check=True)
        ds = pacer.data.open(shard)
        self.assertEqual(len(ds), 50)
        for i in range(50):
            s = ds[i]
            self.assertEqual(s, {"__key__": f"{i:03d}", "txt": f"txt {i}".encode(), "json": f"json {i}".encode()})
        b = next(iter(pacer.data.Loader(ds, batch_size=50, shuffle=False, rank=0, world_size=1)))
        self.assertNotIn(None, b["txt"] + b["json"])

    def test_gzip_shards_read_as_their_tar(self):
        samples = text_samples(30)
        plain = [write_tar(self.path(f"p-{s}.tar"), members_of(samples[s * 10:(s + 1) * 10])) for s in range(3)]
        gz = [write_tar(self.path(f"g-{s}.tar.gz"), members_of(samples[s * 10:(s + 1) * 10]), mode="w:gz") for s in range(3)]
        a, b = pacer.data.open(plain), pacer.data.open(gz)
        self.assertEqual([a[i] for i in range(30)], [b[i] for i in range(30)])
        la = pacer.data.Loader(plain, batch_size=4, seed=5, rank=0, world_size=1)
        lb = pacer.data.Loader(gz, batch_size=4, seed=5, rank=0, world_size=1)
        self.assertEqual(keys(la), keys(lb))
        with open(gz[1], "rb") as f:
            data = f.read()
        cut = self.path("cut.tar.gz")
        with open(cut, "wb") as f:
            f.write(data[:len(data) // 2])
        with self.assertRaises(pacer.Error) as e:
            pacer.data.open(cut)
        self.assertIn(cut, str(e.exception))
        self.assertIn("truncated", str(e.exception))


if __name__ == "__main__":
    unittest.main()
