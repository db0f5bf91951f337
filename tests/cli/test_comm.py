"""Integration tests for `pacer comm`: bench under mpirun (2 ranks) and alone, tune from its report, exit codes."""
import json
import os
import pty
import shutil
import subprocess
import tempfile
import unittest

from cli_util import PACER, pacer

MPIRUN = shutil.which("mpirun")
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_plm="isolated",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_rmaps_base_oversubscribe="1")
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}
SMALL = ["--min-size", "64", "--max-size", "1MiB", "--step-factor", "4", "--iters", "5", "--warmup", "1"]


def mpi_pacer(n, *args):
    return subprocess.run([MPIRUN, "--oversubscribe", "-np", str(n), PACER, *args], capture_output=True, text=True,
                          timeout=120, env=MPI_ENV)


class CommBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.report_path = os.path.join(cls.tmp, "bench.json")
        if MPIRUN:
            cls.run2 = mpi_pacer(2, "comm", "bench", *SMALL, "--json", "--output", cls.report_path)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    @unittest.skipUnless(MPIRUN, "mpirun not installed")
    def test_two_ranks_json_follows_nccl_tests_definitions(self):
        self.assertEqual(self.run2.returncode, 0, self.run2.stderr)
        r = json.loads(self.run2.stdout)  # only rank 0 prints
        self.assertEqual(r["schema"], "pacer.comm.bench/1")
        self.assertEqual(r["ranks"], 2)
        self.assertEqual(r["backend"], "mpi")
        self.assertTrue(r["ok"])
        self.assertEqual([c["name"] for c in r["collectives"]], list(FACTORS))
        for c in r["collectives"]:
            self.assertAlmostEqual(c["busbw_factor"], FACTORS[c["name"]](2))
            self.assertGreaterEqual(len(c["points"]), 4)
            self.assertIsNotNone(c["fit"])
            self.assertLessEqual(c["fit"]["r2"], 1.0)
            self.assertGreaterEqual(c["fit"]["alpha_s"], 0.0)
            for p in c["points"]:
                self.assertTrue(p["correct"])
                self.assertLessEqual(p["min_s"], p["median_s"])
                self.assertLessEqual(p["median_s"], p["p99_s"])
                self.assertAlmostEqual(p["algbw_gbps"], p["bytes"] / p["median_s"] / 1e9, delta=1e-9 * p["algbw_gbps"] + 1e-12)
                self.assertAlmostEqual(p["busbw_gbps"], p["algbw_gbps"] * c["busbw_factor"], places=9)
                # reduce_scatter / all_gather / all_to_all sizes are whole blocks per rank
                if c["name"] in ("reduce_scatter", "all_gather", "all_to_all"):
                    self.assertEqual(p["bytes"], p["count"] * 4 * 2)
        with open(self.report_path) as f:
            self.assertEqual(json.load(f), r)

    @unittest.skipUnless(MPIRUN, "mpirun not installed")
    def test_table_and_ok_line(self):
        r = mpi_pacer(2, "comm", "bench", *SMALL, "--collectives", "all_reduce,broadcast", "--dtype", "bf16")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("BUSBW GB/s", r.stdout)
        self.assertIn("broadcast", r.stdout)
        self.assertNotIn("all_gather", r.stdout)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "OK: every result checked")

    def test_single_process_is_one_rank(self):
        r = pacer("comm", "bench", *SMALL, "--collectives", "all_reduce", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["ranks"], 1)
        self.assertEqual(j["collectives"][0]["busbw_factor"], 0.0)

    def run_on_terminal(self, *args, stderr_tty=True):
        """Runs pacer with a terminal on stderr (or on stdout only, as mpirun gives its ranks); returns
        (exit code, what reached the terminal, the other stream)."""
        master, slave = pty.openpty()
        p = subprocess.Popen([PACER, *args], stdout=subprocess.PIPE if stderr_tty else slave,
                             stderr=slave if stderr_tty else subprocess.PIPE)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        os.close(master)
        other = (p.stdout if stderr_tty else p.stderr).read()
        p.wait(timeout=120)
        return p.returncode, seen.decode(errors="replace"), other.decode(errors="replace")

    def test_progress_on_a_terminal(self):
        args = ["comm", "bench", *SMALL, "--collectives", "all_reduce,broadcast"]
        # mpirun keeps only stdout a terminal: the progress goes there, and is gone before the table.
        rc, tty, err = self.run_on_terminal(*args, stderr_tty=False)
        self.assertEqual(rc, 0, err)
        self.assertIn("[1] all_reduce 64 B done", tty)
        self.assertIn("OK: every result checked", tty)
        self.assertEqual(err, "")
        rc, tty, out = self.run_on_terminal(*args)
        self.assertEqual(rc, 0, tty)
        self.assertIn("[1] all_reduce 64 B done", tty)
        self.assertRegex(tty, r"\[\d+\] broadcast 1 MiB done")
        self.assertNotIn("done", out)  # the report stays clean
        # Not on a terminal, or with --json: no progress at all.
        r = pacer(*args)
        self.assertNotIn("done", r.stdout + r.stderr)

    @unittest.skipUnless(MPIRUN, "mpirun not installed")
    def test_tune_from_report(self):
        r = pacer("comm", "tune", "--bench", self.report_path, "--params", "25e6", "--backward", "80ms", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        t = json.loads(r.stdout)
        self.assertEqual(t["schema"], "pacer.comm.tune/1")
        self.assertEqual(t["gradient_bytes"], 1e8)
        self.assertEqual([s["framework"] for s in t["settings"]], ["pytorch_ddp", "megatron", "deepspeed"])
        ds = t["settings"][2]
        self.assertEqual(ds["option"], "reduce_bucket_size")
        self.assertEqual(ds["unit"], "elements")
        # Elements, not bytes: the pick in bytes / 4, unless DeepSpeed's default
        # (5e8 elements) exposes no more (e.g. both are one whole-gradient
        # bucket when the measured fit makes one message best).
        # (Within one element: a pick of 4n+2 bytes rounds either way.)
        if abs(ds["recommended"] - t["best"]["bucket_bytes"] / 4) > 1:
            self.assertEqual(ds["recommended"], ds["default"])
            self.assertEqual(ds["at_recommended"], ds["at_default"])
        for s in t["settings"]:
            self.assertLessEqual(s["at_recommended"]["exposed_s"], s["at_default"]["exposed_s"] + 1e-9)
        self.assertLessEqual(t["best"]["exposed_s"], t["single_all_reduce_s"] + 1e-9)  # one bucket is the single all-reduce, summed in another order
        self.assertEqual(t["bench"]["source"], self.report_path)
        human = pacer("comm", "tune", "--bench", self.report_path, "--gradient-size", "50MB", "--dtype", "bf16",
                      "--backward", "80ms")
        self.assertEqual(human.returncode, 0, human.stderr)
        self.assertIn("bucket_cap_mb", human.stdout)
        self.assertEqual(human.stdout.strip().splitlines()[-1], "OK")


class CommUsage(unittest.TestCase):
    def test_bad_arguments_exit_2(self):
        for args in (["comm", "bench", "--collectives", "allreduce"],
                     ["comm", "bench", "--max-size", "4", "--min-size", "8"],
                     ["comm", "bench", "--dtype", "fp8"],
                     ["comm", "tune", "--backward", "1s"],
                     ["comm", "tune", "--params", "1e6", "--backward", "soon"],
                     ["comm", "bench", "--backend", "gloo"]):
            r = pacer(*args)
            self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
            self.assertTrue(r.stderr.strip(), args)

    def test_nccl_backend_names_the_library_that_did_not_load(self):
        # hw's one NCCL loader: comm reports what it tried, in the words vet uses.
        env = dict(MPI_ENV, PACER_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
        r = subprocess.run([PACER, "comm", "bench", "--backend", "nccl", *SMALL], capture_output=True, text=True,
                           timeout=120, env=env)
        if "built without NCCL" in r.stderr:
            self.skipTest("pacer built without NCCL")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("cannot load NCCL (tried /nonexistent/libnccl.so.2 (PACER_NCCL_LIBRARY): ", r.stderr)
        self.assertIn("set PACER_NCCL_LIBRARY to libnccl.so.2", r.stderr)

    def test_tune_names_bad_report_file(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "not-bench.json")
            with open(bad, "w") as f:
                json.dump({"schema": "pacer.vet/1"}, f)
            r = pacer("comm", "tune", "--bench", bad, "--params", "1e6", "--backward", "1s")
            self.assertEqual(r.returncode, 2)
            self.assertIn("not-bench.json", r.stderr)
            r = pacer("comm", "tune", "--bench", os.path.join(d, "missing.json"), "--params", "1e6", "--backward", "1s")
            self.assertEqual(r.returncode, 2)
            self.assertIn("missing.json", r.stderr)


if __name__ == "__main__":
    unittest.main()
