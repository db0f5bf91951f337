"""pacer query and pacer catalog merge on the real binary, over catalogs written by pacer monitor."""
import csv
import io
import json
import os
import sqlite3
import subprocess
import tempfile
import unittest

from cli_util import PACER, pacer


class QueryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.db = os.path.join(cls.tmp.name, "q.db")
        steps = os.path.join(cls.tmp.name, "steps.jsonl")
        with open(steps, "w") as f:
            for i in range(10):
                # Rank 0 waits for data a quarter of each 1 s step, rank 1 a tenth.
                for rank, wait in ((0, 0.25), (1, 0.1)):
                    f.write(json.dumps({"step": i, "t": 1000 + i, "step_time_s": 3.0 if i == 6 else 1.0,
                                        "data_wait_s": wait, "comm_s": 0.05, "rank": rank}) + "\n")
        r = pacer("monitor", "--interval", "100ms", "--db", cls.db, "--no-gpu", "--steps", steps, "--", "sleep", "0.3")
        assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_named_question_as_table_json_and_csv(self):
        r = pacer("query", self.db, "data-wait")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("data_wait_share", r.stdout)
        self.assertTrue(r.stdout.rstrip().endswith("OK: 2 row(s)"))
        j = json.loads(pacer("query", self.db, "data-wait", "--json").stdout)
        self.assertEqual(j["schema"], "pacer.query/1")
        self.assertEqual(j["question"], "data-wait")
        shares = {row["rank"]: row["data_wait_share"] for row in j["rows"]}
        self.assertAlmostEqual(shares[0], 2.5 / 12, places=4)
        self.assertAlmostEqual(shares[1], 1.0 / 12, places=4)
        rows = list(csv.DictReader(io.StringIO(pacer("query", self.db, "slowest-steps", "--limit", "1", "--csv").stdout)))
        self.assertEqual({r["step"] for r in rows}, {"6"})
        self.assertEqual(rows[0]["step_time_s"], "3")

    def test_run_limits_a_question_and_is_checked(self):
        two = os.path.join(self.tmp.name, "two.db")
        with open(self.db, "rb") as src, open(two, "wb") as dst:
            dst.write(src.read())
        steps = os.path.join(self.tmp.name, "steps2.jsonl")
        with open(steps, "w") as f:
            f.write(json.dumps({"step": 0, "t": 5000, "step_time_s": 2.0, "data_wait_s": 1.0, "rank": 0}) + "\n")
        r = pacer("monitor", "--interval", "100ms", "--db", two, "--no-gpu", "--steps", steps, "--", "true")
        self.assertEqual(r.returncode, 0, r.stderr)
        both = list(csv.DictReader(io.StringIO(pacer("query", two, "data-wait", "--csv").stdout)))
        self.assertEqual(sorted({row["run_id"] for row in both}), ["1", "2"])
        only = list(csv.DictReader(io.StringIO(pacer("query", two, "data-wait", "--run", "2", "--csv").stdout)))
        self.assertEqual([(row["run_id"], row["rank"], row["data_wait_share"]) for row in only], [("2", "0", "0.5")])
        slow = list(csv.DictReader(io.StringIO(pacer("query", two, "slowest-steps", "--run", "1", "--csv").stdout)))
        self.assertEqual({row["run_id"] for row in slow}, {"1"})
        self.assertEqual(len(slow), 10)
        r = pacer("query", two, "data-wait", "--run", "9")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertRegex(r.stderr, r"two\.db: no run 9 in the catalog; its runs: 2 \(\S+Z: true\), 1 \(\S+Z: sleep 0\.3\)")
        r = pacer("query", two, "SELECT count(*) FROM steps", "--run", "1")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("WHERE run_id = 1", r.stderr)

    def test_any_sql_and_its_errors(self):
        r = pacer("query", self.db, "SELECT count(*) AS n FROM steps", "--json")
        self.assertEqual(json.loads(r.stdout)["rows"], [{"n": 20}])
        r = pacer("query", self.db, "SELECT nope FROM steps")
        self.assertEqual(r.returncode, 2)
        self.assertIn("SQL error", r.stderr)
        r = pacer("query", self.db, "fastest-steps")
        self.assertEqual(r.returncode, 2)
        self.assertIn("known: slowest-steps", r.stderr)
        r = pacer("query", os.path.join(self.tmp.name, "none.db"), "throttle")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no such catalog", r.stderr)
        # The catalog is opened read-only: a query cannot change it.
        r = pacer("query", self.db, "DELETE FROM steps")
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(json.loads(pacer("query", self.db, "SELECT count(*) AS n FROM steps", "--json").stdout)["rows"][0]["n"], 20)

    def test_statements_that_write_files_are_refused(self):
        copy = os.path.join(self.tmp.name, "copy.db")
        for sql in (f"VACUUM INTO '{copy}'", f"ATTACH DATABASE '{copy}' AS x", "PRAGMA query_only = 0",
                    "PRAGMA journal_mode = DELETE", "CREATE TEMP TABLE t(x)"):
            with self.subTest(sql):
                r = pacer("query", self.db, sql)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("refused", r.stderr)
                self.assertFalse(os.path.exists(copy), f"{sql!r} wrote a file")

    def test_a_query_without_end_stops_at_the_time_limit(self):
        endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
        r = pacer("query", self.db, endless, "--timeout", "0.5", timeout=60)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("time limit of 0.5 s", r.stderr)
        for bad in ("-1", "nan", "inf"):
            r = pacer("query", self.db, "SELECT 1", "--timeout", bad)
            self.assertEqual(r.returncode, 2, bad)
        self.assertEqual(pacer("query", self.db, "SELECT 1", "--timeout", "0").returncode, 0)

    def test_list_and_empty_answers(self):
        r = pacer("query", "--list")
        for q in ("slowest-steps", "hot-nodes", "data-wait", "throttle"):
            self.assertIn(q, r.stdout)
        r = pacer("query", self.db, "throttle")  # no GPU here, no throttling
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: 0 row(s)", r.stdout)

    def test_newer_schema_is_refused(self):
        newer = os.path.join(self.tmp.name, "newer.db")
        with open(self.db, "rb") as src, open(newer, "wb") as dst:
            dst.write(src.read())
        with sqlite3.connect(newer) as c:
            c.execute("PRAGMA user_version=2")
        r = pacer("query", newer, "data-wait")
        self.assertEqual(r.returncode, 2)
        self.assertIn("schema version 2 is newer than this pacer understands", r.stderr)
        r = pacer("catalog", "merge", os.path.join(self.tmp.name, "m.db"), newer)
        self.assertEqual(r.returncode, 2)
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "m.db")))


class MergeTest(unittest.TestCase):
    def test_per_node_files_of_one_job_merge_into_one_run(self):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1")
            parts = []
            for name in ("a", "b"):
                db = os.path.join(tmp, f"{name}.db")
                subprocess.run([PACER, "monitor", "--interval", "100ms", "--db", db, "--no-gpu", "-q", "--", "true"],
                               env=env, check=True, timeout=60)
                parts.append(db)
            out = os.path.join(tmp, "job.db")
            r = pacer("catalog", "merge", out, *parts, "--json")
            self.assertEqual(r.returncode, 0, r.stderr)
            j = json.loads(r.stdout)
            self.assertEqual((j["schema"], j["runs"]), ("pacer.catalog.merge/1", 1))
            with sqlite3.connect(out) as c:
                n_in = sum(sqlite3.connect(p).execute("SELECT count(*) FROM samples").fetchone()[0] for p in parts)
                self.assertEqual(c.execute("SELECT count(*) FROM samples").fetchone()[0], n_in)
                self.assertEqual(c.execute("SELECT job_id FROM runs").fetchall(), [("4242",)])
            self.assertFalse(os.path.exists(out + ".merge-tmp"))

            # Again, and one part twice: nothing is counted twice, each skip is said.
            r = pacer("catalog", "merge", out, parts[0], parts[0], parts[1], "--json")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("same file as", r.stderr)
            self.assertIn("already in", r.stderr)
            self.assertEqual(len(json.loads(r.stdout)["skipped"]), 3)
            with sqlite3.connect(out) as c:
                self.assertEqual(c.execute("SELECT count(*) FROM samples").fetchone()[0], n_in)
            # Into itself: a usage error.
            r = pacer("catalog", "merge", out, out)
            self.assertEqual(r.returncode, 2)
            self.assertIn("itself", r.stderr)


if __name__ == "__main__":
    unittest.main()
