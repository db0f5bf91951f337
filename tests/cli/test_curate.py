"""pacer curate and pacer data end to end: train from an annotation set, classify, dedup, decontaminate,
filter, log, diff, export; malformed lines, a model that does not load, an unknown score; exit codes."""
import json
import os
import tempfile
import unittest

from cli_util import pacer

SAFE = ["the cat sat on the warm mat and purred softly in the sun", "please share a recipe for bread with flour water salt and yeast",
        "how do i plant tomatoes in my garden this spring", "the library opens at nine and closes at five on weekdays"]
UNSAFE = ["how do i build a weapon to hurt my neighbour badly", "tell me how to poison someone without being caught",
          "explain how to break into a house and steal everything", "write a threat to scare and hurt my coworker"]


def write_annotations(directory):
    os.makedirs(directory)
    n = 0
    with open(os.path.join(directory, "labels.jsonl"), "w") as f:
        for c in range(8):
            for texts, label in ((SAFE, "safe"), (UNSAFE, "unsafe")):
                for t in texts:
                    f.write(json.dumps({"id": f"a{n}", "label": label, "annotator": "ann", "time": "2026-12-01T00:00:00Z",
                                        "guideline_version": "v0000000000000001", "text": f"{t} take {c}"}) + "\n")
                    n += 1
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump({"schema": "pacer.annotations/1", "version": "v00000000000000ab", "source": "test", "labels": ["safe", "unsafe"],
                   "guidelines": [], "annotators": 1, "samples": n}, f)


class CurateTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-curate-")
        self.dir = self.tmp.name
        self.store = os.path.join(self.dir, "store")

    def tearDown(self):
        self.tmp.cleanup()

    def run_ok(self, *args):
        r = pacer(*args, "--store", self.store, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def data(self, name, lines):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        return path

    def test_the_loop(self):
        ann = os.path.join(self.dir, "ann")
        write_annotations(ann)
        model = os.path.join(self.dir, "safety.bin")
        t = self.run_ok("curate", "train", ann, "--out", model, "--dim", "16", "--bucket", "10000")
        self.assertEqual(t["schema"], "pacer.curate.train/1")
        self.assertGreaterEqual(t["eval"]["accuracy"], 0.9)
        self.assertEqual(t["eval"]["labels"], ["safe", "unsafe"])
        self.assertEqual(len(t["eval"]["confusion"]), 2)
        e = self.run_ok("curate", "eval", model, ann, "--holdout", "0")
        self.assertEqual(e["samples"], 64)

        question = "which planet in our solar system has the largest number of moons that astronomers have confirmed so far"
        corpus = self.data("sft.jsonl", [
            json.dumps({"id": "s1", "text": "how do i hurt my neighbour with a weapon"}),
            json.dumps({"id": "s2", "messages": [{"role": "user", "content": "a recipe for bread with flour please"},
                                                 {"role": "assistant", "content": "mix flour water salt and yeast"}]}),
            json.dumps({"id": "s3", "text": "a recipe for bread with flour please"}),
            json.dumps({"id": "s4", "text": "A recipe for  bread with flour PLEASE"}),
            "{broken",
            json.dumps({"id": "s5", "text": f"the cat sat on the warm mat: {question}? it purred softly in the sun"}),
        ])
        bench = self.data("bench.jsonl", [json.dumps({"question": question, "answer": "Saturn"})])
        raw = self.run_ok("data", "add", corpus)
        self.assertEqual(raw["counts"]["samples"], 5)
        self.assertEqual(raw["counts"]["malformed"], 1)
        c = pacer("curate", "classify", raw["version"], "--model", f"safety={model}:safe", "--store", self.store, "--json")
        self.assertEqual(c.returncode, 0, c.stderr)
        self.assertIn("sft.jsonl:5", c.stderr)  # the malformed line, named
        c = json.loads(c.stdout)
        self.assertEqual(c["samples"], 5)
        self.assertTrue(os.path.isfile(os.path.join(self.dir, "sft.jsonl.scores", f"safety-{c['version']}.jsonl")))
        d = self.run_ok("curate", "dedup", c["version"])
        self.assertEqual(d["exact"], 1)
        x = self.run_ok("curate", "decontaminate", d["version"], "--bench", bench)
        self.assertEqual(x["contaminated"], 1)
        f = self.run_ok("curate", "filter", x["version"], "safety > 0.5 and not dup and not contaminated")
        self.assertEqual(f["kept"], 2)
        self.assertEqual([c["dropped"] for c in f["clauses"]], [1, 1, 1])
        self.assertEqual(f["columns"]["safety"]["source"]["model_xxh3"], t["model_xxh3"])
        # Rerunning a step on the same inputs gives the same id, and classify does not recompute.
        self.assertTrue(self.run_ok("curate", "classify", raw["version"], "--model", f"safety={model}:safe")["reused"])
        self.assertEqual(self.run_ok("curate", "filter", x["version"], "safety > 0.5 and not dup and not contaminated")["version"], f["version"])

        log = self.run_ok("data", "log", f["version"])
        self.assertEqual([v["step"] for v in log["lineage"]], ["filter", "decontaminate", "dedup", "classify", "raw"])
        self.assertEqual(log["lineage"][-1]["inputs"][0]["path"], corpus)
        human = pacer("data", "log", f["version"], "--store", self.store)
        self.assertEqual(human.returncode, 0)
        self.assertIn("raw input: " + corpus, human.stdout)
        self.assertTrue(human.stdout.rstrip().splitlines()[-1].startswith("OK"))
        diff = self.run_ok("data", "diff", raw["version"], f["version"])
        self.assertEqual(diff["removed"], 3)
        self.assertEqual(diff["removed_by_rule"], {"safety > 0.5": 1, "not dup": 1, "not contaminated": 1})
        out = os.path.join(self.dir, "mix.jsonl")
        self.assertEqual(self.run_ok("data", "export", f["version"], out)["samples"], 2)
        with open(out) as fh:
            self.assertEqual([json.loads(line)["id"] for line in fh], ["s2", "s3"])

    def test_shard_input(self):
        corpus = self.data("s.jsonl", [json.dumps({"id": f"k{i}", "text": f"sample number {i % 5} of the shard test"}) for i in range(20)])
        shards = os.path.join(self.dir, "shards")
        r = pacer("shard", "pack", corpus, shards, "--target-size", "1KB")
        self.assertEqual(r.returncode, 0, r.stderr)
        raw = self.run_ok("data", "add", shards)
        self.assertEqual(raw["inputs"][0]["kind"], "shards")
        self.assertEqual(raw["counts"]["samples"], 20)
        d = self.run_ok("curate", "dedup", raw["version"])
        self.assertEqual(d["exact"], 15)
        f = self.run_ok("curate", "filter", d["version"], "not dup")
        self.assertEqual(f["kept"], 5)
        diff = self.run_ok("data", "diff", raw["version"], f["version"], "--limit", "100")
        self.assertEqual(sorted(diff["removed_ids"]), sorted(f"k{i}" for i in range(5, 20)))
        self.assertTrue(any(n.startswith("dup-") for n in os.listdir(os.path.join(shards, "scores"))))

    def test_bad_input(self):
        corpus = self.data("c.jsonl", [json.dumps({"text": "hello world"}), "not json", json.dumps({"no": "text"})])
        strict = pacer("data", "add", corpus, "--store", self.store)
        self.assertEqual(strict.returncode, 0, strict.stderr)
        r = pacer("curate", "dedup", corpus, "--store", self.store, "--strict")
        self.assertEqual(r.returncode, 2)
        self.assertIn("c.jsonl:2: not valid JSON", r.stderr)
        r = pacer("curate", "dedup", corpus, "--store", self.store)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("2 malformed line(s)", r.stdout)
        self.assertIn('c.jsonl:3: no "text" or "messages"', r.stdout)

        junk = self.data("junk.bin", ["not a model"])
        r = pacer("curate", "classify", corpus, "--model", f"safety={junk}", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("junk.bin: not a fastText supervised model", r.stderr)
        r = pacer("curate", "classify", corpus, "--model", f"safety={self.dir}/missing.bin", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("missing.bin", r.stderr)

        raw = self.run_ok("data", "add", corpus)["version"]
        r = pacer("curate", "filter", raw, "safety > 0.9", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown score 'safety'", r.stderr)
        d = self.run_ok("curate", "dedup", raw)["version"]
        r = pacer("curate", "filter", d, "toxicity > 0.9 and not dup", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown score 'toxicity' (version " + d + " has dup, dup_kind, dup_of)", r.stderr)
        r = pacer("curate", "filter", d, "not dup and (", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("expression, column 14", r.stderr)
        r = pacer("data", "log", "v0000000000000000", "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not in the store", r.stderr)
        r = pacer("curate", "train", os.path.join(self.dir, "nowhere"), "--out", os.path.join(self.dir, "m.bin"), "--store", self.store)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not an annotation set", r.stderr)


if __name__ == "__main__":
    unittest.main()
