"""Whole training states through pacer.Checkpointer: nested structures, load into live objects, key-path errors,
and a resume in a new process that continues bit-identically.

    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_checkpoint_state
"""
import collections
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import unittest
import warnings

import numpy as np

import pacer

try:
    import torch
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
needs_torch = unittest.skipIf(torch is None, "torch is not installed")


def manifest(root, step):
    with open(os.path.join(root, f"step-{step:012d}", "MANIFEST.json")) as f:
        return json.load(f)


class StateTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-state-")
        self.root = os.path.join(self.tmp.name, "ckpt")
        self.ck = pacer.Checkpointer(self.root, keep_last=0)

    def tearDown(self):
        del self.ck
        self.tmp.cleanup()

    def assertSameValue(self, got, want, path="state"):
        """Same structure, same types (list vs tuple, int vs str keys), same bytes."""
        self.assertIs(type(got), type(want), path)
        if torch is not None and isinstance(want, torch.Tensor):
            self.assertEqual((got.dtype, got.shape, got.device), (want.dtype, want.shape, want.device), path)
            a, b = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
            self.assertEqual(a.reshape(-1).view(torch.uint8).tolist(), b.reshape(-1).view(torch.uint8).tolist(), path)
        elif isinstance(want, np.ndarray):
            self.assertEqual((got.dtype, got.shape), (want.dtype, want.shape), path)
            self.assertEqual(got.tobytes(), want.tobytes(), path)
        elif isinstance(want, dict):
            self.assertEqual(list(got.keys()), list(want.keys()), path)
            for k in want:
                self.assertSameValue(got[k], want[k], f"{path}[{k!r}]")
        elif isinstance(want, (list, tuple)):
            self.assertEqual(len(got), len(want), path)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assertSameValue(g, w, f"{path}[{i}]")
        elif isinstance(want, float) and math.isnan(want):
            self.assertTrue(math.isnan(got), path)
        elif isinstance(want, np.generic):
            self.assertEqual((got.dtype, got.tobytes()), (want.dtype, want.tobytes()), path)
        else:
            self.assertEqual(got, want, path)


class Scalars(StateTestCase):
    def test_python_and_numpy_leaves_keep_their_types(self):
        state = {
            "ints": [0, -1, 2**63 - 1, -2**63, 2**64 - 1, 2**64, -2**200, 3**100],
            "floats": [0.1, -0.0, 1e308, 5e-324, float("inf"), float("-inf"), float("nan"), 1.0],
            "bools": (True, False), "none": None, "str": "r\u00e9sum\u00e9 \u2713", "empty": "",
            "bytes": b"\x00\xffabc", "bytearray": bytearray(b"xyz"), "no_bytes": b"",
            "np": [np.float32(1.5), np.int64(-7), np.bool_(True), np.uint8(200), np.float16(0.1), np.complex64(1 - 2j)],
            "int_keys": {0: "a", 1: "b", -5: "c", 2**70: "big"}, "mixed_keys": {"0": 1, 0: 2, None: 3, (1, "a"): 4},
            "nested": {"list": [[1, 2], (3, [4, (5,)])], "tuple": (), "list0": [], "dict0": {}},
            "od": collections.OrderedDict([("b", 1), ("a", 2)]),
            "counter": collections.Counter({3: 2}), "dd": collections.defaultdict(list, {"k": [1]}),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        }
        self.assertEqual(self.ck.steps(), [])
        self.ck.save(1, state, meta={"lr": 0.5}).wait()
        self.ck.save(4, {}).wait()
        self.assertEqual(self.ck.steps(), [4, 1])
        step, got, meta = self.ck.load(1)
        self.assertEqual((step, meta), (1, {"lr": 0.5}))
        self.assertSameValue(got, state)
        self.assertEqual(got["counter"][99], 0)  # still a Counter, as MultiStepLR's milestones need
        self.assertEqual(got["dd"]["new"], [])
        # The tree sits in the manifest under the reserved key, beside the user's meta.
        m = manifest(self.root, 1)["meta"]
        self.assertEqual(m["lr"], 0.5)
        self.assertEqual(m["pacer"]["schema"], "pacer.state/1")
        names = {b["name"] for b in manifest(self.root, 1)["blobs"]}
        self.assertEqual(names, {"bytes", "bytearray", "no_bytes", "array"})

    def test_blob_names_are_key_paths_and_collisions_get_suffixes(self):
        state = {"a/b": np.zeros(1), "a": {"b": np.ones(1)}, "x": [np.zeros(2), {"y": np.zeros(3)}]}
        self.ck.save(1, state).wait()
        names = [b["name"] for b in manifest(self.root, 1)["blobs"]]
        self.assertEqual(sorted(names), ["a/b", "a/b~1", "x/0", "x/1/y"])
        self.assertSameValue(self.ck.load()[1], state)

    def test_old_flat_checkpoints_still_load(self):
        # A checkpoint without the "pacer" tree (the flat API before pacer.state/1) loads as {name: array}.
        w = np.arange(6, dtype=np.float32).reshape(2, 3)
        raw = pacer._pacer._Checkpointer(self.root)
        raw.save(1, [("w", w.reshape(-1).view(np.uint8), "float32", [2, 3], "replicated", 0, 0, []),
                     ("b", np.frombuffer(b"abc", np.uint8), "bytes", [3], "replicated", 0, 0, [])], '{"lr": 1}').wait()
        del raw
        step, got, meta = self.ck.load()
        self.assertEqual((step, meta, sorted(got)), (1, {"lr": 1}, ["b", "w"]))
        self.assertSameValue(got["w"], w)
        self.assertEqual(got["b"].tobytes(), b"abc")
        into = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.uint8)}
        self.ck.load(into=into)
        self.assertSameValue(into["w"], w)


    def test_a_stored_tree_that_does_not_fit_its_blobs_is_a_bad_copy(self):
        raw = pacer._pacer._Checkpointer(self.root, keep_last=0)
        w = np.arange(4, dtype=np.float32)
        blob = [("w", w.view(np.uint8), "float32", [4], "replicated", 0, 0, [])]

        def tree(node, schema="pacer.state/1"):
            return json.dumps({"pacer": {"schema": schema, "tree": {"t": "dict", "items": [["w", node]]}}})

        raw.save(1, blob, tree({"t": "ndarray", "blob": "w", "dtype": "float32", "shape": [4]})).wait()
        bad = [
            tree({"t": "ndarray", "blob": "w", "dtype": "float32", "shape": [10**12]}),  # more than the blob holds
            tree({"t": "ndarray", "blob": "nope", "dtype": "float32", "shape": [4]}),
            tree({"t": "martian"}),
            tree({"t": "int", "v": "zz"}),
            tree({"t": "dict", "items": [[{"t": "x"}, 1]]}),
            tree(1, schema="pacer.state/99"),
            json.dumps({"pacer": {"schema": "pacer.state/1", "tree": [1]}}),
            '{"pacer": {"schema": "pacer.state/1", "tree": ' + '[' * 5000 + ']' * 5000 + '}}',
            # one blob named by many leaves: each would be allocated and read again
            json.dumps({"pacer": {"schema": "pacer.state/1", "tree": {"t": "dict", "items": [
                [f"w{k}", {"t": "ndarray", "blob": "w", "dtype": "float32", "shape": [4]}] for k in range(3)]}}}),
        ]
        for i, meta in enumerate(bad):
            step = 2 + i
            raw.save(step, blob, meta).wait()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got_step, got, _ = self.ck.load()
            self.assertEqual(got_step, 1, meta[:80])
            self.assertSameValue(got["w"], w)
            self.assertTrue(any(f"skipping step {step}" in str(c.message) for c in caught), meta[:80])
            with self.assertRaisesRegex(pacer.Error, f"no valid checkpoint for step {step}"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.ck.load(step)


class TorchBase(StateTestCase):
    def model_and_optimizer(self, steps=3, sizes=(4, 8, 3)):
        torch.manual_seed(1)
        layers = [torch.nn.Linear(sizes[i], sizes[i + 1]) for i in range(len(sizes) - 1)]
        model = torch.nn.Sequential(layers[0], torch.nn.BatchNorm1d(sizes[1]), torch.nn.ReLU(), *layers[1:])
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(5, sizes[0])).square().mean().backward()
            opt.step()
            sched.step()
        return model, opt, sched

    def full_state(self):
        model, opt, sched = self.model_and_optimizer()
        return model, opt, sched, {"model": model.state_dict(), "optim": opt.state_dict(),
                                   "sched": sched.state_dict(), "rng": pacer.rng_state(), "epoch": 3}


@needs_torch
class TorchStates(TorchBase):
    def test_one_call_round_trip(self):
        _, _, _, state = self.full_state()
        self.assertIsInstance(state["optim"]["state"], dict)
        self.assertIn(0, state["optim"]["state"])  # integer keys
        self.ck.save(7, state).wait()
        step, got, _ = self.ck.load()
        self.assertEqual(step, 7)
        self.assertSameValue(got, state)
        # nn.Module versions travel with the model's state dict.
        self.assertEqual(got["model"]._metadata, state["model"]._metadata)
        names = {b["name"] for b in manifest(self.root, 7)["blobs"]}
        self.assertIn("model/0.weight", names)
        self.assertIn("optim/state/0/exp_avg", names)
        self.assertIn("rng/torch", names)

    def test_save_before_an_optimizer_on_the_cpu_saves_at_once(self):
        # CPU tensors are copied before save() returns: `before` changes nothing for them, and the
        # optimizer's next step may run at once whatever torch has.
        model, opt, _, state = self.full_state()
        want = {k: v.clone() for k, v in state["model"].items()}
        h = self.ck.save(3, state, before=opt)
        self.assertTrue(h.copied())
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        h.wait()
        _, got, _ = self.ck.load()
        for k, v in want.items():
            self.assertTrue(torch.equal(got["model"][k], v), k)
        with self.assertRaisesRegex(pacer.Error, r"before=\.\.\.\) takes optimizers .* not int"):
            self.ck.save(4, state, before=5)

    def test_per_rank_values_round_trip(self):
        gen = torch.Generator().manual_seed(7).get_state()
        self.ck.save(1, {"w": torch.ones(2), "own": pacer.PerRank({"gen": gen, "n": 3, "t": (1, "a")})}).wait()
        _, got, _ = self.ck.load()
        self.assertEqual((got["own"]["n"], got["own"]["t"]), (3, (1, "a")))  # without into: the value itself
        self.assertTrue(torch.equal(got["own"]["gen"], gen))
        into = {"w": torch.zeros(2), "own": pacer.PerRank({"gen": torch.zeros_like(gen), "n": 0, "t": None})}
        self.ck.load(into=into)
        self.assertTrue(torch.equal(into["own"].value["gen"], gen))  # filled in place
        self.assertEqual(into["own"].value["n"], 3)
        names = {b["name"] for b in manifest(self.root, 1)["blobs"]}
        self.assertIn("own/rank-0/gen", names)
        self.assertIn("own/rank-0.tree", names)
        with self.assertRaisesRegex(pacer.Error, r"state\['own'\]\['rank-0'\]\['x'\]: a PerRank inside a PerRank"):
            self.ck.save(2, {"own": pacer.PerRank({"x": pacer.PerRank(1)})})

    def test_stats_count_the_bytes_staged(self):
        w = torch.randn(1000, 3)
        self.assertEqual(self.ck.stats()["saves"], 0)
        self.ck.save(1, {"w": w, "n": 5}).wait()
        s = self.ck.stats()
        self.assertEqual(s["saves"], 1)
        self.assertEqual(s["bytes_staged"], w.numel() * w.element_size())
        self.assertGreaterEqual(s["staging_bytes"], s["pinned_bytes"])
        self.assertGreater(s["blocked_s"], 0)

    def test_loaded_state_works_with_load_state_dict(self):
        model, opt, sched, state = self.full_state()
        self.ck.save(1, state).wait()
        _, got, _ = self.ck.load()
        model2, opt2, sched2 = self.model_and_optimizer(steps=0)
        model2.load_state_dict(got["model"])
        opt2.load_state_dict(got["optim"])
        sched2.load_state_dict(got["sched"])
        x = torch.randn(6, 4)
        for m in (model, model2):
            m.train()
        for o, m, s in ((opt, model, sched), (opt2, model2, sched2)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
        for a, b in zip(model.parameters(), model2.parameters()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(sched.get_last_lr(), sched2.get_last_lr())

    def test_load_into_fills_in_place(self):
        model, opt, sched, state = self.full_state()
        self.ck.save(1, state).wait()
        model2, opt2, sched2 = self.model_and_optimizer(steps=0, sizes=(4, 8, 3))
        with torch.no_grad():
            for p in model2.parameters():
                p.zero_()
        target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "sched": sched2.state_dict(),
                  "rng": pacer.rng_state(), "epoch": 0}
        weight = model2[0].weight
        step, got, _ = self.ck.load(into=target)
        self.assertIs(got, target)
        self.assertEqual(got["epoch"], 3)
        # The model's own parameters changed: the state dict's tensors share their memory.
        self.assertTrue(torch.equal(weight, model[0].weight))
        self.assertTrue(torch.equal(model2[1].running_mean, model[1].running_mean))
        self.assertEqual(int(model2[1].num_batches_tracked), 3)
        # The empty optimizer state was filled; param_groups replaced.
        self.assertEqual(set(got["optim"]["state"]), set(state["optim"]["state"]))
        opt2.load_state_dict(got["optim"])
        sched2.load_state_dict(got["sched"])
        self.assertEqual(sched2.last_epoch, 3)
        self.assertEqual(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])
        self.assertTrue(torch.equal(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"]))

    def test_load_into_keeps_device_dtype_and_fills_numpy_and_non_contiguous_targets(self):
        state = {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4), "a": np.arange(5, dtype=np.int64),
                 "nc": torch.arange(6.0).reshape(2, 3), "fa": np.arange(6.0).reshape(2, 3)}
        self.ck.save(1, state).wait()
        t, a = torch.zeros(3, 4), np.zeros(5, dtype=np.int64)
        nc = torch.zeros(3, 2).t()  # non-contiguous (2, 3)
        fa = np.asfortranarray(np.zeros((2, 3)))
        into = {"t": t, "a": a, "nc": nc, "fa": fa}
        self.ck.load(into=into)
        self.assertIs(into["t"], t)
        self.assertIs(into["a"], a)
        self.assertTrue(torch.equal(t, state["t"]))
        self.assertEqual(a.tolist(), list(range(5)))
        self.assertTrue(torch.equal(nc, state["nc"]))
        self.assertEqual(fa.tolist(), state["fa"].tolist())

    def test_dtypes(self):
        g = torch.Generator().manual_seed(3)
        state = {str(dt).replace("torch.", ""): (torch.randn(4, 3, generator=g) * 100).to(dt)
                 for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                            torch.int16, torch.int32, torch.int64, torch.complex64, torch.complex128)}
        state["bool"] = torch.rand(7, generator=g) > 0.5
        state["scalar_bf16"] = torch.tensor(1.5, dtype=torch.bfloat16)
        state["empty"] = torch.zeros(0, 3, dtype=torch.float16)
        state["strided"] = torch.randn(6, 6, generator=g)[::2, 1::2]
        state["with_grad"] = torch.ones(3, requires_grad=True) * 2
        state["param"] = torch.nn.Parameter(torch.ones(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            state["complex32"] = torch.randn(4, generator=g).to(torch.complex32)
        for name in ("float8_e4m3fn", "float8_e5m2"):  # torch 2.x
            if hasattr(torch, name):
                state[name] = torch.randn(5, generator=g).to(getattr(torch, name))
        self.ck.save(1, state).wait()
        _, got, _ = self.ck.load()
        for k, want in state.items():
            self.assertIs(type(got[k]), torch.Tensor, k)
            self.assertSameValue(got[k], want.detach().contiguous().as_subclass(torch.Tensor), k)
        dtypes = {b["name"]: b["dtype"] for b in manifest(self.root, 1)["blobs"]}
        self.assertEqual(dtypes["bfloat16"], "bfloat16")
        self.assertEqual(dtypes["bool"], "bool")
        # Into tensors of each dtype.
        into = {k: torch.empty_like(v.detach()) for k, v in state.items()}
        self.ck.load(into=into)
        for k, want in state.items():
            self.assertSameValue(into[k], want.detach().contiguous().as_subclass(torch.Tensor), k)

    def test_rng_state_helpers(self):
        s = pacer.rng_state()
        self.ck.save(1, {"rng": s}).wait()
        want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        pacer.set_rng_state(self.ck.load()[1]["rng"])
        self.assertEqual((random.random(), float(np.random.rand()), float(torch.rand(1))), want)
        into = {"rng": pacer.rng_state()}
        self.ck.load(into=into)
        pacer.set_rng_state(into["rng"])
        self.assertEqual((random.random(), float(np.random.rand()), float(torch.rand(1))), want)

    def test_shard_arguments(self):
        full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
        with self.assertRaisesRegex(pacer.Error, "outside"):
            pacer.Shard(full[:6], 5, (10, 4))
        with self.assertRaisesRegex(pacer.Error, "does not fit"):
            pacer.Shard(full[:6], 0, (10, 3))
        # One rank holding every row: a shard that is the whole tensor.
        self.ck.save(1, {"w": pacer.Shard(full, 0, (10, 4))}).wait()
        blob = manifest(self.root, 1)["blobs"][0]
        self.assertEqual((blob["layout"], blob["global_shape"]), ("shard", [10, 4]))
        self.assertSameValue(self.ck.load()[1]["w"], full)

    def test_shard_into_reads_its_rows(self):
        full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
        self.ck.save(1, {"w": full}).wait()
        part = torch.zeros(3, 4)
        self.ck.load(into={"w": pacer.Shard(part, 5, (10, 4))})
        self.assertTrue(torch.equal(part, full[5:8]))
        with self.assertRaisesRegex(pacer.Error,
                                    r"state\['w'\]: shape \[10, 4\] in the checkpoint, a shard of \[12, 4\]"):
            self.ck.load(into={"w": pacer.Shard(torch.zeros(3, 4), 0, (12, 4))})


@needs_torch
class BadInput(TorchBase):
    def test_unsaveable_leaves_name_their_key_path(self):
        cases = [
            ({"sched": {"lr_lambdas": [lambda s: 1.0]}},
             r"state\['sched'\]\['lr_lambdas'\]\[0\]: cannot save a function"),
            ({"f": open(os.devnull)}, r"state\['f'\]: cannot save an open file"),
            ({"o": {1: [object()]}}, r"state\['o'\]\[1\]\[0\]: cannot save an object of type builtins.object"),
            ({"k": {object(): 1}}, r"state\['k'\]: a dict key"),
            ({"s": torch.zeros(3).to_sparse()}, r"state\['s'\]: cannot save a torch.sparse_coo tensor"),
            ({"g": torch.Generator()}, r"state\['g'\]: cannot save an object of type torch._C.Generator"),
            ({"u": np.array(["x"])}, r"state\['u'\]: numpy dtype <U1 cannot be saved"),
            ({"nt": collections.namedtuple("P", "a")(1)}, r"state\['nt'\]: cannot save a P \(a tuple subclass\)"),
        ]
        loop = {"a": []}
        loop["a"].append(loop)
        cases.append((loop, r"state\['a'\]\[0\]: the state contains itself"))
        try:
            for state, pattern in cases:
                with self.assertRaisesRegex(pacer.Error, pattern):
                    self.ck.save(1, state)
        finally:
            cases[1][0]["f"].close()
        with self.assertRaisesRegex(pacer.Error, "reserved"):
            self.ck.save(1, {"x": 1}, meta={"pacer": 1})
        with self.assertRaisesRegex(pacer.Error, "state must be a dict"):
            self.ck.save(1, [1])
        self.assertIsNone(self.ck.latest())

    def test_size_change_names_the_key(self):
        _, _, _, state = self.full_state()
        self.ck.save(1, state).wait()
        model, opt, sched = self.model_and_optimizer(steps=0, sizes=(4, 9, 3))
        into = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "rng": pacer.rng_state(), "epoch": 0}
        before = model[0].weight.clone()
        with self.assertRaisesRegex(pacer.Error, r"step 1: state\['model'\]\['0.weight'\]: shape \[8, 4\] in the "
                                                 r"checkpoint, \[9, 4\] here"):
            self.ck.load(into=into)
        self.assertTrue(torch.equal(model[0].weight, before))  # checked before anything was read
        with self.assertRaisesRegex(pacer.Error, r"state\['model'\]\['0.weight'\]: dtype float32 in the checkpoint, "
                                                 r"float64 here"):
            doubles = {k: v.double() for k, v in self.model_and_optimizer(0)[0].state_dict().items()}
            self.ck.load(into={**into, "model": doubles})

    def test_optimizer_for_other_parameters(self):
        _, _, _, state = self.full_state()
        self.ck.save(1, state).wait()
        model, opt, sched = self.model_and_optimizer(steps=1, sizes=(4, 8, 8, 3))  # two more parameters
        into = {"model": self.model_and_optimizer(0)[0].state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict(), "rng": pacer.rng_state(), "epoch": 0}
        with self.assertRaisesRegex(pacer.Error, r"state\['optim'\]\['state'\]: keys do not match: 6, 7 here but "
                                                 r"not in the checkpoint"):
            self.ck.load(into=into)

    def test_fresh_optimizer_for_other_parameters(self):
        # A fresh optimizer has no tensors to compare: its state takes the checkpoint's, and its own
        # load_state_dict refuses the parameter groups, as after torch.load.
        _, _, _, state = self.full_state()
        self.ck.save(1, state).wait()
        model, opt, sched = self.model_and_optimizer(steps=0, sizes=(4, 8, 8, 3))
        into = {"model": self.model_and_optimizer(0)[0].state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict(), "rng": pacer.rng_state(), "epoch": 0}
        self.ck.load(into=into)
        with self.assertRaisesRegex(ValueError, "size of optimizer's group"):
            opt.load_state_dict(into["optim"])

    def test_missing_and_extra_keys(self):
        self.ck.save(1, {"model": {"a": torch.zeros(1), "b": torch.zeros(1)}}).wait()
        with self.assertRaisesRegex(pacer.Error, r"state\['model'\]: keys do not match: 'c' here but not in the "
                                                 r"checkpoint; 'b' in the checkpoint but not here"):
            self.ck.load(into={"model": {"a": torch.zeros(1), "c": torch.zeros(1)}})
        with self.assertRaisesRegex(pacer.Error, r"state\['model'\]\['a'\]: a tensor here, None in the checkpoint"):
            self.ck.save(2, {"model": {"a": None, "b": torch.zeros(1)}}).wait()
            self.ck.load(into={"model": {"a": torch.zeros(1), "b": torch.zeros(1)}})
        with self.assertRaisesRegex(pacer.Error, "takes a dict"):
            self.ck.load(into=[1])

    def test_a_bad_copy_falls_back_but_a_mismatch_does_not(self):
        self.ck.save(1, {"w": torch.ones(1000)}).wait()
        self.ck.save(2, {"w": torch.full((1000,), 2.0)}).wait()
        path = os.path.join(self.root, f"step-{2:012d}", "rank-00000.bin")
        with open(path, "r+b") as f:
            f.seek(10)
            b = f.read(1)
            f.seek(10)
            f.write(bytes([b[0] ^ 1]))
        w = torch.zeros(1000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, _, _ = self.ck.load(into={"w": w})
        self.assertEqual(step, 1)
        self.assertTrue(torch.equal(w, torch.ones(1000)))
        self.assertTrue(any("skipping step 2" in str(c.message) for c in caught))
        with self.assertRaisesRegex(pacer.Error, r"step 1: state\['w'\]: shape"):
            self.ck.load(1, into={"w": torch.zeros(3)})


@needs_torch
class Resume(unittest.TestCase):
    def test_resume_in_a_new_process_is_bit_identical(self):
        self.check_resume("cpu")

    @unittest.skipIf(torch is None or not torch.cuda.is_available(), "no CUDA device for torch")
    def test_resume_on_the_gpu_is_bit_identical(self):
        self.check_resume("cuda")

    def check_resume(self, device):
        with tempfile.TemporaryDirectory(prefix="pacer-resume-") as tmp:
            data = os.path.join(tmp, "tokens")
            rng = np.random.default_rng(0)
            pacer.data.write_tokens(data, [rng.integers(1, 97, size=int(n)).tolist()
                                           for n in rng.integers(5, 40, size=200)], dtype="int32")
            env = dict(os.environ, OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")

            def run(root, mode):
                r = subprocess.run([sys.executable, os.path.join(HERE, "ckpt_resume_train.py"), data, root, mode, device],
                                   capture_output=True, text=True, env=env, timeout=300)
                self.assertEqual(r.returncode, 0, r.stderr)
                return json.loads(r.stdout) if r.stdout.strip() else None

            full = run(os.path.join(tmp, "unused"), "full")
            root = os.path.join(tmp, "ckpt")
            run(root, "first")
            resumed = run(root, "resume")
            self.assertEqual(len(full), 20)
            self.assertEqual(resumed, full)  # == on floats: bit-identical
            self.assertNotEqual(full[0], full[1])


if __name__ == "__main__":
    unittest.main()
