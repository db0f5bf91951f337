"""pacer report: one self-contained HTML file that headless Chromium renders without console errors."""
import json
import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
import unittest

from cli_util import pacer
from test_score import make_catalog

OUT = os.environ.get("PACER_TEST_OUT", os.path.join(tempfile.gettempdir(), "pacer-report-test"))


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def page_data(html):
    """The pacer.report.data/1 document a page embeds."""
    with open(html, encoding="utf-8") as f:
        m = re.search(r'<script id="pacer-data" type="application/json">(.*?)</script>', f.read(), re.S)
    return json.loads(m.group(1))


def body_attrs(dom):
    body = re.search(r"<body([^>]*)>", dom)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1))) if body else {}


def browse(html, profile, *mode):
    """Loads `html` in headless Chromium; returns (stdout, console lines). Scripts get 10 s of virtual time."""
    r = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--user-data-dir=" + profile, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
                        "--window-size=1500,3600", *mode, "file://" + os.path.abspath(html)],
                       capture_output=True, text=True, timeout=120)
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    return r, console


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-report-")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, workload):
        db = make_catalog(self.dir, workload)
        html = os.path.join(self.dir, workload + ".html")
        r = pacer("report", db, "-o", html)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: wrote", r.stderr)
        return html

    def test_self_contained(self):
        with open(self.write("gemm"), encoding="utf-8") as f:
            page = f.read()
        # Nothing is fetched: no external scripts, styles or URLs to load.
        self.assertIsNone(re.search(r"<(script|link|img)[^>]+(src|href)=", page))
        self.assertIn("compute-bound", page)

    def test_exit_codes(self):
        db = make_catalog(self.dir, "idle")
        self.assertEqual(pacer("report", db).returncode, 2)  # no -o
        r = pacer("report", db, "-o", os.path.join(self.dir, "no-such-dir", "r.html"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(pacer("report", os.path.join(self.dir, "none.db"), "-o", "x.html").returncode, 2)

    def test_chromium_renders_the_charts(self):
        if not chromium():
            self.skipTest("chromium not installed (Debian package chromium; scripts/deps.sh installs it)")
        os.makedirs(OUT, exist_ok=True)
        for workload, charts in (("gemm", 13), ("cpu", 2)):
            with self.subTest(workload=workload):
                html = self.write(workload)
                r, console = browse(html, os.path.join(self.dir, "profile"), "--dump-dom")
                self.assertEqual(r.returncode, 0, r.stderr[-2000:])
                self.assertEqual(console, [], "console output from the page")
                body = re.search(r"<body([^>]*)>", r.stdout)
                self.assertIsNotNone(body, r.stdout[:2000])
                attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
                self.assertNotIn("errors", attrs)
                self.assertEqual(attrs.get("rendered"), str(charts), attrs)
                # Each chart's canvas, measured on its first draw: width x height : painted pixels.
                sizes = re.findall(r"(\S+):(\d+)x(\d+):(\d+)", attrs["chart-sizes"])
                self.assertEqual(len(sizes), charts, attrs["chart-sizes"])
                for title, w, h, ink in sizes:
                    self.assertGreater(int(w), 400, title)
                    self.assertGreater(int(h), 150, title)
                    self.assertGreater(int(ink), 500, title)
                self.assertIn('id="heatmap"', r.stdout)
                self.assertIn('id="scores"', r.stdout)
                shot = os.path.join(OUT, "report-%s.png" % workload)
                if os.path.exists(shot):
                    os.remove(shot)
                r, console = browse(html, os.path.join(self.dir, "profile"), "--screenshot=" + shot, "--hide-scrollbars")
                self.assertEqual(console, [])
                self.assertTrue(os.path.getsize(shot) > 10000, shot)

    def test_training_charts_with_a_plan(self):
        """Steps without flops: MFU from the plan's FLOPs per token, shared by its tp x pp ranks."""
        db = make_catalog(self.dir, "gemm")
        plan = os.path.join(self.dir, "plan.json")
        # 8192 tokens per step per rank (the synthetic steps), 3e9 FLOPs per token, tp 2: 1.2288e13 FLOPs per rank's step.
        with open(plan, "w") as f:
            json.dump({"schema": "pacer.plan.step/1", "step_s": 0.4, "model_flops": 3e9 * 4 * 1024,
                       "config": {"seq": 1024, "global_batch": 4, "tp": 2, "pp": 1}, "hardware": {"peak_tflops": 100}}, f)
        html = os.path.join(self.dir, "plan.html")
        r = pacer("report", db, "-o", html, "--plan", plan)
        self.assertEqual(r.returncode, 0, r.stderr)
        d = page_data(html)
        tr = d["training"]
        self.assertEqual(tr["peak_flops"], 100e12)
        self.assertEqual(tr["flops_from"], "--plan " + plan)
        con = sqlite3.connect(db)
        st = dict(con.execute("SELECT step, step_time_s FROM steps WHERE rank = 3"))
        self.assertEqual(tr["rate"], "mfu")
        self.assertEqual(len(tr["ranks"]), 8)
        rank3 = tr["ranks"]["rank 3 (gpu001)"]
        self.assertEqual(rank3["step"], list(range(100)))
        for step, v in zip(rank3["step"], rank3["rate"]):
            self.assertAlmostEqual(v, 3e9 * 8192 / 2 / st[step] / 100e12, delta=1e-5 * v)
        self.assertAlmostEqual(rank3["tokens_per_s"][0], 8192 / st[0], delta=1e-4 * 8192 / st[0])
        self.assertEqual(d["goodput"]["planned_from"], "--plan " + plan)
        # --peak-tflops overrides the plan's peak.
        r = pacer("report", db, "-o", html, "--plan", plan, "--peak-tflops", "50")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertAlmostEqual(page_data(html)["training"]["ranks"]["rank 3 (gpu001)"]["rate"][0], 2 * rank3["rate"][0], delta=1e-4)
        # Without a peak: the model FLOP/s instead of MFU; without FLOPs neither.
        with open(plan) as f:
            doc = json.load(f)
        doc["hardware"]["peak_tflops"] = 0
        with open(plan, "w") as f:
            json.dump(doc, f)
        r = pacer("report", db, "-o", html, "--plan", plan)
        tr = page_data(html)["training"]
        self.assertEqual(tr["rate"], "model_flops_per_s")
        self.assertAlmostEqual(tr["ranks"]["rank 3 (gpu001)"]["rate"][0], 3e9 * 8192 / 2 / st[0], delta=1e-5 * 3e9 * 8192 / st[0])
        r = pacer("report", db, "-o", html)
        self.assertIsNone(page_data(html)["training"]["rate"])
        # A missing plan, a plan of another kind and a bad peak are usage errors naming what is wrong.
        r = pacer("report", db, "-o", html, "--plan", os.path.join(self.dir, "none.json"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("none.json", r.stderr)
        with open(plan, "w") as f:
            json.dump({"schema": "pacer.plan.step/1", "step_s": 0.4}, f)
        r = pacer("report", db, "-o", html, "--plan", plan)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("model_flops", r.stderr)
        self.assertEqual(pacer("report", db, "-o", html, "--peak-tflops", "0").returncode, 2)

    def test_training_charts_of_a_real_run(self):
        """A short loop under pacer run, killed once and restarted, with a hang and a vet result injected."""
        from test_goodput import supervised  # here: test_goodput imports this module
        db = os.path.join(self.dir, "run.db")
        r = supervised(db, os.path.join(self.dir, "ckpt"), "--steps", "25", "--compute", "0.02", "--every", "5",
                       "--kill-at", "12", "--flops", "2e9")
        self.assertEqual(r.returncode, 0, r.stderr)
        con = sqlite3.connect(db)
        run_id, = con.execute("SELECT max(run_id) FROM runs").fetchone()
        t12, = con.execute("SELECT min(t) FROM steps WHERE step = 12").fetchone()
        with con:
            con.execute("INSERT INTO events(run_id, t, kind, detail) VALUES(?, ?, 'run.hang', 'rank 0 idle 30 s')", (run_id, t12 + 0.001))
            con.execute("INSERT INTO events(run_id, t, kind, detail) VALUES(?, ?, 'vet.quick', 'pass')", (run_id, t12 - 0.05))
        con.close()
        html = os.path.join(self.dir, "run.html")
        r = pacer("report", db, "-o", html, "--peak-tflops", "0.2")
        self.assertEqual(r.returncode, 0, r.stderr)
        d = page_data(html)
        rank, = d["training"]["ranks"].values()
        # Steps 10-12 were done twice; each is drawn once, as the attempt that went on.
        self.assertEqual(rank["step"], list(range(25)))
        self.assertEqual(rank["t"], sorted(rank["t"]))
        self.assertEqual(d["training"]["rate"], "mfu")
        # 2e9 FLOPs in steps of at least 20 ms against 0.2 TFLOP/s: at most 50%.
        self.assertTrue(all(0 < v <= 0.5 for v in rank["rate"]), rank["rate"])
        classes = [m["class"] for m in d["marks"]]
        for cls in ("checkpoint", "restart", "hang", "vet"):
            self.assertIn(cls, classes)
        self.assertGreaterEqual(classes.count("checkpoint"), 5)  # saves after steps 4, 9, 14, 19 and 24
        if not chromium():
            self.skipTest("chromium not installed (Debian package chromium; scripts/deps.sh installs it)")
        r, console = browse(html, os.path.join(self.dir, "profile"), "--dump-dom")
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertEqual(console, [], "console output from the page")
        attrs = body_attrs(r.stdout)
        self.assertNotIn("errors", attrs)
        self.assertEqual(attrs.get("rendered"), str(r.stdout.count('data-chart="')), attrs)
        ink = {t: int(i) for t, i in re.findall(r"(\S+):\d+x\d+:(\d+)", attrs["chart-sizes"])}
        marked = dict(re.findall(r"(\S+):(\d+)", attrs["marks"]))
        for title in ("Loss_per_rank", "Tokens/s_per_rank", "MFU_per_rank", "Step_time_per_rank"):
            self.assertGreater(ink.get(title, 0), 500, (title, attrs["chart-sizes"]))
        # Every mark is drawn: on a step axis at the last step before it, on a time axis (the run's span) at its time.
        self.assertEqual(int(marked["Loss_per_rank"]), len(d["marks"]))
        self.assertEqual(int(marked["Step_time_per_rank"]), len(d["marks"]))
        self.assertIn('id="marks"', r.stdout)
        self.assertIn("H hang (1)", r.stdout)


if __name__ == "__main__":
    unittest.main()
