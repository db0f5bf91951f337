"""`pacer run --nodes` without Slurm: the leader, agents on fake nodes of this machine (fake_launcher.py), real processes.

Each fake node is a process tree with its own PACER_NODE_NAME; hangs are
injected with hang_train.py, lost nodes by SIGKILL of an agent, nodes that
fail their vet with `pacer vet --inject NODE:CHECK=VALUE`, unreachable ones
with fake_launcher.py's $FAKE_DOWN_FILE.
"""
import json
import os
import signal
import subprocess
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PACER = os.environ.get("PACER_BIN", os.path.join(HERE, os.pardir, os.pardir, "build", "bin", "pacer"))
PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.environ.get("PACER_PYTHONPATH", os.path.join(os.path.dirname(os.path.abspath(PACER)), os.pardir, "python"))
HANG_TRAIN = os.path.join(HERE, "hang_train.py")
LAUNCHER = f"{PYTHON} {os.path.join(HERE, 'fake_launcher.py')}"
# Every node's vet passes on this machine whatever its state (an injected
# value), unless a test injects a failing one for a node.
VET = ["--vet", "quick", "--vet-only", "system.nofile", "--vet-inject", "system.nofile=1048576"]


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class ClusterTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name
        self.log = os.path.join(self.d, "run.jsonl")
        self.down = os.path.join(self.d, "down")
        self.events = os.path.join(self.d, "train.jsonl")

    def tearDown(self):
        self.tmp.cleanup()

    def env(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(PYTHONPATH=PYTHONPATH, FAKE_DOWN_FILE=self.down)
        return env

    def argv(self, *args, nodes="n1,n2,n3"):
        return [PACER, "run", "--log", self.log, "--node-list", nodes, "--launcher", LAUNCHER, "--vet-launcher",
                LAUNCHER, "--leader-addr", "127.0.0.1", "--restart-delay", "0.1s", "--stop-timeout", "5s", *args]

    def run_pacer(self, *args, nodes="n1,n2,n3", timeout=120):
        return subprocess.run(self.argv(*args, nodes=nodes), capture_output=True, text=True, env=self.env(),
                              timeout=timeout)

    def train(self, *extra):
        return [PYTHON, HANG_TRAIN, "--events", self.events, *extra]

    def logged(self, kind):
        return [e for e in read_log(self.log) if e["event"] == kind]

    def wait_for(self, pred, timeout=60, proc=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc and proc.poll() is not None:
                self.fail(f"pacer run ended ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            got = pred()
            if got:
                return got
            time.sleep(0.05)
        self.fail(f"timed out; log: {[e['event'] for e in read_log(self.log)]}")

    def lose(self, node, proc):
        """The node goes down: its agent is SIGKILLed and the launcher cannot reach it any more."""
        agent = self.wait_for(lambda: next((e for e in self.logged("agent") if e["host"] == node), None), proc=proc)
        with open(self.down, "w") as f:
            f.write(node + "\n")
        os.kill(agent["agent_pid"], signal.SIGKILL)

    def test_hang_on_one_node_is_named_killed_everywhere_and_relaunched(self):
        r = self.run_pacer("--nodes", "2", "--hang-timeout", "2s", "--",
                           *self.train("--ranks", "2", "--hang-rank", "3", "--steps", "250", "--hang-at", "4",
                                       "--step-s", "0.02"))
        self.assertEqual(r.returncode, 0, r.stderr)
        [hang] = self.logged("hang")
        # Global rank 3 is local rank 1 of node rank 1 (n2); the others kept stepping.
        self.assertEqual((hang["rank"], hang["host"], hang["node_rank"], hang["local_rank"], hang["step"]),
                         (3, "n2", 1, 1, 3))
        self.assertFalse(hang["all_stalled"])
        self.assertGreaterEqual(hang["idle_s"], 2)
        self.assertEqual(sorted((x["host"], x["rank"]) for x in hang["ranks"]),
                         [("n1", 0), ("n1", 1), ("n2", 2), ("n2", 3)])
        texts = {(x["host"], x["rank"]): x["text"] for x in hang["stacks"]}
        self.assertIn("stuck_in_collective", texts[("n2", 3)])
        self.assertNotIn("stuck_in_collective", texts[("n1", 0)])
        self.assertEqual(set(hang["gpu"]), {"n1", "n2"})
        self.assertIn("rank 3 on n2", r.stderr)
        # Both nodes of attempt 0 were stopped (SIGTERM), then attempt 1 ran on both to the end.
        exits = [(e["host"], e["attempt"], e["exit_code"]) for e in self.logged("node-exited")]
        self.assertEqual(sorted(x for x in exits if x[1] == 0), [("n1", 0, 143), ("n2", 0, 143)])
        self.assertEqual(sorted(x for x in exits if x[1] == 1), [("n1", 1, 0), ("n2", 1, 0)])
        self.assertEqual([e["attempt"] for e in self.logged("started")], [0, 1])
        self.assertEqual(self.logged("started")[1]["nodes"], ["n1", "n2"])  # no --vet: a hung node is kept

    def test_monitor_puts_every_node_and_the_leaders_events_in_one_run(self):
        # Each agent samples into its node's file (job-n1.db, job-n2.db); the
        # leader's events go to job.db, and at the end the node files are
        # merged into its run: the hang, the restart and both nodes' samples
        # and steps are one run, the one pacer score and pacer report pick.
        import sqlite3
        db = os.path.join(self.d, "job.db")
        r = self.run_pacer("--nodes", "2", "--monitor", "--monitor-db", db, "--monitor-interval", "100ms",
                           "--hang-timeout", "1500ms", "--",
                           *self.train("--ranks", "2", "--hang-rank", "3", "--steps", "30", "--hang-at", "4",
                                       "--step-s", "0.02", "--telemetry"), nodes="n1,n2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("2 node catalog(s) merged into", r.stderr)
        for node in ("n1", "n2"):
            self.assertTrue(os.path.exists(os.path.join(self.d, f"job-{node}.db")), node)
        con = sqlite3.connect(db)
        runs = con.execute("SELECT run_id, exit_code, command FROM runs").fetchall()
        self.assertEqual(len(runs), 1, runs)
        run_id, exit_code, command = runs[0]
        self.assertEqual(exit_code, 0)
        self.assertIn("pacer run --nodes 2 --", command)
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE run_id = ? ORDER BY t", (run_id,))]
        for kind in ("run.cluster", "run.agent", "run.hang", "run.stop", "run.exited", "run.restart", "run.done"):
            self.assertIn(kind, kinds)
        # Steps of all 4 ranks, from both attempts (the hung rank 3 stopped at step 3 in attempt 0).
        ranks = dict(con.execute("SELECT rank, COUNT(*) FROM steps WHERE run_id = ? GROUP BY rank", (run_id,)).fetchall())
        self.assertEqual(sorted(ranks), [0, 1, 2, 3])
        self.assertGreaterEqual(min(ranks.values()), 30)
        # Samples from both node files: each node's pacer monitor ran in each attempt.
        self.assertGreater(con.execute("SELECT COUNT(*) FROM samples WHERE run_id = ?", (run_id,)).fetchone()[0], 0)
        sources = con.execute("SELECT hostname FROM run_sources WHERE run_id = ?", (run_id,)).fetchall()
        self.assertEqual(sorted(h for (h,) in sources if h in ("n1", "n2")), ["n1", "n1", "n2", "n2"])
        con.close()
        score = subprocess.run([PACER, "score", "--json", db], capture_output=True, text=True)
        self.assertEqual(score.returncode, 0, score.stderr)
        self.assertEqual(json.loads(score.stdout)["run_id"], run_id)
        html = os.path.join(self.d, "report.html")
        rep = subprocess.run([PACER, "report", db, "-o", html], capture_output=True, text=True)
        self.assertEqual(rep.returncode, 0, rep.stderr)
        with open(html) as f:
            self.assertIn("run.hang", f.read())
        q = subprocess.run([PACER, "query", "--json", db, "SELECT detail FROM events WHERE kind = 'run.hang'"],
                           capture_output=True, text=True)
        self.assertEqual(q.returncode, 0, q.stderr)
        self.assertIn("rank 3 on n2", q.stdout)

    def test_torchrun_workers_heartbeat_and_a_hung_one_is_named(self):
        # torchrun on each agent, 2 workers each, gloo: torchrun gives the
        # workers RANK and LOCAL_RANK, pacer gives torchrun the node rank, the
        # node count and the rendezvous port. Rank 3 (n2, local rank 1)
        # stops before step 5; the others block in that step's all_reduce.
        has_torch = subprocess.run([PYTHON, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('torch'))"])
        if has_torch.returncode != 0:
            self.skipTest(f"no torch for {PYTHON}")
        torchrun = (f"exec {PYTHON} -m torch.distributed.run --nnodes=$PACER_NNODES --node_rank=$PACER_NODE_RANK "
                    "--nproc_per_node=2 --master_addr=127.0.0.1 --master_port=$MASTER_PORT "
                    # torch 1.13 on Python 3.11 cannot parse its own default "0" for these (docs/run.md)
                    f"--redirects 1 --tee 1 --log_dir {os.path.join(self.d, 'torchrun')} "
                    f"{os.path.join(HERE, 'torch_train.py')} --hang-rank 3 --hang-at 5 --events {self.events}")
        r = self.run_pacer("--nodes", "2", "--hang-timeout", "3s", "--max-restarts", "0", "--", "bash", "-c", torchrun,
                           nodes="n1,n2")
        self.assertEqual(r.returncode, 3, r.stderr)
        with open(self.events) as f:
            workers = sorted((e["node"], e["rank"], e["local_rank"], e["world"]) for e in map(json.loads, f))
        self.assertEqual(workers, [("n1", 0, 0, 4), ("n1", 1, 1, 4), ("n2", 2, 0, 4), ("n2", 3, 1, 4)])
        [hang] = self.logged("hang")
        self.assertEqual((hang["rank"], hang["host"], hang["node_rank"], hang["local_rank"], hang["step"]),
                         (3, "n2", 1, 1, 4))
        self.assertEqual(sorted((x["host"], x["rank"], x["local_rank"]) for x in hang["ranks"]),
                         [("n1", 0, 0), ("n1", 1, 1), ("n2", 2, 0), ("n2", 3, 1)])
        texts = {x["rank"]: x["text"] or "" for x in hang["stacks"]}
        self.assertIn("stuck_in_collective", texts[3])
        for rank in (0, 1, 2):
            self.assertIn("all_reduce", texts[rank])
        self.assertEqual(sorted(e["host"] for e in self.logged("node-exited")), ["n1", "n2"])
        self.assertIn("restart limit of 0", self.logged("give-up")[0]["message"])

    def test_hang_in_a_gloo_job_across_nodes_names_the_rank_outside_the_all_reduce(self):
        # One rank per node in one gloo job; rank 1 (n2) stops in its compute,
        # rank 0 blocks in the all_reduce: both stop at the same step.
        probe = "import torch.distributed as d, sys; sys.exit(0 if d.is_available() and d.is_gloo_available() else 3)"
        if subprocess.run([PYTHON, "-c", probe], capture_output=True).returncode != 0:
            self.skipTest(f"no torch.distributed with gloo under {PYTHON}")
        r = self.run_pacer("--nodes", "2", "--hang-timeout", "2s", "--",
                           *self.train("--dist", "--master-addr", "127.0.0.1", "--ranks", "1", "--hang-plan",
                                       "1:compute", "--hang-at", "3", "--steps", "10", "--step-s", "0.05"),
                           timeout=180)
        self.assertEqual(r.returncode, 0, r.stderr)
        [hang] = self.logged("hang")
        self.assertEqual((hang["rank"], hang["host"], hang["node_rank"]), (1, "n2", 1))
        self.assertEqual((hang["named"]["rank"], hang["named"]["host"], hang["named"]["rule"]), (1, "n2", "stacks"))
        self.assertRegex(hang["named"]["reason"], r"^rank 0 on n1 waits in torch\.distributed\.all_reduce "
                         r"\(hang_train\.py:\d+ in train_dist\); rank 1 on n2 does not$")
        self.assertEqual({x["step"] for x in hang["ranks"]}, {2})
        ops = {(x["host"], x["rank"]): (x["collective"] or {}).get("op") for x in hang["stacks"]}
        self.assertEqual(ops, {("n1", 0): "torch.distributed.all_reduce", ("n2", 1): None})
        self.assertEqual([e["attempt"] for e in self.logged("started")], [0, 1])
        with open(self.events) as f:
            firsts = [json.loads(line) for line in f if '"first-step"' in line]
        self.assertEqual(sorted(e["rank"] for e in firsts if e["attempt"] == 1), [0, 1])

    def test_lost_node_is_revetted_excluded_and_replaced_by_a_spare(self):
        # n4 fails its vet before the first attempt; n2's agent is SIGKILLed
        # mid-run and n2 cannot be reached any more: the next attempt runs on n1, n3.
        p = subprocess.Popen(self.argv("--nodes", "2", *VET, "--vet-inject", "n4:system.nofile=1", "--hang-timeout",
                                       "30s", "--", *self.train("--ranks", "1", "--steps", "60", "--step-s", "0.05"),
                                       nodes="n1,n2,n3,n4"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())
        self.lose("n2", p)
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 0, err)
        [spare] = [e for e in self.logged("exclude") if e["node"] == "n4"]
        self.assertIn("system.nofile", spare["reason"])
        [lost] = self.logged("node-lost")
        self.assertEqual(lost["host"], "n2")
        self.assertIn("connection closed", lost["message"])
        n2_vet = [e for e in self.logged("vet") if e.get("node") == "n2"][-1]
        self.assertEqual(n2_vet["verdict"], "error")
        self.assertIn("unreachable", n2_vet["message"])
        self.assertEqual([e["nodes"] for e in self.logged("started")], [["n1", "n2"], ["n1", "n3"]])
        self.assertEqual(self.logged("shrink"), [])

    def test_shrink_to_min_nodes_then_give_up_below(self):
        # n2 is lost and unreachable: with --min-nodes 1 the job goes on on n1 alone.
        train = self.train("--ranks", "1", "--steps", "60", "--step-s", "0.05")
        for min_nodes, code in (("1", 0), ("2", 1)):
            if os.path.exists(self.log):
                os.unlink(self.log)
            if os.path.exists(self.down):
                os.unlink(self.down)
            p = subprocess.Popen(self.argv("--nodes", "2", "--min-nodes", min_nodes, *VET, "--", *train, nodes="n1,n2"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())
            self.lose("n2", p)
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, code, err)
            if code == 0:
                [shrink] = self.logged("shrink")
                self.assertEqual((shrink["from"], shrink["to"], shrink["nodes"]), (2, 1, ["n1"]))
                self.assertEqual(self.logged("started")[-1]["nodes"], ["n1"])
            else:
                [give_up] = self.logged("give-up")
                self.assertIn("1 good node(s) left (n1), --min-nodes 2", give_up["message"])
                self.assertIn("n2 (vet unreachable", give_up["message"])

    def test_walltime_signal_reaches_every_node_then_requeue(self):
        # Slurm's warning to the leader becomes a request on the node; CMD
        # commits, the attempt is stopped and pacer exits 75 (bare: not requeued).
        train = [PYTHON, os.path.join(HERE, "train.py"), "--steps", "400", "--every", "1000", "--sleep", "0.05",
                 "--events", self.events]
        p = subprocess.Popen(self.argv("--nodes", "1", "--ckpt-dir", os.path.join(self.d, "ckpt"), "--grace", "30s",
                                       "--", *train, "--ckpt", os.path.join(self.d, "ckpt"), nodes="n1,n2"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())
        self.wait_for(lambda: os.path.exists(self.events), proc=p)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 75, err)
        [req] = self.logged("checkpoint-request")
        self.assertIn("SIGUSR1 received", req["message"])
        self.assertEqual(len(self.logged("committed")), 1)
        self.assertIn("not requeued: no Slurm job", self.logged("requeue")[0]["message"])
        with open(self.events) as f:
            saves = [json.loads(line) for line in f if '"save"' in line]
        self.assertTrue(saves and saves[0]["requested"], saves)

    def test_attempts_without_progress_count_across_requeues(self):
        # The job starts inside the --before window (the request reaches the
        # agent when it connects); CMD never commits, so the allocation ends
        # after the grace period without progress: exit 75 and the count in
        # --ckpt-dir. The next allocation carries it on and gives up (exit 1).
        ckpt = os.path.join(self.d, "ckpt")
        state = os.path.join(ckpt, ".pacer-run.json")
        args = ("--nodes", "1", "--ckpt-dir", ckpt, "--end-time", "+1h", "--before", "2h", "--grace", "1s", "--",
                *self.train("--ranks", "1", "--steps", "2000", "--step-s", "0.05"))
        first = self.run_pacer(*args, nodes="n1,n2")
        self.assertEqual(first.returncode, 75, first.stderr)
        self.assertIn("inside the --before window", first.stderr)
        with open(state) as f:
            self.assertEqual(json.load(f)["no_progress"], 1)
        self.assertEqual(self.logged("history"), [])
        second = self.run_pacer(*args, nodes="n1,n2")
        self.assertEqual(second.returncode, 1, second.stderr)
        [history] = self.logged("history")
        self.assertEqual(history["no_progress"], 1)
        [give_up] = self.logged("give-up")
        self.assertIn("2 consecutive attempt(s) without a new committed step", give_up["message"])
        self.assertIn("counting earlier allocations; not requeued", give_up["message"])
        self.assertFalse(os.path.exists(state))

    def test_signals_during_the_restart_delay(self):
        # One wait_to_restart for both supervisors: Slurm's warning between
        # attempts requeues at once (--nodes), a stop signal ends the run (one node).
        ckpt = os.path.join(self.d, "ckpt")
        leader = self.argv("--nodes", "1", "--ckpt-dir", ckpt, "--", "false")
        leader[leader.index("--restart-delay") + 1] = "30s"
        for argv, sig, code, text in (
                (leader, signal.SIGUSR1, 75,
                 "SIGUSR1 received between attempts"),
                ([PACER, "run", "--log", self.log, "--restart-delay", "30s", "--hang-timeout", "0", "--", "false"],
                 signal.SIGTERM, 128 + signal.SIGTERM, "SIGTERM received while waiting to restart")):
            if os.path.exists(self.log):
                os.unlink(self.log)
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())
            self.wait_for(lambda: self.logged("restart"), proc=p)
            p.send_signal(sig)
            out, err = p.communicate(timeout=20)
            self.assertEqual(p.returncode, code, err)
            self.assertIn(text, err)
            self.assertEqual(len(self.logged("started")), 1)
        # The crash before the requeue counts in the next allocation.
        with open(os.path.join(ckpt, ".pacer-run.json")) as f:
            self.assertEqual(json.load(f)["no_progress"], 1)

    def test_bad_agents_get_error_events_and_never_hang_the_leader(self):
        bad = f"{PYTHON} {os.path.join(HERE, 'bad_agent.py')}"
        r = subprocess.run([PACER, "run", "--log", self.log, "--node-list", "n1", "--nodes", "1", "--launcher", bad,
                            "--leader-addr", "127.0.0.1", "--max-restarts", "0", "--", "true"],
                           capture_output=True, text=True, env=self.env(), timeout=60)
        self.assertEqual(r.returncode, 3, r.stderr)
        [refused] = self.logged("agent-refused")
        self.assertIn("wrong token", refused["message"])
        [error] = self.logged("agent-error")
        self.assertIn("n1: bad progress report", error["message"])
        self.assertEqual(self.logged("node-lost")[0]["host"], "n1")
        self.assertIn("restart limit of 0", self.logged("give-up")[0]["message"])

    def test_usage_errors(self):
        for extra, expect in ((["--nodes", "4"], "the allocation has only 3 node(s)"),
                              (["--nodes", "2", "--min-nodes", "3"], "--min-nodes 3 must lie between 1 and --nodes 2"),
                              (["--min-nodes", "1"], "need --nodes")):
            r = self.run_pacer(*extra, "--", "true")
            self.assertEqual(r.returncode, 2, (extra, r.stderr))
            self.assertIn(expect, r.stderr)
        r = subprocess.run([PACER, "run", "--nodes", "2", "--", "true"], capture_output=True, text=True, env=self.env())
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("SLURM_JOB_NODELIST unset", r.stderr)


if __name__ == "__main__":
    unittest.main()
