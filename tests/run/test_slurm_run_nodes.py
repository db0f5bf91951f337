"""`pacer run --nodes 2` in a 3-node batch job of emulated multi-node Slurm (slurm_cluster.Cluster(root, nodes=3)).

The leader runs in the batch script on the first node and launches its
agents with the default srun prefix; one node is a spare.
- hang: global rank 3 (node rank 1, local rank 1) stops heartbeating while
  alive; the leader names it and its node, stops the attempt on both nodes
  and relaunches; the job completes.
- dead_node: the second node is SIGKILLed (slurmd, slurmstepd, agent, CMD)
  mid-run; the leader loses it, its re-vet through srun fails, it is
  excluded and the next attempt runs on the first node and the spare; the
  job (sbatch --no-kill) completes.
Skips, saying why, where the emulated cluster cannot run (slurm_cluster.missing_reason).
"""
import json
import os
import time
import unittest

import test_slurm_nodes

HERE = os.path.dirname(os.path.abspath(__file__))
PACER = os.path.abspath(os.environ.get("PACER_BIN", os.path.join(HERE, "../../build/bin/pacer")))
PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.path.abspath(os.environ.get("PACER_PYTHONPATH", os.path.join(os.path.dirname(PACER), os.pardir, "python")))
HANG_TRAIN = os.path.join(HERE, "hang_train.py")
NODES = test_slurm_nodes.NODES
JOB = """#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --no-kill
#SBATCH --no-requeue
#SBATCH --output={dir}/job.out
export PYTHONPATH={pythonpath}
# The node names of the emulation resolve nowhere: agents reach the leader by address.
exec {pacer} run --nodes 2 --leader-addr "$(hostname -I | cut -d' ' -f1)" --restart-delay 0 --stop-timeout 5s \\
    --log {dir}/run.jsonl {run_args} -- {python} {train} --events {dir}/train.jsonl {train_args}
"""


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class SlurmRunNodesTest(unittest.TestCase):
    # The cluster's start, skips and teardown checks (no process or link left) are test_slurm_nodes's.
    setUpClass = classmethod(test_slurm_nodes.SlurmNodesTest.setUpClass.__func__)
    tearDownClass = classmethod(test_slurm_nodes.SlurmNodesTest.tearDownClass.__func__)

    def submit(self, name, run_args, train_args):
        d = os.path.join(self.tmp, name)
        os.makedirs(d)
        path = os.path.join(d, "job.sh")
        with open(path, "w") as f:
            f.write(JOB.format(nodes=NODES, dir=d, pythonpath=PYTHONPATH, pacer=PACER, python=PYTHON, train=HANG_TRAIN,
                               run_args=run_args, train_args=train_args))
        return d, self.cluster.sbatch(path)

    def finish(self, d, job_id, timeout=150):
        job = self.cluster.wait(job_id, timeout)
        with open(os.path.join(d, "job.out")) as f:
            out = f.read()
        log = read_jsonl(os.path.join(d, "run.jsonl"))
        self.assertEqual(job["JobState"], "COMPLETED", f"{job}\n{out[-4000:]}")
        return log, out

    def test_hang_in_one_rank_is_named_and_relaunched(self):
        c = self.cluster
        d, job_id = self.submit("hang", "--hang-timeout 3s --monitor --monitor-db {}/job.db --monitor-interval 200ms"
                                .format(os.path.join(self.tmp, "hang")),
                                "--ranks 2 --hang-rank 3 --steps 300 --hang-at 5 --step-s 0.02 --telemetry")
        log, out = self.finish(d, job_id)
        hangs = [e for e in log if e["event"] == "hang"]
        self.assertEqual(len(hangs), 1, f"{[(e['event'], e.get('attempt'), e.get('message')) for e in log]}\n{out[-3000:]}")
        [hang] = hangs
        self.assertEqual((hang["rank"], hang["host"], hang["node_rank"]), (3, c.nodes[1], 1), out[-3000:])
        texts = {(x["host"], x["rank"]): x["text"] for x in hang["stacks"]}
        self.assertIn("stuck_in_collective", texts[(c.nodes[1], 3)])
        started = [e for e in log if e["event"] == "started"]
        self.assertEqual([e["nodes"] for e in started], [c.nodes[:2], c.nodes[:2]])
        stopped = sorted(e["host"] for e in log if e["event"] == "node-exited" and e["attempt"] == 0)
        self.assertEqual(stopped, c.nodes[:2])
        self.assertEqual(log[-1]["event"], "done", out[-3000:])
        # --monitor: each node sampled itself into job-NODE.db; the leader
        # merged them into job.db, into the run of this Slurm job.
        import sqlite3
        self.assertIn("2 node catalog(s) merged into", out)
        con = sqlite3.connect(os.path.join(d, "job.db"))
        [(run_id, job)] = con.execute("SELECT run_id, job_id FROM runs").fetchall()
        self.assertEqual(job, str(job_id))
        hosts = {h for (h,) in con.execute("SELECT DISTINCT hostname FROM samples_named WHERE run_id = ?", (run_id,))}
        self.assertEqual(hosts, set(c.nodes[:2]))
        ranks = {r for (r,) in con.execute("SELECT DISTINCT rank FROM steps WHERE run_id = ?", (run_id,))}
        self.assertEqual(ranks, {0, 1, 2, 3})
        kinds = {k for (k,) in con.execute("SELECT kind FROM events WHERE run_id = ?", (run_id,))}
        self.assertTrue({"run.hang", "run.restart", "run.done"} <= kinds, kinds)
        con.close()

    def test_dead_node_is_excluded_and_the_spare_takes_over(self):
        c = self.cluster
        vet = "--vet quick --vet-only system.nofile --vet-inject system.nofile=1048576"
        d, job_id = self.submit("dead", f"{vet} --hang-timeout 60s", "--ranks 1 --steps 400 --step-s 0.05")
        victim = c.nodes[1]
        deadline = time.time() + 60
        while not any(e["event"] == "agent" and e["host"] == victim for e in read_jsonl(os.path.join(d, "run.jsonl"))):
            self.assertLess(time.time(), deadline, f"no agent on {victim}: {c.job(job_id)}")
            time.sleep(0.2)
        time.sleep(1)
        c.kill_node(victim)
        try:
            log, out = self.finish(d, job_id, timeout=240)
        finally:
            c.start_node(victim)
        lost = [e for e in log if e["event"] == "node-lost"]
        self.assertEqual([e["host"] for e in lost], [victim], out[-3000:])
        [excluded] = [e for e in log if e["event"] == "exclude"]
        self.assertEqual(excluded["node"], victim)
        started = [e for e in log if e["event"] == "started"]
        self.assertEqual([e["nodes"] for e in started], [c.nodes[:2], [c.nodes[0], c.nodes[2]]])
        self.assertEqual(log[-1]["event"], "done", out[-3000:])


if __name__ == "__main__":
    unittest.main()
