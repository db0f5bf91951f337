"""pacer.telemetry from Python: steps reach the catalog with rank and node, the loop never waits, drops are counted."""
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import pacer
import pacer.telemetry as tm


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


class TelemetryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.db = os.path.join(self.dir.name, "t.db")

    def tearDown(self):
        tm.close()
        self.dir.cleanup()

    def test_steps_land_with_rank_node_and_extra(self):
        tm.open(self.db, rank=4)
        for i in range(50):
            self.assertTrue(tm.step(step=i, loss=np.float32(2.0 - i / 100), tokens=4096, data_wait_s=0.01, comm_s=0.02, lr=3e-4,
                                    flops=np.float64(2.5e13) if i % 2 else None))
        tm.event("checkpoint.saved", {"step": 49})
        tm.flush()
        self.assertEqual(tm.written(), 51)
        self.assertEqual(tm.dropped(), 0)
        tm.close()
        got = rows(self.db, "SELECT count(*), min(rank), max(rank), min(tokens) FROM steps")
        self.assertEqual(got, [(50, 4, 4, 4096.0)])
        self.assertEqual(rows(self.db, "SELECT DISTINCT n.hostname FROM steps JOIN nodes n USING(node_id)"),
                         [(socket.gethostname(),)])
        extra = rows(self.db, "SELECT extra FROM steps WHERE step=7")[0][0]
        self.assertIn('"lr": 0.0003', extra)
        self.assertNotIn("flops", extra)  # a field of its own, not an extra
        self.assertEqual(rows(self.db, "SELECT count(*), min(flops), max(flops) FROM steps WHERE flops IS NOT NULL"), [(25, 2.5e13, 2.5e13)])
        self.assertEqual(rows(self.db, "SELECT count(*) FROM steps WHERE flops IS NULL AND step % 2 = 0"), [(25,)])
        self.assertEqual(rows(self.db, "SELECT detail FROM events WHERE kind='checkpoint.saved'"), [('{"step": 49}',)])

    def test_full_queue_drops_and_never_blocks(self):
        tm.open(self.db, rank=0, queue_capacity=16, flush_interval_s=3600)
        accepted = sum(tm.step(step=i) for i in range(1000))
        self.assertEqual(accepted, 16)
        self.assertEqual(tm.dropped(), 984)
        tm.flush()
        self.assertEqual(tm.written(), 16)

    def test_rank_from_environment_and_db_from_monitor_variable(self):
        # A child process as `pacer monitor` would start it: the catalog and
        # run come from the environment, the rank from SLURM_PROCID.
        env = dict(os.environ, PACER_TELEMETRY_DB=self.db, SLURM_PROCID="7", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
        code = "import pacer.telemetry as tm\nfor i in range(5): tm.step(step=i, loss=1.0)\n"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)  # closed at exit
        self.assertEqual(rows(self.db, "SELECT count(*), min(rank) FROM steps"), [(5, 7)])

    def test_steps_without_a_sampler_are_scored_unknown_not_idle(self):
        """A train.py that logs steps through pacer.telemetry, not under pacer monitor: nothing says the GPUs idled."""
        tm.open(self.db, rank=0)
        for i in range(20):
            tm.step(step=i, loss=2.0 - i / 100, tokens=4096, data_wait_s=0.001, comm_s=0.0, step_time_s=0.1)
        tm.close()
        pacer_bin = os.environ.get("PACER_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/pacer"))
        r = subprocess.run([pacer_bin, "score", self.db, "--json"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        verdict = json.loads(r.stdout)["verdict"]
        self.assertEqual(verdict["kind"], "unknown", verdict["sentence"])
        self.assertIn("no sampler data for this run, only 20 training steps", verdict["sentence"])

    def test_bad_values_raise_pacer_error(self):
        tm.open(self.db, rank=0)
        with self.assertRaises(pacer.Error):
            tm.step(step=1, loss="low")
        with self.assertRaises(pacer.Error):
            tm.step(step=1, flops="many")

    def test_newer_catalog_is_refused(self):
        tm.open(self.db, rank=0)
        tm.close()
        with sqlite3.connect(self.db) as c:
            c.execute("PRAGMA user_version=9")
        with self.assertRaisesRegex(pacer.Error, "schema version 9 is newer"):
            tm.open(self.db, rank=0)

    def test_step_is_cheap(self):
        # Not a timing assertion: the loop finishes and every record is
        # accounted for as written or dropped.
        tm.open(self.db, rank=0, queue_capacity=1 << 20)
        n = 20000
        for i in range(n):
            tm.step(step=i, loss=1.0)
        tm.flush()
        self.assertEqual(tm.written() + tm.dropped(), n)


if __name__ == "__main__":
    unittest.main()
