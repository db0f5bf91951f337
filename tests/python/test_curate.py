"""pacer.curate: a Python callable scores every sample in worker processes, the column filters like a
classifier's; PACER_DATA_VERSION lands in checkpoint meta and the telemetry run."""
import json
import os
import sqlite3
import subprocess
import tempfile
import unittest

import pacer
import pacer.curate
import pacer.telemetry as tm

PACER = os.environ.get("PACER_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/pacer"))


def word_count(text):
    # Module level, so that spawned workers can import it; its pid shows it ran elsewhere.
    return len(text.split())


def worker_pid(text):
    return os.getpid()


class CurateTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-curate-py-")
        self.dir = self.tmp.name
        self.store = os.path.join(self.dir, "store")
        os.environ["PACER_BIN"] = PACER
        self.corpus = os.path.join(self.dir, "c.jsonl")
        with open(self.corpus, "w") as f:
            for i in range(40):
                f.write(json.dumps({"id": f"s{i}", "text": " ".join(["word"] * (i % 7 + 1))}) + "\n")
            f.write("{broken\n")

    def tearDown(self):
        self.tmp.cleanup()

    def test_callable_column_then_filter(self):
        samples = pacer.curate.samples(self.corpus, store=self.store)
        self.assertEqual(len(samples), 40)
        self.assertEqual(samples[3], {"input": 0, "row": 4, "id": "s3", "text": "word word word word"})
        version = pacer.curate.classify(self.corpus, "words", word_count, processes=2, store=self.store)
        self.assertTrue(version.startswith("v") and len(version) == 17)
        # The same callable over the same samples: the same version.
        self.assertEqual(pacer.curate.classify(self.corpus, "words", word_count, processes=2, store=self.store), version)
        r = subprocess.run([PACER, "curate", "filter", version, "words >= 4", "--store", self.store, "--json"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        self.assertEqual(out["kept"], sum(1 for i in range(40) if i % 7 + 1 >= 4))
        self.assertEqual(out["columns"]["words"]["source"]["callable"], __name__ + ".word_count")
        pids = pacer.curate.classify(self.corpus, "pid", worker_pid, processes=2, store=self.store)
        col = [c for c in json.loads(subprocess.run([PACER, "data", "log", pids, "--store", self.store, "--json"], capture_output=True,
                                                    text=True).stdout)["lineage"][0]["columns"].items() if c[0] == "pid"][0][1]
        with open(col["files"][0]) as f:
            values = {json.loads(line) for line in f} - {None}
        self.assertNotIn(os.getpid(), values)  # scored in worker processes

    def test_bad_callable_result_and_unknown_version(self):
        with self.assertRaises(pacer.curate.Error):
            pacer.curate.classify(self.corpus, "bad", list, processes=1, store=self.store)
        with self.assertRaises(pacer.curate.Error) as e:
            pacer.curate.samples("v0000000000000000", store=self.store)
        self.assertIn("not in the store", str(e.exception))

    def test_data_version_in_checkpoints_and_telemetry(self):
        os.environ["PACER_DATA_VERSION"] = "v00000000000000cd"
        try:
            db = os.path.join(self.dir, "t.db")
            tm.open(db, rank=0)
            tm.step(step=0, loss=1.0)
            tm.close()
            with sqlite3.connect(db) as c:
                self.assertEqual(c.execute("SELECT detail FROM events WHERE kind='data.version'").fetchall(), [("v00000000000000cd",)])
            import numpy as np
            ck = pacer.Checkpointer(os.path.join(self.dir, "ck"))
            ck.save(1, {"w": np.zeros(4, dtype=np.float32)}).wait()
            self.assertEqual(ck.load().meta["data_version"], "v00000000000000cd")
            ck.save(2, {"w": np.zeros(4, dtype=np.float32)}, meta={"data_version": "mine"}).wait()
            self.assertEqual(ck.load().meta["data_version"], "mine")
        finally:
            del os.environ["PACER_DATA_VERSION"]


if __name__ == "__main__":
    unittest.main()
