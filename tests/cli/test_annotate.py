"""pacer annotate: the labelling page in headless Chromium (two annotators, reload, skip, undo, a guideline
edit), the store surviving a SIGKILL, agreement and export, and the errors a user meets."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import unittest
import urllib.request

from cli_util import PACER, pacer

NODE_DIR = os.environ.get("PACER_ANNOTATE_NODE", os.path.join(os.path.dirname(__file__), "../../build/annotate_node"))
E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../annotate/e2e.cjs")

DATA = "\n".join([
    json.dumps({"id": "r1", "text": "How do I bake bread?"}),
    json.dumps({"messages": [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "No."}]}),
    json.dumps({"id": 3, "text": "How do I pick a lock?"}),
    "{oops",
    json.dumps({"text": "A poem about rain"}),
    json.dumps({"text": "Ways to hurt someone"}),
    json.dumps({"text": "Recipe for soup"}),
]) + "\n"
IDS = ["r1", "data.jsonl:2", "3", "data.jsonl:5", "data.jsonl:6", "data.jsonl:7"]
LABELS = '[[label]]\nname = "safe"\nkey = "s"\ndescription = "harmless"\n\n[[label]]\nname = "unsafe"\nkey = "u"\n'


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Server:
    """`pacer annotate serve` in the background; its links parsed from what it prints."""

    def __init__(self, d, *extra):
        self.proc = subprocess.Popen([PACER, "annotate", "serve", os.path.join(d, "data.jsonl"), "--labels",
                                      os.path.join(d, "labels.toml"), "--guidelines", os.path.join(d, "guide.md"),
                                      "--store", os.path.join(d, "a.db"), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.links = {}
        for line in self.proc.stdout:
            if line.startswith("  ") and "#token=" in line:
                name, url = line.strip().split(": ", 1)
                self.links[name] = url
            if line.startswith("serving "):
                self.url = line.split()[1]
                break
        else:
            raise AssertionError("pacer annotate serve did not start: " + self.proc.stderr.read())

    def token(self, name):
        return self.links[name].split("#token=")[1]

    def call(self, token, path, body=None):
        req = urllib.request.Request(self.url + path.lstrip("/"), method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=20)
        return self.proc.returncode, err


class AnnotateTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-annotate-")
        self.d = self.tmp.name
        for name, text in (("data.jsonl", DATA), ("labels.toml", LABELS), ("guide.md", "# Guide\nLabel harm as unsafe.\n")):
            with open(os.path.join(self.d, name), "w", encoding="utf-8") as f:
                f.write(text)
        self.db = os.path.join(self.d, "a.db")

    def tearDown(self):
        self.tmp.cleanup()

    def export(self, name="set"):
        out = os.path.join(self.d, name)
        r = pacer("annotate", "export", out, "--store", self.db, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "labels.jsonl"), encoding="utf-8") as f:
            lines = [json.loads(x) for x in f]
        with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
            return json.loads(r.stdout), json.load(f), lines

    def test_two_annotators_in_chromium(self):
        if not chromium():
            self.skipTest("chromium not installed (Debian package chromium; scripts/deps.sh installs it)")
        self.assertTrue(os.path.isdir(os.path.join(NODE_DIR, "node_modules", "puppeteer-core")),
                        "puppeteer-core missing in %s: build the annotate_test_node target (npm ci)" % NODE_DIR)
        srv = Server(self.d, "--add-annotator", "alice", "--add-annotator", "bob")
        try:
            r = subprocess.run(["node", E2E, srv.links["alice"], srv.links["bob"], os.path.join(self.d, "guide.md")],
                               capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, PACER_ANNOTATE_NODE=NODE_DIR, CHROMIUM=chromium()))
        finally:
            rc, err = srv.stop()
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        self.assertEqual(rc, 0, err)
        self.assertIn("changed: guideline version", err)
        out = json.loads(r.stdout)
        self.assertEqual(out["errors"], [])
        a, b = out["a"], out["b"]
        self.assertEqual([s["sample"] for s in a],
                         [IDS[0], IDS[1], IDS[2], IDS[3], IDS[2], IDS[3], IDS[3], IDS[4], IDS[5], ""])
        self.assertEqual([s["labelled"] for s in a], [0, 1, 2, 2, 2, 3, 3, 4, 5, 6])
        self.assertEqual(a[3]["status"], "skipped 3")
        self.assertEqual(a[4]["status"], "took back 3")
        self.assertTrue(a[9]["done"])
        v1, v2 = a[7]["guideline"], a[8]["guideline"]
        self.assertNotEqual(v1, v2)
        self.assertEqual(a[0]["banner"], "")
        self.assertIn("guidelines changed", a[8]["banner"])
        self.assertEqual([s["sample"] for s in b], [IDS[0], IDS[1], IDS[2], IDS[3], IDS[4]])

        report, manifest, lines = self.export()
        got = {(x["annotator"], x["id"]): (x["label"], x["guideline_version"]) for x in lines}
        self.assertEqual(got, {
            ("alice", IDS[0]): ("safe", v1), ("alice", IDS[1]): ("unsafe", v1), ("alice", IDS[2]): ("safe", v1),
            ("alice", IDS[3]): ("safe", v1), ("alice", IDS[4]): ("unsafe", v1), ("alice", IDS[5]): ("safe", v2),
            ("bob", IDS[0]): ("unsafe", v1), ("bob", IDS[1]): ("unsafe", v1), ("bob", IDS[2]): ("safe", v1),
            ("bob", IDS[3]): ("unsafe", v1)})
        self.assertEqual(lines[0]["text"], "How do I bake bread?")
        self.assertEqual(manifest["schema"], "pacer.annotations/1")
        self.assertEqual(manifest["version"], report["version"])
        self.assertEqual((manifest["samples"], manifest["annotators"]), (6, 2))
        self.assertEqual(sorted(g["version"] for g in manifest["guidelines"]), sorted([v1, v2]))

        # Shared samples r1, 2, 3, 5: agreement 2/4, chance (3/4)(1/4) + (1/4)(3/4): kappa 0.2.
        r = pacer("annotate", "agreement", "--store", self.db, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual((j["method"], j["samples"]), ("cohen", 4))
        self.assertAlmostEqual(j["kappa"], 0.2)
        r = pacer("annotate", "agreement", "--store", self.db)
        self.assertIn("OK: Cohen's kappa 0.200 over 4 samples", r.stdout)

    def test_a_label_survives_sigkill_and_concurrent_writes_keep_both(self):
        srv = Server(self.d, "--add-annotator", "alice", "--add-annotator", "bob")
        ta, tb = srv.token("alice"), srv.token("bob")
        _, state = srv.call(ta, "/api/state")
        v = state["guideline"]["version"]
        results = []

        def label(token, value):
            for _ in range(20):
                results.append(srv.call(token, "/api/label", {"sample": "r1", "label": value, "guideline_version": v})[0])

        threads = [threading.Thread(target=label, args=(ta, "safe")), threading.Thread(target=label, args=(tb, "unsafe"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(set(results), {200})
        self.assertEqual(srv.call(ta, "/api/label", {"sample": IDS[1], "label": "unsafe", "guideline_version": v})[0], 200)
        status, err = srv.call(ta, "/api/label", {"sample": IDS[2], "label": "maybe", "guideline_version": v})
        self.assertEqual(status, 400)
        self.assertIn("no label 'maybe'", err["error"])
        self.assertEqual(srv.call("nope", "/api/state")[0], 401)
        rc, _ = srv.stop(signal.SIGKILL)
        self.assertEqual(rc, -signal.SIGKILL)
        _, _, lines = self.export()
        self.assertEqual(sorted((x["annotator"], x["id"], x["label"]) for x in lines),
                         [("alice", IDS[1], "unsafe"), ("alice", "r1", "safe"), ("bob", "r1", "unsafe")])
        # Served again, alice continues after her last label.
        srv = Server(self.d)
        try:
            _, state = srv.call(ta, "/api/state")
            self.assertEqual(state["sample"]["id"], "3")
            self.assertEqual(state["progress"], {"samples": 6, "labelled": 2, "skipped": 0})
        finally:
            srv.stop()

    def test_errors(self):
        r = pacer("annotate", "agreement", "--store", self.db)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no such annotation store", r.stderr)
        with open(os.path.join(self.d, "labels.toml"), "a", encoding="utf-8") as f:
            f.write('[[label]]\nname = "other"\nkey = "s"\n')
        r = pacer("annotate", "serve", os.path.join(self.d, "data.jsonl"), "--labels", os.path.join(self.d, "labels.toml"),
                  "--guidelines", os.path.join(self.d, "guide.md"), "--store", self.db, "--add-annotator", "x")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("labels.toml:", r.stderr)
        self.assertIn("key 's' of label 'other' is taken", r.stderr)
        r = pacer("annotate", "add-annotator", "alice", "--store", self.db, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(json.loads(r.stdout)["token"]), 32)
        self.assertEqual(pacer("annotate", "add-annotator", "alice", "--store", self.db).returncode, 2)
        r = pacer("annotate", "agreement", "--store", self.db)
        self.assertEqual(r.returncode, 1)
        self.assertIn("FAILED", r.stdout)
        os.makedirs(os.path.join(self.d, "mine"))
        r = pacer("annotate", "export", os.path.join(self.d, "mine"), "--store", self.db)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not an annotation set", r.stderr)
        self.assertEqual(pacer("annotate").returncode, 2)
        self.assertEqual(pacer("annotate", "bogus").returncode, 2)


if __name__ == "__main__":
    unittest.main()
