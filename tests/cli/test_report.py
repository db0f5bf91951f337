"""pacer report: one self-contained HTML file that headless Chromium renders without console errors."""
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from cli_util import pacer
from test_score import make_catalog

OUT = os.environ.get("PACER_TEST_OUT", os.path.join(tempfile.gettempdir(), "pacer-report-test"))


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


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
        for workload, charts in (("gemm", 11), ("cpu", 2)):
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


if __name__ == "__main__":
    unittest.main()
