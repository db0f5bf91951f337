"""pacer goodput on catalogs of real short runs: each loss in its bucket, and the parts sum to the whole."""
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import unittest

from cli_util import PACER, pacer
from test_report import browse, chromium

PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.environ.get("PACER_PYTHONPATH", os.path.join(os.path.dirname(os.path.abspath(PACER)), os.pardir, "python"))
LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goodput_loop.py")


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PACER_TELEMETRY", "RANK"))}
    e["PYTHONPATH"] = PYTHONPATH
    return e


def supervised(db, ckpt, *loop_args):
    """LOOP under `pacer run --monitor` (catalog `db`), checkpointing into `ckpt`, restarted at most once at once."""
    return subprocess.run([PACER, "run", "--quiet", "--monitor", "--monitor-db", db, "--monitor-interval", "250ms",
                           "--ckpt-dir", ckpt, "--max-restarts", "1", "--restart-delay", "0", "--",
                           PYTHON, LOOP, "--ckpt", ckpt, *loop_args], capture_output=True, text=True, env=env(), timeout=120)


def bucket(j, name):
    return next(b for b in j["buckets"] if b["name"] == name)["seconds"]


class GoodputTest(unittest.TestCase):
    """The four runs are made once: each takes a few seconds."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pacer-goodput-")
        cls.dir = cls.tmp.name

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def monitored(self, name, command):
        db = os.path.join(self.dir, name + ".db")
        if not os.path.exists(db):
            r = subprocess.run([PACER, "monitor", "--interval", "250ms", "--no-gpu", "--db", db, "-q", "--", *command],
                               capture_output=True, text=True, env=env(), timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
        return db

    def ledger(self, db, *args):
        r = pacer("goodput", db, "--json", *args)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.goodput/1")
        self.assert_sums(db, j)
        return j

    def assert_sums(self, db, j):
        """Every second of the run, from the catalog's own start and end, is in exactly one bucket."""
        con = sqlite3.connect(db)
        started, ended = con.execute("SELECT started, ended FROM runs WHERE run_id = ?", (j["run_id"],)).fetchone()
        con.close()
        whole = ended - started
        self.assertGreater(whole, 0)
        self.assertAlmostEqual(j["wall_s"], whole, places=6)
        total = sum(b["seconds"] for b in j["buckets"])
        self.assertLessEqual(abs(total - whole), 0.01 * whole, j["buckets"])
        self.assertTrue(all(b["seconds"] >= 0 for b in j["buckets"]), j["buckets"])
        self.assertTrue(j["balanced"])

    def data_wait_sum(self, db):
        con = sqlite3.connect(db)
        (s,) = con.execute("SELECT sum(data_wait_s) FROM steps").fetchone()
        con.close()
        return s

    def test_clean_run(self):
        db = self.monitored("clean", [PYTHON, LOOP, "--steps", "20", "--compute", "0.04"])
        j = self.ledger(db)
        self.assertEqual(j["steps"], 20)
        self.assertEqual(j["attempts"], 1)
        self.assertIn("10th percentile", j["planned_from"])
        productive = bucket(j, "productive")
        # 20 steps of 40 ms, at the fastest sustained rate.
        self.assertGreater(productive, 20 * 0.035)
        for loss in ("input_wait", "stragglers", "checkpoint_stall", "restart_lost_work", "restart_gap"):
            self.assertLess(bucket(j, loss), 0.1 * productive, loss)
        self.assertGreater(bucket(j, "startup"), 0)  # the interpreter and imports before the first step
        self.assertIsNone(j["straggler"])
        # A planned rate slower than measured: steps count their own time, and say so.
        slow = self.ledger(db, "--planned-step", "10")
        self.assertEqual(slow["faster_than_plan"], 20)
        self.assertEqual(slow["planned_from"], "--planned-step")
        # --gpus scales the GPU-hours, not the seconds.
        eight = self.ledger(db, "--gpus", "8")
        self.assertEqual((eight["gpus"], eight["gpus_from"]), (8, "--gpus"))
        self.assertAlmostEqual(eight["gpu_hours"], j["wall_s"] * 8 / 3600, places=9)
        self.assertEqual(j["gpus_from"], "ranks (no GPU samples)")
        # The human table ends in OK and names the largest loss.
        r = pacer("goodput", db)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.strip().splitlines()[-1].startswith("OK: largest loss "), r.stdout)
        self.assertIn("productive", r.stdout)

    def test_plan_file_gives_the_rate(self):
        db = self.monitored("clean", [PYTHON, LOOP, "--steps", "20", "--compute", "0.04"])
        plan = os.path.join(self.dir, "plan.json")
        with open(plan, "w") as f:
            json.dump({"schema": "pacer.plan.step/1", "step_s": 0.02}, f)
        j = self.ledger(db, "--plan", plan)
        self.assertEqual(j["planned_step_s"], 0.02)
        self.assertAlmostEqual(bucket(j, "productive"), 20 * 0.02, places=6)
        # What the measured 40 ms steps take beyond the 20 ms plan is unexplained: `other`.
        self.assertGreater(bucket(j, "other"), 20 * 0.015)
        # The document `pacer plan step --json` writes, as it is.
        r = pacer("plan", "step", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab", "1000",
                  "--global-batch", "4", "--gemm-tflops", "0.05", "--peak-tflops", "0.1", "--hbm-gbps", "10",
                  "--tp-gbps", "10", "--dp-gbps", "10", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(plan, "w") as f:
            f.write(r.stdout)
        j = self.ledger(db, "--plan", plan)
        self.assertEqual(j["planned_step_s"], json.loads(r.stdout)["step_s"])
        self.assertEqual(j["planned_from"], "--plan " + plan)
        with open(plan, "w") as f:
            json.dump({"schema": "pacer.plan.memory/1"}, f)
        r = pacer("goodput", db, "--plan", plan)
        self.assertEqual(r.returncode, 2)
        self.assertIn(plan, r.stderr)

    def test_starved_loader_is_input_wait(self):
        db = self.monitored("starved", [PYTHON, LOOP, "--steps", "30", "--compute", "0.01", "--wait", "0.06"])
        j = self.ledger(db)
        waited = self.data_wait_sum(db)
        self.assertGreater(waited, 30 * 0.055)
        self.assertAlmostEqual(bucket(j, "input_wait"), waited, delta=0.05 * waited)
        self.assertGreater(bucket(j, "input_wait"), 2 * bucket(j, "productive"))
        losses = {b["name"]: b["seconds"] for b in j["buckets"] if b["name"] not in ("productive", "input_wait", "startup")}
        self.assertGreater(bucket(j, "input_wait"), max(losses.values()), j["buckets"])
        if j["largest_loss"]["bucket"] == "startup":
            # A loaded machine can take longer to start Python than the 30 steps take: then start-up is the
            # largest loss, rightly.
            self.assertGreater(bucket(j, "startup"), bucket(j, "input_wait"), j["largest_loss"])
        else:
            self.assertEqual(j["largest_loss"]["bucket"], "input_wait", j["largest_loss"])
            self.assertIn("loader threads", j["largest_loss"]["advice"])

    def test_slow_rank_is_a_straggler(self):
        ranks = " & ".join(f"RANK={r} {PYTHON} {LOOP} --steps 20 --compute 0.02 --slow-rank 1 --slow 0.08" for r in (0, 1))
        db = self.monitored("slow-rank", ["sh", "-c", ranks + " & wait"])
        j = self.ledger(db)
        self.assertEqual(j["ranks"], 2)
        self.assertEqual(j["steps"], 20)
        # Rank 1 takes 80 ms longer each step: the job waits for it.
        self.assertGreater(bucket(j, "stragglers"), 20 * 0.07)
        self.assertGreater(bucket(j, "stragglers"), 2 * bucket(j, "productive"))
        self.assertEqual(j["straggler"]["rank"], 1)
        self.assertEqual(j["straggler"]["node"], socket.gethostname())
        self.assertEqual(j["largest_loss"]["bucket"], "stragglers", j["largest_loss"])
        self.assertIn("exclude node " + socket.gethostname(), j["largest_loss"]["advice"])

    def test_killed_rank_restarts_and_redoes_steps(self):
        db = os.path.join(self.dir, "killed.db")
        ckpt = os.path.join(self.dir, "ckpt")
        r = supervised(db, ckpt, "--steps", "25", "--compute", "0.03", "--every", "5", "--save", "0.3", "--kill-at", "12")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = self.ledger(db)
        self.assertEqual(j["attempts"], 2)
        # Killed after step 12, resumed from the checkpoint of step 9: steps 10, 11 and 12 again.
        self.assertEqual(j["checkpoint"]["redone_steps"], 3)
        self.assertEqual(j["checkpoint"]["failures"], 1)
        self.assertGreater(bucket(j, "restart_lost_work"), 3 * 0.025)
        self.assertGreater(bucket(j, "restart_gap"), 0)
        # Saves after steps 4, 9, 14, 19 stall the next step by 300 ms each (the one after step 24 ends the run).
        self.assertGreaterEqual(j["checkpoint"]["checkpoints"], 4)
        self.assertGreater(bucket(j, "checkpoint_stall"), 4 * 0.28)
        self.assertGreater(j["checkpoint"]["save_cost_s"], 0.28)
        self.assertGreater(j["checkpoint"]["optimal_interval_s"], 0)

    def test_report_has_the_ledger(self):
        db = self.monitored("starved", [PYTHON, LOOP, "--steps", "30", "--compute", "0.01", "--wait", "0.06"])
        html = os.path.join(self.dir, "starved.html")
        r = pacer("report", db, "-o", html)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(html, encoding="utf-8") as f:
            page = f.read()
        self.assertIn('"schema":"pacer.goodput/1"', page)
        if not chromium():
            self.skipTest("chromium not installed (Debian package chromium; scripts/deps.sh installs it)")
        r, console = browse(html, os.path.join(self.dir, "profile"), "--dump-dom")
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertEqual(console, [], "console output from the page")
        self.assertIn('id="goodput"', r.stdout)
        self.assertIn("Largest loss: " + self.ledger(db)["largest_loss"]["bucket"], r.stdout)
        # A run without steps has no ledger, and its report is still written.
        empty = self.monitored("no-steps", ["sleep", "0.3"])
        r = pacer("report", empty, "-o", os.path.join(self.dir, "empty.html"))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_a_run_without_steps(self):
        db = self.monitored("no-steps", ["sleep", "0.3"])
        r = pacer("goodput", db)
        self.assertEqual(r.returncode, 2)
        self.assertIn("has no step records", r.stderr)
        self.assertIn(db, r.stderr)

    def test_missing_catalog_and_unknown_run(self):
        missing = os.path.join(self.dir, "nope.db")
        r = pacer("goodput", missing)
        self.assertEqual(r.returncode, 2)
        self.assertIn(missing, r.stderr)
        self.assertFalse(os.path.exists(missing))
        db = self.monitored("clean", [PYTHON, LOOP, "--steps", "20", "--compute", "0.04"])
        r = pacer("goodput", db, "--run", "99")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no run 99", r.stderr)
        r = pacer("goodput", db, "--plan", os.path.join(self.dir, "no-plan.json"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("no-plan.json", r.stderr)
        r = pacer("goodput", db, "--planned-step", "0")
        self.assertEqual(r.returncode, 2)


if __name__ == "__main__":
    unittest.main()
