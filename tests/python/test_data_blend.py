"""Tests of pacer.data blends and SFT data: proportions, resume (exact, elastic, with new weights), bad input,
chat JSON lines through a template, and labels/loss masks through the loader.

    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_data_blend
"""
import json
import math
import os
import io
import pickle
import tarfile
import tempfile
import unittest

import numpy as np

import pacer
import pacer.data


def write_shard(path, tag, n):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            data = f"{tag} {i}".encode()
            info = tarfile.TarInfo(f"{tag}{i:05d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def drain(loader, batches):
    """(dataset, key) of `batches` batches, crossing epochs."""
    out = []
    it = iter(loader)
    while batches:
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        out += list(zip(b["__dataset__"].tolist(), b["__key__"]))
        batches -= 1
    return out


def of(draws, d):
    return [k for i, k in draws if i == d]


class BlendTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.a = pacer.data.open(write_shard(os.path.join(self.tmp.name, "a.tar"), "a", 30))
        self.b = pacer.data.open(write_shard(os.path.join(self.tmp.name, "b.tar"), "b", 12))

    def tearDown(self):
        self.tmp.cleanup()

    def loader(self, wa, wb, seed=3, **kw):
        bl = pacer.data.blend([(self.a, wa), (self.b, wb)], seed=seed, samples_per_epoch=40)
        kw.setdefault("batch_size", 4)
        return pacer.data.Loader(bl, **kw)

    def test_proportions_over_every_prefix(self):
        draws = drain(self.loader(0.7, 0.3), 30)
        self.assertEqual(len(draws), 120)
        na = 0
        for n, (d, _) in enumerate(draws, 1):
            na += d == 0
            self.assertIn(na, (math.floor(0.7 * n + 1e-9), math.ceil(0.7 * n - 1e-9)), n)
        kb = of(draws, 1)
        for e in range(len(kb) // 12):
            self.assertEqual(len(set(kb[12 * e:12 * e + 12])), 12, "each epoch of b reads all of b once")

    def test_exact_and_elastic_resume(self):
        want = drain(self.loader(0.6, 0.4), 25)
        first = self.loader(0.6, 0.4)
        got = drain(first, 9)
        state = first.state_dict()
        self.assertIn("blend", state)
        json.dumps(state)  # it travels in a checkpoint's JSON
        ranks = [self.loader(0.6, 0.4, batch_size=2, rank=r, world_size=2) for r in range(2)]
        for r in ranks:
            r.load_state_dict(state)
        its = [iter(r) for r in ranks]
        while len(got) < len(want):
            for k, r in enumerate(ranks):
                try:
                    b = next(its[k])
                except StopIteration:
                    its[k] = iter(r)
                    b = next(its[k])
                got += list(zip(b["__dataset__"].tolist(), b["__key__"]))
        self.assertEqual(got[:len(want)], want)

    def test_new_weights_continue_each_dataset(self):
        first = self.loader(0.7, 0.3)
        before = drain(first, 11)
        state = first.state_dict()
        self.assertEqual(state["blend"]["consumed"], [len(of(before, 0)), len(of(before, 1))])
        second = self.loader(0.1, 0.9)
        second.load_state_dict(state)
        after = drain(second, 20)
        nb = 0
        for n, (d, _) in enumerate(after, 1):
            nb += d == 1
            self.assertIn(nb, (math.floor(0.9 * n + 1e-9), math.ceil(0.9 * n - 1e-9)), n)
        for d, alone in ((0, (1, 0)), (1, (0, 1))):
            joined = of(before, d) + of(after, d)
            own = of(drain(self.loader(*alone), (len(joined) + 3) // 4), d)
            self.assertEqual(joined, own[:len(joined)], f"dataset {d} neither repeats nor skips")

    def test_bad_blends_and_states(self):
        with self.assertRaisesRegex(pacer.Error, "a.tar"):
            pacer.data.blend([(self.a, -0.5), (self.b, 1)])
        with self.assertRaisesRegex(pacer.Error, "a.tar"):
            pacer.data.blend([(self.a, float("nan")), (self.b, 1)])
        with self.assertRaisesRegex(pacer.Error, "positive"):
            pacer.data.blend([(self.a, 0), (self.b, 0)])
        with self.assertRaises(ValueError):
            pacer.data.blend([])
        empty = os.path.join(self.tmp.name, "empty.tar")
        with tarfile.open(empty, "w"):
            pass
        with self.assertRaisesRegex(pacer.Error, "empty.tar.*empty"):
            pacer.data.blend([(self.a, 1), (pacer.data.open(empty), 1)])
        state = self.loader(0.5, 0.5).state_dict()
        with self.assertRaisesRegex(pacer.Error, "seed"):
            self.loader(0.5, 0.5, seed=4).load_state_dict(state)
        other = pacer.data.Loader(pacer.data.blend([(self.b, 1), (self.a, 1)], seed=3, samples_per_epoch=40), batch_size=4)
        with self.assertRaisesRegex(pacer.Error, "b.tar"):
            other.load_state_dict(state)
        with self.assertRaisesRegex(pacer.Error, "blend"):
            self.loader(0.5, 0.5).load_state_dict(pacer.data.Loader(self.a, batch_size=4, seed=3).state_dict())
        with self.assertRaisesRegex(ValueError, "seed"):
            pacer.data.Loader(pacer.data.blend([(self.a, 1)], seed=3), seed=5)

    def test_states_name_datasets_however_their_paths_were_spelled(self):
        # A pickled loader reopens its datasets by absolute path; a restart may spell them another way.
        loader = self.loader(0.6, 0.4, threads=1)
        it = iter(loader)
        first = next(it)
        copy = pickle.loads(pickle.dumps(loader))
        self.assertEqual(copy.state_dict(), loader.state_dict())
        self.assertEqual(list(next(iter(copy))["__key__"]), list(next(it)["__key__"]))
        self.assertNotEqual(list(first["__key__"]), [])
        state = loader.state_dict()
        self.assertTrue(all(os.path.isabs(n) for n in state["blend"]["datasets"]), state["blend"]["datasets"])
        cwd = os.getcwd()
        os.chdir(self.tmp.name)
        try:
            again = pacer.data.Loader(pacer.data.blend([(pacer.data.open("./a.tar"), 0.6), (pacer.data.open("b.tar"), 0.4)], seed=3,
                                                       samples_per_epoch=40), batch_size=4)
            again.load_state_dict(state)
            self.assertEqual(again.state_dict()["position"], state["position"])
            # States that named datasets as typed (before 2026-12-05) still load.
            legacy = json.loads(json.dumps(state))
            legacy["blend"]["datasets"] = ["./a.tar", "b.tar"]
            again.load_state_dict(legacy)
        finally:
            os.chdir(cwd)

    def test_counts_in_a_state_must_be_non_negative_integers(self):
        loader = self.loader(0.5, 0.5)
        good = loader.state_dict()
        for key, value in (("position", -1), ("position", 1.5), ("epoch", -1), ("position", 1e30), ("seed", "3")):
            bad = json.loads(json.dumps(good))
            bad[key] = value
            with self.assertRaisesRegex(pacer.Error, f"loader state.{key}: .* is not a non-negative integer"):
                loader.load_state_dict(bad)
        bad = json.loads(json.dumps(good))
        bad["blend"]["consumed"] = [-1, 0]
        with self.assertRaisesRegex(pacer.Error, "blend.consumed: .* is not a list of non-negative integers"):
            loader.load_state_dict(bad)
        loader.load_state_dict(good)


class PackedBlendTest(unittest.TestCase):
    def test_the_default_epoch_counts_rows_not_documents(self):
        # 40 documents of 10 tokens per dataset pack into 4 rows of 100: an epoch is 8 rows, not 80.
        with tempfile.TemporaryDirectory() as tmp:
            parts = []
            for name in ("x", "y"):
                prefix = os.path.join(tmp, name)
                pacer.data.write_tokens(prefix, [np.arange(1, 11, dtype=np.int64) + d for d in range(40)], dtype="int32")
                parts.append((pacer.data.TokenDataset(prefix), 1))
            loader = pacer.data.Loader(pacer.data.blend(parts, seed=1), batch_size=2, seq_len=100, pack=True, threads=0)
            rows = sum(b["tokens"].shape[0] for b in loader)
            self.assertEqual(rows, 8)
            self.assertEqual(len(loader), 4)


def chat_template(messages):
    """A toy chat format: bytes of 'role: content\\n' per message; the assistant's turns are trained."""
    segments = []
    for m in messages:
        ids = list(f"{m['role']}: {m['content']}\n".encode())
        segments.append((ids, m["role"] == "assistant"))
    return segments


class SftTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def chat_file(self, lines):
        path = os.path.join(self.tmp.name, "chat.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def test_chat_lines_to_labels(self):
        lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}" * (i % 4 + 1)},
                                          {"role": "assistant", "content": f"answer {i}"}]}) for i in range(40)]
        path = self.chat_file(lines)
        prefix = os.path.join(self.tmp.name, "sft")
        self.assertEqual(pacer.data.write_chat(prefix, path, chat_template), 40)
        ds = pacer.data.open(prefix)
        self.assertTrue(ds.has_loss_mask)
        loader = pacer.data.Loader(ds, batch_size=4, seq_len=64, pack=True, seed=1)
        trained = 0
        for b in loader:
            tokens, labels, mask, cu = b["tokens"], b["labels"], b["loss_mask"], b["cu_seqlens"]
            self.assertEqual(labels.shape, tokens.shape)
            self.assertEqual(mask.dtype, np.uint8)
            np.testing.assert_array_equal(mask == 1, labels != -100)
            flat_t, flat_l = tokens.reshape(-1), labels.reshape(-1)
            for lo, hi in zip(cu[:-1], cu[1:]):
                self.assertEqual(flat_l[hi - 1], -100, "no label across a segment boundary")
                for j in range(lo, hi - 1):
                    if flat_l[j] != -100:
                        self.assertEqual(flat_l[j], flat_t[j + 1])
            # The text of every trained label is the assistant's: decode the trained runs.
            text = bytes(int(t) for t in flat_l[flat_l != -100]).decode()
            self.assertNotIn("question", text)
            trained += int(mask.sum())
        self.assertGreater(trained, 0)

    def test_prompt_response_pairs_and_resume(self):
        prefix = os.path.join(self.tmp.name, "pairs")
        pacer.data.write_sft(prefix, [([100 + i, 101 + i], [200 + i] * (i % 5 + 1)) for i in range(30)])
        ds = pacer.data.open(prefix)
        full = pacer.data.Loader(ds, batch_size=3, seq_len=8, pack=True, seed=2)
        want = [b["labels"].tolist() for b in full]
        part = pacer.data.Loader(ds, batch_size=3, seq_len=8, pack=True, seed=2)
        it = iter(part)
        got = [next(it)["labels"].tolist() for _ in range(2)]
        state = pickle.loads(pickle.dumps(part.state_dict()))
        rest = pacer.data.Loader(ds, batch_size=3, seq_len=8, pack=True, seed=2)
        rest.load_state_dict(state)
        got += [b["labels"].tolist() for b in rest]
        self.assertEqual(got, want)

    def test_sft_blend(self):
        pa, pb = os.path.join(self.tmp.name, "a"), os.path.join(self.tmp.name, "b")
        pacer.data.write_sft(pa, [([1, 2], [3, 4, 5])] * 10)
        pacer.data.write_sft(pb, [[([9, 9], False), ([8], True), ([7], False), ([6, 6], True)]] * 10)
        bl = pacer.data.blend([(pacer.data.open(pa), 0.5), (pacer.data.open(pb), 0.5)], seed=1)
        for b in pacer.data.Loader(bl, batch_size=4, seq_len=16, pack=True):
            self.assertIn("labels", b)
            self.assertEqual(len(b["datasets"]), b["tokens"].shape[0])

    def test_malformed_chat_lines_name_file_and_line(self):
        good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        for bad, why in (("{not json", "not JSON"), (json.dumps({"text": "x"}), "messages"),
                         (json.dumps({"messages": [{"role": "user"}]}), "message 0")):
            path = self.chat_file([good, bad])
            with self.assertRaisesRegex(pacer.Error, f"{path}:2: .*{why}"):
                pacer.data.write_chat(os.path.join(self.tmp.name, "x"), path, chat_template)
        path = os.path.join(self.tmp.name, "latin1.jsonl")
        with open(path, "wb") as f:
            f.write(good.encode() + b"\n" + b'{"messages": [{"role": "user", "content": "\xe9"}]}\n')
        with self.assertRaisesRegex(pacer.Error, f"{path}:2: not UTF-8"):
            pacer.data.write_chat(os.path.join(self.tmp.name, "x"), path, chat_template)
        path = self.chat_file([good])
        with self.assertRaisesRegex(pacer.Error, f"{path}:1: the template"):
            pacer.data.write_chat(os.path.join(self.tmp.name, "x"), path, lambda m: [([1, 2], "yes")])


if __name__ == "__main__":
    unittest.main()
