"""Tests of pacer.data.tokenize: a SentencePiece model trained here (spm_train) on license texts Debian ships,
and Python callables run in worker processes; both write the same dataset and manifest.
    PYTHONPATH=BUILD/python PACER_BIN=BUILD/bin/pacer /usr/bin/python3 -m unittest -v test_tokenize
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import sentencepiece as spm

import pacer
import pacer.data

LICENSES = "/usr/share/common-licenses/"


def read(path):
    with open(path, "rb") as f:
        return f.read()


class SpmCallable:
    """A callable that says which model file it reads, as pacer.data.tokenize looks for."""

    def __init__(self, path):
        self.model_file = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.n_vocab = self.sp.vocab_size()
        self.eos_token_id = self.sp.eos_id()

    def __call__(self, text):
        return self.sp.encode(text)


def utf8_bytes(text):
    return list(text.encode("utf-8"))


def raises(text):
    if "Lesser" in text:
        raise ValueError("this tokenizer refuses the Lesser GPL")
    return [1]


@unittest.skipUnless(shutil.which("spm_train"), "needs spm_train (Debian's sentencepiece, which scripts/deps.sh installs)")
class Tokenize(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pacer-pytok-")
        cls.dir = cls.tmp.name
        corpus = os.path.join(cls.dir, "corpus.txt")
        with open(corpus, "wb") as f:
            f.write(read(LICENSES + "GPL-3") + read(LICENSES + "Apache-2.0"))
        subprocess.run(["spm_train", f"--input={corpus}", f"--model_prefix={cls.dir}/tok", "--vocab_size=400", "--model_type=bpe",
                        "--byte_fallback=true", "--character_coverage=1.0", "--normalization_rule_name=identity",
                        "--remove_extra_whitespaces=false", "--minloglevel=2"], check=True, capture_output=True)
        cls.model = os.path.join(cls.dir, "tok.model")
        cls.text = os.path.join(cls.dir, "licenses.txt")
        with open(cls.text, "wb") as f:
            for name in ("GPL-2", "LGPL-2.1", "GFDL-1.3", "GPL-3", "Artistic", "MPL-2.0"):
                f.write(read(LICENSES + name))
        cls.lines = [l for l in read(cls.text).decode().split("\n") if l]
        cls.jsonl = os.path.join(cls.dir, "bsd.jsonl")
        cls.bsd = [l for l in read(LICENSES + "BSD").decode().split("\n") if l]
        with open(cls.jsonl, "w") as f:
            for l in cls.bsd:
                f.write(json.dumps({"text": l, "n": 1}) + "\n")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def prefix(self, name):
        return os.path.join(self.dir, name)

    def test_model_file_and_callable_write_the_same_dataset(self):
        a = pacer.data.tokenize([self.text, self.jsonl], self.prefix("a"), tokenizer=self.model, threads=2, chunk_bytes=8192)
        b = pacer.data.tokenize([self.text, self.jsonl], self.prefix("b"), tokenizer=SpmCallable(self.model), threads=2,
                                chunk_bytes=8192)
        self.assertEqual(read(self.prefix("a") + ".bin"), read(self.prefix("b") + ".bin"))
        self.assertEqual(read(self.prefix("a") + ".idx"), read(self.prefix("b") + ".idx"))
        self.assertEqual(a["documents"], len(self.lines) + len(self.bsd))
        self.assertEqual(a["tokenizer"]["kind"], "sentencepiece")
        self.assertEqual(b["tokenizer"]["kind"], "callable")
        self.assertEqual(b["tokenizer"]["name"], f"{__name__}.SpmCallable")
        self.assertEqual(b["tokenizer"]["path"], self.model)
        self.assertEqual(b["tokenizer"]["xxh3"], a["tokenizer"]["xxh3"])  # the same file, the same checksum
        self.assertEqual([i["xxh3"] for i in a["inputs"]], [i["xxh3"] for i in b["inputs"]])
        with open(self.prefix("b") + ".manifest.json") as f:
            m = json.load(f)
        self.assertEqual(m["schema"], "pacer.tokens/1")
        self.assertEqual(m["eod"], 2)
        self.assertEqual(m["bin"]["xxh3"], b["bin"]["xxh3"])

        # Decoded, every document is its line, ending with eos.
        sp = spm.SentencePieceProcessor(model_file=self.model)
        ds = pacer.data.open(self.prefix("b"))
        self.assertEqual(ds.documents, a["documents"])
        for d, line in enumerate(self.lines + self.bsd):
            ids = ds[d].tolist()
            self.assertEqual(ids[-1], 2)
            self.assertEqual(sp.decode(ids[:-1]), line)

    def test_a_lambda_in_worker_processes_keeps_the_order(self):
        r = pacer.data.tokenize(self.text, self.prefix("lam"), tokenizer=lambda s: list(s.encode()), vocab_size=257, eod=256, threads=3,
                                chunk_bytes=4096)  # dozens of chunks over three processes
        self.assertEqual(r["threads"], 3)
        self.assertTrue(r["tokenizer"]["name"].endswith("<lambda>"))
        ds = pacer.data.open(self.prefix("lam"))
        self.assertEqual(ds.documents, len(self.lines))
        for d, line in enumerate(self.lines):
            ids = ds[d].tolist()
            self.assertEqual(ids[-1], 256)
            self.assertEqual(bytes(ids[:-1]).decode(), line)

    def test_invalid_utf8_is_replaced_as_python_does_or_skipped_or_fails(self):
        bad = [b"ok line", b"\xff start", b"cut \xe2\x82 here", b"surrogate \xed\xa0\x80", b"four \xf0\x9f\x98", b"overlong \xc0\xaf",
               b"past \xf4\x90\x80\x80 max", b"a\x80b", b"fine \xe2\x82\xac"]
        path = os.path.join(self.dir, "bad.txt")
        with open(path, "wb") as f:
            f.write(b"\n".join(bad) + b"\n")
        r = pacer.data.tokenize(path, self.prefix("bad"), tokenizer=utf8_bytes, vocab_size=256, eod=None)
        self.assertEqual(r["inputs"][0]["bad_utf8"], 7)
        self.assertEqual(r["inputs"][0]["first_bad_utf8_line"], 2)
        ds = pacer.data.open(self.prefix("bad"))
        self.assertEqual([bytes(ds[d].tolist()) for d in range(ds.documents)], [l.decode("utf-8", "replace").encode() for l in bad])
        r = pacer.data.tokenize(path, self.prefix("skip"), tokenizer=utf8_bytes, vocab_size=256, eod=None, bad_utf8="skip")
        self.assertEqual((r["documents"], r["bad_utf8_documents"]), (2, 7))
        with self.assertRaisesRegex(pacer.Error, "bad.txt:2: not valid UTF-8"):
            pacer.data.tokenize(path, self.prefix("fail"), tokenizer=utf8_bytes, vocab_size=256, eod=None, bad_utf8="fail")

    def test_errors_name_the_file(self):
        with self.assertRaisesRegex(pacer.Error, "licenses.txt: lines .*ValueError.*refuses the Lesser GPL"):
            pacer.data.tokenize(self.text, self.prefix("e1"), tokenizer=raises, vocab_size=2, eod=None, threads=2)
        with self.assertRaisesRegex(pacer.Error, r"bsd.jsonl:\d+: token id 9\d+ outside"):
            pacer.data.tokenize(self.jsonl, self.prefix("e2"), tokenizer=lambda s: [900 + len(s) % 10], vocab_size=10, eod=None)
        with self.assertRaisesRegex(ValueError, "eos"):
            pacer.data.tokenize(self.jsonl, self.prefix("e3"), tokenizer=utf8_bytes, vocab_size=256)
        with self.assertRaisesRegex(ValueError, "vocab_size"):
            pacer.data.tokenize(self.jsonl, self.prefix("e4"), tokenizer=utf8_bytes, eod=None)
        not_a_model = os.path.join(self.dir, "licenses.model")
        with open(not_a_model, "wb") as f:
            f.write(read(LICENSES + "BSD"))
        with self.assertRaisesRegex(pacer.Error, "licenses.model: not a SentencePiece model"):
            pacer.data.tokenize(self.jsonl, self.prefix("e5"), tokenizer=not_a_model)
        for name in ("e1", "e2", "e5"):
            self.assertFalse(os.path.exists(self.prefix(name) + ".bin"))


if __name__ == "__main__":
    unittest.main()
