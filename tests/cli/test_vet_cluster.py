"""Integration tests for `pacer vet --cluster`: four MPI ranks as four logical nodes on one machine."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

from cli_util import PACER, pacer

MPIRUN = os.environ.get("PACER_MPIRUN") or shutil.which("mpirun")
# Running as root in CI containers, oversubscribing 2 cores, without the
# shared-memory single-copy path that containers often forbid.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_plm": "isolated",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}
# Cheap checks only; the foreign-load check is meaningless with four "nodes" on one host.
FAST = ["--quick", "--skip", "system.load,storage,cpu,memory.pattern"]
# The figures of FAST that are compared between nodes (checks with a direction), fixed for every node:
# four ranks measuring at once on a busy 2-core machine (each rank's bandwidth probe taking 256 MiB
# while another reads MemAvailable) can make a healthy node an outlier. The probes still run.
FIXED = ["--inject", "memory.bandwidth=10", "--inject", "system.mem_available=90"]


@unittest.skipUnless(MPIRUN, "mpirun not found")
class VetCluster(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-vet-cluster-")
        self.dir = self.tmp.name
        # Each rank claims its own logical node, node0..node3.
        self.wrapper = os.path.join(self.dir, "as_node.sh")
        with open(self.wrapper, "w") as f:
            f.write('#!/bin/sh\nexec "%s" vet --node-name "node${OMPI_COMM_WORLD_RANK}" "$@"\n' % PACER)
        os.chmod(self.wrapper, 0o755)
        self.report = os.path.join(self.dir, "cluster.json")

    def tearDown(self):
        self.tmp.cleanup()

    def cluster(self, *args, timeout=120):
        env = dict(os.environ, **MPI_ENV)
        cmd = [MPIRUN, "--oversubscribe", "-np", "4", self.wrapper, "--cluster", "--json-file", self.report, *args]
        start = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.dir,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
            r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
            r.mpirun_hung = False
        except subprocess.TimeoutExpired:
            # Open MPI 4.1.4's mpirun sometimes hangs tearing down a job whose
            # rank left without MPI_Finalize; the ranks themselves are gone.
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            r = subprocess.CompletedProcess(cmd, -9, out, err)
            r.mpirun_hung = True
        r.wall_s = time.monotonic() - start
        self.assertTrue(os.path.exists(self.report), f"no report; rc {r.returncode}\n{r.stdout}\n{r.stderr}")
        with open(self.report) as f:
            r.json = json.load(f)
        return r

    def node(self, r, name):
        return next(n for n in r.json["nodes"] if n["name"] == name)

    def test_slow_node_is_an_outlier_and_need_excludes_it(self):
        hosts = os.path.join(self.dir, "hosts.txt")
        exclude = os.path.join(self.dir, "exclude.txt")
        # Every node reports 10 GB/s except node2: exact figures, so the verdict does not depend on the machine.
        r = self.cluster(*FAST, "--skip", "network", *FIXED, "--inject", "node2:memory.bandwidth=1.0",
                         "--need", "3", "--hostfile", hosts, "--exclude-file", exclude)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = r.json
        self.assertEqual(j["schema"], "pacer.vet.cluster/1")
        self.assertEqual(j["ranks"], 4)
        self.assertEqual([n["name"] for n in j["nodes"]], ["node0", "node1", "node2", "node3"])
        bw = next(o for o in j["outliers"] if o["check"] == "memory.bandwidth")
        self.assertEqual(bw["median"], 10)
        by_node = {e["node"]: e for e in bw["nodes"]}
        self.assertEqual(by_node["node2"]["status"], "fail")
        self.assertAlmostEqual(by_node["node2"]["ratio"], 0.1)
        for other in ["node0", "node1", "node3"]:
            self.assertEqual(by_node[other]["status"], "pass")
        self.assertEqual(self.node(r, "node2")["status"], "fail")
        self.assertIn("outlier: memory.bandwidth", self.node(r, "node2")["reasons"][0])
        # The check itself passed its absolute threshold: only the comparison caught it.
        nb = next(c for c in self.node(r, "node2")["report"]["checks"] if c["name"] == "memory.bandwidth")
        self.assertEqual(nb["status"], "pass")
        # Best first: the order among equally healthy nodes follows their figures, so compare as sets.
        with open(hosts) as f:
            self.assertEqual(sorted(f.read().split()), ["node0", "node1", "node3"])
        with open(exclude) as f:
            self.assertEqual(f.read().split(), ["node2"])
        self.assertEqual(sorted(j["selection"]["chosen"]), ["node0", "node1", "node3"])
        self.assertEqual(j["selection"]["excluded"], ["node2"])
        self.assertTrue(j["selection"]["enough"])
        self.assertIn("selected 3 of 3 needed", r.stdout)
        self.assertRegex(r.stdout.splitlines()[-1], r"^OK: 4 nodes")

    def test_fewer_healthy_nodes_than_needed_exits_4(self):
        r = self.cluster(*FAST, "--skip", "network", *FIXED, "--inject", "node2:memory.bandwidth=1.0",
                         "--need", "4", "--hostfile", os.path.join(self.dir, "h"), "--exclude-file", os.path.join(self.dir, "x"))
        self.assertEqual(r.returncode, 4, r.stdout + r.stderr)
        self.assertEqual(r.json["verdict"], "too_few")
        self.assertEqual(sorted(r.json["selection"]["chosen"]), ["node0", "node1", "node3"])

    def test_version_drift_fails_the_odd_node(self):
        # Fixed figures for every node (FIXED): this test is about drift alone.
        r = self.cluster(*FAST, "--skip", "network", *FIXED, "--inject", "node3:software.kernel=6.99.0-test")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        drift = next(d for d in r.json["drift"] if d["key"] == "software.kernel")
        self.assertEqual(drift["values"]["6.99.0-test"], ["node3"])
        self.assertEqual(sorted(drift["values"][drift["reference"]]), ["node0", "node1", "node2"])
        self.assertEqual(self.node(r, "node3")["status"], "fail")
        self.assertIn("drift: software.kernel", self.node(r, "node3")["reasons"][0])
        for other in ["node0", "node1", "node2"]:
            self.assertTrue(self.node(r, other)["healthy"], self.node(r, other).get("reasons"))
        self.assertIn("6.99.0-test  <- differs", r.stdout)

    def test_hung_check_and_wedged_node_end_within_the_bound(self):
        # node1's check hangs far longer than the bound; node2's leader never reports.
        bound = 20
        # Without the network tests: on a busy 2-core machine their 1 s slots may time out and blame
        # healthy nodes; test_slow_link_bisection_blames_the_node covers them.
        r = self.cluster(*FAST, "--skip", "network", "--bound", f"{bound}s", "--timeout", "120s",
                         *FIXED, "--inject", "node1:system.nofile=hang", "--inject", "node2:cluster.report=hang", timeout=bound + 25)
        if r.mpirun_hung:
            # What pacer controls: every rank of this run ended soon after the bound.
            left = subprocess.run(["pgrep", "-f", self.dir], capture_output=True, text=True).stdout.split()
            self.assertEqual(left, [], "pacer ranks still running after the bound")
        else:
            self.assertLess(r.wall_s, bound + 20)  # the bound plus mpirun's start and teardown, not the 120 s hang
        # Rank 0 exits 1 without MPI_Finalize so that mpirun ends the wedged rank;
        # Open MPI 4.1.4's mpirun sometimes crashes while tearing such a job down,
        # so its own status is only required to be a failure.
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        j = r.json
        self.assertEqual(j["exit_code"], 1)
        self.assertLessEqual(j["duration_s"], bound)
        nofile = next(c for c in self.node(r, "node1")["report"]["checks"] if c["name"] == "system.nofile")
        self.assertEqual(nofile["status"], "error")
        self.assertIn("timed out", nofile["reason"])
        wedged = self.node(r, "node2")
        self.assertIsNone(wedged["report"])
        self.assertEqual(wedged["status"], "error")
        self.assertTrue(any("did not answer" in x for x in wedged["reasons"]), wedged["reasons"])
        for other in ["node0", "node3"]:
            self.assertTrue(self.node(r, other)["healthy"], self.node(r, other)["reasons"])

    def test_slow_link_bisection_blames_the_node(self):
        # Loose link thresholds, so that only the injected slowness (not a busy CI machine) trips them.
        profile = os.path.join(self.dir, "loose.toml")
        with open(profile, "w") as f:
            f.write("[cluster]\nlink_warn_ratio = 0.1\nlink_fail_ratio = 0.05\n")
        r = self.cluster(*FAST, "--profile", profile, "--inject", "node2:network.p2p=0.001")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        net = r.json["network"]
        self.assertEqual(net["suspects"], ["node2"])
        bisect = [l for l in net["links"] if l["kind"] == "bisect"]
        self.assertEqual(len(bisect), 1)
        self.assertEqual(bisect[0]["a"], "node2")
        self.assertEqual(bisect[0]["status"], "fail")
        self.assertEqual(net["allreduce"]["status"], "pass")
        self.assertGreater(net["allreduce"]["busbw_gbps"], 0)
        self.assertAlmostEqual(net["allreduce"]["busbw_gbps"], net["allreduce"]["algbw_gbps"] * 2 * 3 / 4)
        self.assertEqual(net["nccl"]["status"], "skip")
        if not os.path.isdir("/sys/class/infiniband"):
            # No RDMA hardware: each ring pair says why it could not test, and that judges nobody.
            self.assertEqual(len(net["rdma"]), 4, net["rdma"])
            for x in net["rdma"]:
                self.assertEqual(x["status"], "skip")
                self.assertIn("no active InfiniBand or RoCE port", x["reason"])
            self.assertIn("rdma (perftest): skip", r.stdout)
            for n in r.json["nodes"]:
                self.assertFalse([x for x in n["reasons"] if x.startswith("rdma")], n["reasons"])
        self.assertEqual(self.node(r, "node2")["status"], "fail")
        self.assertIn("network suspects", r.stdout)


class VetBounds(unittest.TestCase):
    """Without mpirun: the bounded prolog mode and the options that only apply with --cluster."""

    def test_prolog_bound_cuts_a_hung_check(self):
        start = time.monotonic()
        r = pacer("vet", "--prolog", "--bound", "3s", "--timeout", "120s", "--only", "system", "--inject", "system.nofile=hang", "--json")
        self.assertLess(time.monotonic() - start, 30)
        self.assertEqual(r.returncode, 1, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["mode"], "quick")
        nofile = next(c for c in j["checks"] if c["name"] == "system.nofile")
        self.assertEqual(nofile["status"], "error")

    def test_injection_for_another_node_is_ignored(self):
        r = pacer("vet", "--node-name", "here", "--only", "system.nofile", "--inject", "elsewhere:system.nofile=1", "--json")
        j = json.loads(r.stdout)
        self.assertEqual(j["host"], "here")
        self.assertEqual(j["injections"], [])
        r = pacer("vet", "--node-name", "here", "--only", "system.nofile", "--inject", "here:system.nofile=1", "--json")
        j = json.loads(r.stdout)
        self.assertEqual(j["injections"], [{"check": "system.nofile", "action": "value", "value": 1.0, "node": "here"}])
        self.assertEqual(j["checks"][0]["status"], "fail")

    def test_cluster_only_options_are_usage_errors(self):
        self.assertEqual(pacer("vet", "--need", "3").returncode, 2)
        r = pacer("vet", "--inject", "network.p2p=1")
        self.assertEqual(r.returncode, 2)
        self.assertIn("only with --cluster", r.stderr)


if __name__ == "__main__":
    unittest.main()
