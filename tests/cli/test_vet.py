"""Integration tests for `pacer vet`: the real binary, its exit codes, output and files."""
import json
import os
import signal
import subprocess
import tempfile
import time
import unittest

from cli_util import PACER, pacer


# Other tests run in parallel under ctest, so the foreign-load check is left
# out where a test needs a passing verdict.
CALM = ["--skip", "system.load"]

# The default profile's minimums for the figures a busy machine lowers (a core
# shared with other tests, a contended disk, memory taken by parallel tests),
# lowered to zero for tests that need a passing verdict from a real run: the
# probes still run and report what they measured, and an error (a probe that
# crashed, timed out or returned nothing) still fails the verdict.
BUSY_FIGURES = ["cpu.flops", "cpu.core_balance", "memory.bandwidth", "storage.write", "storage.read", "storage.metadata",
                "system.mem_available"]
SPEED_INDEPENDENT = "".join(f'[checks."{c}"]\nfail_below = 0\n' for c in BUSY_FIGURES)



class VetCli(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-cli-")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_version_and_help(self):
        r = pacer("--version")
        self.assertEqual(r.returncode, 0)
        self.assertRegex(r.stdout, r"^pacer \d+\.\d+\.\d+")
        r = pacer("vet", "--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("--quick", r.stdout)
        self.assertIn("Exit codes", r.stdout)
        self.assertEqual(pacer().returncode, 2)  # a subcommand is required
        self.assertEqual(pacer("vet", "--no-such-flag").returncode, 2)

    @unittest.skipUnless(os.path.isdir(os.environ.get("PACER_FAKE_NVML_DIR", "")), "PACER_FAKE_NVML_DIR not set (ctest sets it)")
    def test_missing_driver_fails_a_node_that_must_have_gpus(self):
        # The fake libnvidia-ml.so.1 whose nvmlInit says "driver not loaded" (9).
        env = dict(os.environ, LD_LIBRARY_PATH=os.environ["PACER_FAKE_NVML_DIR"], PACER_FAKE_NVML_INIT="9")
        run = lambda *a: subprocess.run([PACER, "vet", "--quick", "--only", "gpu.count", "--json", *a],
                                        capture_output=True, text=True, timeout=120, env=env)
        r = run("--profile", "h200", "--expect-gpus", "8")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["verdict"], "fail")
        [c] = [c for c in j["checks"] if c["name"] == "gpu.count"]
        self.assertEqual(c["status"], "fail")
        self.assertIn("no NVIDIA driver", c["reason"])
        # Without an expectation a node without a driver is no GPU node: skip.
        r = run("--profile", "default")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(json.loads(r.stdout)["checks"][0]["status"], "skip")

    def test_unknown_command_is_a_usage_error_even_with_help(self):
        for args, word, parent in [(["bogus", "--help"], "bogus", "pacer --help"), (["bogus"], "bogus", "pacer --help"),
                                   (["ckpt", "lss", "--help"], "lss", "pacer ckpt --help")]:
            r = pacer(*args)
            self.assertEqual(r.returncode, 2, args)
            self.assertEqual(r.stdout, "", args)  # no help text that looks like success
            self.assertIn(f"unknown command '{word}'", r.stderr)
            self.assertIn(parent, r.stderr)
        self.assertEqual(pacer("ckpt", "ls", "--help").returncode, 0)
        self.assertEqual(pacer("--help").returncode, 0)

    def test_list_names_every_category(self):
        r = pacer("vet", "--list")
        self.assertEqual(r.returncode, 0)
        for name in ["system.thp_enabled", "cpu.flops", "memory.bandwidth", "storage.metadata", "gpu.ecc", "software.nccl",
                     "fabric.ib_state", "fabric.cxi_link_flaps", "software.container"]:
            self.assertIn(name, r.stdout)

    def test_quick_run_table_and_json(self):
        report = os.path.join(self.dir, "vet.json")
        with tempfile.TemporaryDirectory(prefix="pacer-cli-profile-") as tmp:  # outside the tested path
            profile = os.path.join(tmp, "busy-ci.toml")
            with open(profile, "w") as f:
                f.write('name = "busy-ci"\n' + SPEED_INDEPENDENT)
            r = pacer("vet", "--quick", *CALM, "--profile", profile, "--path", self.dir, "--json-file", report)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout.splitlines()[-1], r"^OK: \d+ checks on ")
        self.assertIn("CHECK", r.stdout.splitlines()[0])
        with open(report) as f:
            j = json.load(f)
        self.assertEqual(j["schema"], "pacer.vet/1")
        self.assertEqual(j["verdict"], "pass")
        self.assertEqual(j["mode"], "quick")
        names = {c["name"] for c in j["checks"]}
        self.assertIn("memory.bandwidth", names)
        # The figures the profile does not judge strictly were still measured, the storage ones in the tested path.
        self.assertLessEqual(set(BUSY_FIGURES), names)
        for c in j["checks"]:
            if c["name"] in BUSY_FIGURES:
                self.assertIsInstance(c["value"], (int, float), c)
                if c["category"] == "storage":
                    self.assertEqual(c["target"], os.path.realpath(self.dir), c)
        for c in j["checks"]:
            for key in ["name", "category", "target", "value", "unit", "threshold", "status", "reason", "duration_s"]:
                self.assertIn(key, c)
        gpu = [c for c in j["checks"] if c["category"] == "gpu"]
        self.assertTrue(gpu)
        if not os.path.exists("/dev/nvidiactl"):
            for c in gpu:
                self.assertEqual(c["status"], "skip")
                self.assertIn("no NVIDIA driver", c["reason"])
        self.assertIn("kernel", j["versions"])
        # Nothing was left in the tested path but our own report.
        self.assertEqual(os.listdir(self.dir), ["vet.json"])

    def test_json_on_stdout(self):
        r = pacer("vet", "--only", "system.nofile,system.clocksource", "--json")
        self.assertIn(r.returncode, (0, 1))
        j = json.loads(r.stdout)
        self.assertEqual(sorted(c["name"] for c in j["checks"]), ["system.clocksource", "system.nofile"])

    def test_failed_check_exits_1(self):
        r = pacer("vet", "--only", "memory.pattern", "--inject", "memory.pattern=3", "--json")
        self.assertEqual(r.returncode, 1, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["verdict"], "fail")
        self.assertEqual(j["checks"][0]["status"], "fail")
        r = pacer("vet", "--only", "memory.pattern", "--inject", "memory.pattern=3")
        self.assertTrue(r.stdout.splitlines()[-1].startswith("FAILED:"))

    def test_nan_measurement_fails_and_nan_threshold_is_a_config_error(self):
        # nan compares false with every threshold: it must fail, never pass.
        r = pacer("vet", "--only", "memory.pattern", "--inject", "memory.pattern=nan", "--json")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(json.loads(r.stdout)["checks"][0]["status"], "fail")
        with tempfile.TemporaryDirectory() as tmp:
            profile = os.path.join(tmp, "site.toml")
            with open(profile, "w") as f:
                f.write('[checks."memory.pattern"]\nfail_above = nan\n')
            r = pacer("vet", "--only", "memory.pattern", "--profile", profile)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(f"{profile}:2:", r.stderr)
            self.assertIn("fail_above", r.stderr)

    def test_hung_check_is_reported_and_vet_finishes(self):
        # The short timeout is the hung check's alone (a profile's per-check timeout): the others keep
        # their own, so that a slow fork on a busy machine cannot time them out too.
        profile = self.write("hang.toml", '[checks."system.nofile"]\ntimeout = "1s"\n')
        r = pacer("vet", "--only", "system", "--skip", "system.load", "--profile", profile,
                  "--inject", "system.nofile=hang", "--json", timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
        self.assertEqual(checks["system.nofile"]["status"], "error")
        self.assertIn("timed out after 1 s", checks["system.nofile"]["reason"])
        self.assertEqual(checks["system.thp_enabled"]["status"], "pass")
        # --timeout replaces the probe's own timeout (5 s for system.nofile).
        r = pacer("vet", "--only", "system.nofile", "--inject", "system.nofile=hang", "--timeout", "1s", "--json", timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        [c] = json.loads(r.stdout)["checks"]
        self.assertEqual(c["status"], "error")
        self.assertIn("timed out after 1 s", c["reason"])

    def test_usage_errors_exit_2(self):
        for args, needle in [
            (["--only", "cpu.warp_drive"], "cpu.warp_drive"),
            (["--skip", "nonsense"], "nonsense"),
            (["--profile", "no-such-profile"], "no-such-profile"),
            (["--profile", os.path.join(self.dir, "missing.toml")], "missing.toml"),
            (["--baseline", os.path.join(self.dir, "missing.json")], "missing.json"),
            (["--timeout", "soon"], "soon"),
            (["--inject", "cpu.flops=wobble"], "wobble"),
        ]:
            r = pacer("vet", *args)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stdout}{r.stderr}")
            self.assertIn(needle, r.stderr, args)

    def test_malformed_profile_names_file_and_line(self):
        bad = self.write("bad.toml", 'name = "x"\n\n[checks."cpu.flops"]\nfail_below = = 3\n')
        r = pacer("vet", "--profile", bad)
        self.assertEqual(r.returncode, 2)
        self.assertIn(f"{bad}:4:", r.stderr)
        typo = self.write("typo.toml", '[checks."memory.bandwidth"]\nfail_belwo = 3\n')
        r = pacer("vet", "--profile", typo)
        self.assertEqual(r.returncode, 2)
        self.assertIn(f"{typo}:2:", r.stderr)
        self.assertIn("fail_belwo", r.stderr)

    def test_profile_and_baseline_round_trip(self):
        prof = self.write("site.toml", 'name = "site"\ninherits = "h200"\n[checks."system.nofile"]\nfail_below = 10\nwarn_below = 10\n')
        r = pacer("vet", "--profile", prof, "--show-profile")
        self.assertEqual(r.returncode, 0, r.stderr)
        p = json.loads(r.stdout)
        self.assertEqual(p["name"], "site")
        self.assertEqual(p["sources"], ["builtin:default", "builtin:h200", prof])
        self.assertEqual(p["checks"]["system.nofile"]["fail_below"], 10)

        base = os.path.join(self.dir, "base.json")
        r = pacer("vet", "--only", "memory.bandwidth", "--inject", "memory.bandwidth=20", "--json-file", base)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = pacer("vet", "--only", "memory.bandwidth", "--inject", "memory.bandwidth=15", "--baseline", base, "--json")
        self.assertEqual(r.returncode, 1)
        c = json.loads(r.stdout)["checks"][0]
        self.assertEqual(c["baseline"], 20)
        self.assertIn("75% of baseline", c["reason"])

    def test_unwritable_storage_path_fails_that_check_only(self):
        r = pacer("vet", "--only", "storage,system.clocksource", "--quick", "--path", "/proc", "--json")
        self.assertEqual(r.returncode, 1)
        checks = json.loads(r.stdout)["checks"]
        by = {(c["name"], c["target"]): c for c in checks}
        self.assertEqual(by[("storage.write", "/proc")]["status"], "fail")
        self.assertIn("not writable", by[("storage.write", "/proc")]["reason"])
        self.assertNotEqual(by[("system.clocksource", "")]["status"], "error")

    def test_interrupt_cleans_up(self):
        proc = subprocess.Popen([PACER, "vet", "--only", "storage.metadata", "--path", self.dir,
                                 "--inject", "storage.metadata=hang", "--timeout", "60s"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Wait until the probe's scratch directory exists, then interrupt.
        deadline = time.time() + 30
        while time.time() < deadline and not os.listdir(self.dir):
            time.sleep(0.05)
        self.assertTrue(os.listdir(self.dir), "probe never started")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        self.assertEqual(proc.returncode, 130, out + err)
        self.assertIn("interrupted", out)
        self.assertEqual(os.listdir(self.dir), [])


if __name__ == "__main__":
    unittest.main()
