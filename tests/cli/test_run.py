"""Integration tests for `pacer run` (bare, without Slurm) and `pacer ports`: the real binary and real processes.

The trainer (tests/run/train.py) runs under the python the module was built
for ($PACER_PYTHON) and finds the module through $PACER_PYTHONPATH.
"""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import unittest

from cli_util import PACER, pacer

PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.environ.get("PACER_PYTHONPATH",
                            os.path.join(os.path.dirname(os.path.abspath(PACER)), os.pardir, "python"))
TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "run", "train.py")
HANG_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "run", "hang_train.py")



def bare_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=PYTHONPATH, **extra)
    return env


def gloo_missing():
    """Why a torch.distributed gloo job cannot run under $PACER_PYTHON, or None."""
    probe = "import torch.distributed as d, sys; sys.exit(0 if d.is_available() and d.is_gloo_available() else 3)"
    r = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True)
    return None if r.returncode == 0 else f"no torch.distributed with gloo under {PYTHON}: {r.stderr[-300:]}"


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class RunTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name
        self.log = os.path.join(self.d, "run.jsonl")
        self.events = os.path.join(self.d, "events.jsonl")
        self.ckpt = os.path.join(self.d, "ckpt")

    def tearDown(self):
        self.tmp.cleanup()

    def run_pacer(self, *args, env=None, timeout=120):
        return subprocess.run([PACER, "run", "--log", self.log, *args], capture_output=True, text=True,
                              env=env or bare_env(), timeout=timeout)

    def train_cmd(self, *extra, steps=40, every=10):
        return [PYTHON, TRAIN, "--steps", str(steps), "--every", str(every), "--events", self.events, *extra]

    def kinds(self):
        return [e["event"] for e in read_log(self.log)]

    def assert_exact_state(self, steps):
        out = subprocess.run([PYTHON, TRAIN, "--check", self.ckpt, "--steps", str(steps)],
                             env=bare_env(), capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "EQUAL", out.stderr)

    def test_exit_status_passes_through(self):
        r = self.run_pacer("--max-restarts", "0", "--", "sh", "-c", "exit 7")
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("running bare", r.stderr)
        r = self.run_pacer("--max-restarts", "0", "--", "sh", "-c", "kill -KILL $$")
        self.assertEqual(r.returncode, 128 + signal.SIGKILL, r.stderr)
        r = self.run_pacer("--", "true")
        self.assertEqual(r.returncode, 0)
        self.assertEqual(self.kinds()[-1], "done")

    def test_monitor_samples_cmd_and_records_decisions(self):
        # CMD crashes once, then finishes: both attempts' samples and every
        # decision land in the one run that the supervisor began.
        import sqlite3
        db = os.path.join(self.d, "job.db")
        marker = os.path.join(self.d, "crashed")
        script = f"if [ -e {marker} ]; then sleep 0.5; exit 0; fi; touch {marker}; sleep 0.5; exit 3"
        r = self.run_pacer("--monitor", "--monitor-db", db, "--monitor-interval", "100ms", "--max-restarts", "1",
                           "--restart-delay", "0", "--", "sh", "-c", script)
        self.assertEqual(r.returncode, 0, r.stderr)
        con = sqlite3.connect(db)
        runs = con.execute("SELECT run_id, exit_code, interval_s, command FROM runs").fetchall()
        self.assertEqual(len(runs), 1, runs)
        run_id, exit_code, interval_s, command = runs[0]
        self.assertEqual(exit_code, 0)
        self.assertAlmostEqual(interval_s, 0.1)
        self.assertIn("pacer run -- sh -c", command)
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE run_id = ? ORDER BY t", (run_id,))]
        for kind in ("run.start", "run.started", "run.exited", "run.restart", "run.done"):
            self.assertIn(kind, kinds)
        self.assertEqual(con.execute("SELECT COUNT(*) FROM events WHERE run_id IS NOT ?", (run_id,)).fetchone()[0], 0)
        samples = con.execute("SELECT COUNT(*) FROM samples WHERE run_id = ?", (run_id,)).fetchone()[0]
        self.assertGreater(samples, 0)
        con.close()
        # The latest run, as pacer report and pacer score pick it, is that run.
        html = os.path.join(self.d, "report.html")
        rep = pacer("report", db, "-o", html)
        self.assertEqual(rep.returncode, 0, rep.stderr)
        with open(html) as f:
            self.assertIn("run.restart", f.read())
        score = pacer("score", "--json", db)
        self.assertEqual(score.returncode, 0, score.stderr)
        self.assertEqual(json.loads(score.stdout)["run_id"], run_id)

    def test_monitor_run_id_must_exist(self):
        db = os.path.join(self.d, "job.db")
        r = pacer("monitor", "--db", db, "--run-id", "5", "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no run 5", r.stderr)

    def test_monitor_records_the_vet_result(self):
        import sqlite3
        db = os.path.join(self.d, "vet.db")
        r = self.run_pacer("--monitor", "--monitor-db", db, "--vet", "quick", "--", "true", timeout=300)
        self.assertIn(r.returncode, (0, 1), r.stderr)  # 1: this machine failed vet, CMD not started
        con = sqlite3.connect(db)
        details = [d for (d,) in con.execute("SELECT detail FROM events WHERE kind = 'vet.quick'")]
        self.assertEqual(len(details), 1, r.stderr)
        self.assertIn("pacer vet --quick", details[0])

    def test_command_not_found_or_not_executable(self):
        r = self.run_pacer("--", "no-such-command-pacer")
        self.assertEqual(r.returncode, 127)
        self.assertIn("no-such-command-pacer: command not found", r.stderr)
        script = os.path.join(self.d, "noexec.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n")
        r = self.run_pacer("--", script)
        self.assertEqual(r.returncode, 126, r.stderr)

    def test_usage_errors(self):
        self.assertEqual(self.run_pacer("--signal", "KILL", "--", "true").returncode, 2)
        self.assertEqual(self.run_pacer("--grace", "soon", "--", "true").returncode, 2)
        self.assertEqual(self.run_pacer("--requeue", "maybe", "--", "true").returncode, 2)
        self.assertEqual(pacer("run").returncode, 2)

    def logged(self, kind):
        return [e for e in read_log(self.log) if e["event"] == kind]

    def hang_cmd(self, *extra):
        return [PYTHON, HANG_TRAIN, *extra]

    def test_hang_is_caught_with_stacks_then_restarted(self):
        r = self.run_pacer("--hang-timeout", "2s", "--restart-delay", "0.2s", "--",
                           *self.hang_cmd("--steps", "20", "--hang-at", "5", "--fork-worker"), timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.kinds()[-3:], ["started", "exited", "done"])
        [hang] = self.logged("hang")
        started = self.logged("started")
        self.assertEqual(len(started), 2)
        self.assertEqual(hang["rank"], 0)
        self.assertEqual(hang["step"], 4)  # the last heartbeat before it stopped
        self.assertGreaterEqual(hang["idle_s"], 2)
        self.assertTrue(hang["all_stalled"])
        # Detected within the timeout after the stop (5 steps of 0.05 s after the start), plus up to 2 s for
        # the stacks and a margin for Python's start on a loaded machine (a derived timeout would be 2 min).
        self.assertLess(hang["unix"] - started[0]["unix"], 0.25 + 2 + 2 + 8)
        [stacks] = hang["stacks"]
        self.assertEqual(stacks["pid"], hang["pid"])
        self.assertIn("stuck_in_collective", stacks["text"])
        self.assertNotIn("worker_loop", stacks["text"])  # the forked worker kept out of the rank's file
        self.assertIn("gpu", hang)
        self.assertIn("stuck_in_collective", r.stderr)  # the human log shows the stacks too
        self.assertEqual(self.logged("restart")[0]["message"].split(";")[0], "CMD hung")
        self.assertIn("finished", r.stdout)  # the second attempt heartbeated to its end

    def test_a_lagging_rank_is_named(self):
        r = self.run_pacer("--hang-timeout", "2s", "--restart-delay", "0.2s", "--",
                           *self.hang_cmd("--ranks", "2", "--hang-rank", "1", "--steps", "100", "--hang-at", "3"),
                           timeout=90)
        self.assertEqual(r.returncode, 0, r.stderr)
        [hang] = self.logged("hang")
        self.assertEqual((hang["rank"], hang["local_rank"], hang["step"]), (1, 1, 2))
        self.assertFalse(hang["all_stalled"])  # rank 0 kept stepping
        self.assertEqual(sorted(x["rank"] for x in hang["ranks"]), [0, 1])
        texts = {x["rank"]: x["text"] for x in hang["stacks"]}
        self.assertIn("stuck_in_collective", texts[1])
        self.assertNotIn("stuck_in_collective", texts[0])

    def test_hang_in_a_gloo_job_names_the_rank_the_collective_waits_for(self):
        # Three ranks, an all_reduce per step; in attempt 0 rank 2 enters a
        # barrier that 0 and 1 skip, and they block in the all_reduce. Every
        # rank stops at the same step, a moment apart: only the stacks tell
        # which one holds the others up. (A rank asleep in its compute:
        # run.cluster's gloo test, across nodes.)
        if gloo_missing():
            self.skipTest(gloo_missing())
        r = self.run_pacer("--hang-timeout", "3s", "--restart-delay", "0.1s", "--",
                           *self.hang_cmd("--dist", "--ranks", "3", "--hang-plan", "2:collective", "--hang-at", "3",
                                          "--steps", "8", "--step-s", "0.05", "--events", self.events), timeout=180)
        self.assertEqual(r.returncode, 0, r.stderr)
        [hang] = self.logged("hang")
        self.assertEqual((hang["attempt"], hang["rank"], hang["local_rank"]), (0, 2, 2))
        self.assertEqual((hang["named"]["rank"], hang["named"]["rule"]), (2, "stacks"))
        self.assertTrue(hang["all_stalled"])
        self.assertEqual({x["step"] for x in hang["ranks"]}, {2})  # a tie that steps cannot break
        ops = {x["rank"]: (x["collective"] or {}).get("op") for x in hang["stacks"]}
        self.assertEqual(ops, {0: "torch.distributed.all_reduce", 1: "torch.distributed.all_reduce",
                               2: "torch.distributed.barrier"})
        self.assertRegex(hang["named"]["reason"], r"^ranks 0,1 wait in torch\.distributed\.all_reduce "
                         r"\(hang_train\.py:\d+ in train_dist\); rank 2 waits in torch\.distributed\.barrier "
                         r"\(hang_train\.py:\d+ in train_dist\)$")
        self.assertIn("named: ranks 0,1 wait in", r.stderr)
        # The hung attempt was killed and relaunched; the relaunch stepped to the end.
        self.assertEqual([e["attempt"] for e in self.logged("started")], [0, 1])
        self.assertEqual([e["exit_code"] for e in self.logged("exited")], [143, 0])
        with open(self.events) as f:
            firsts = [json.loads(line) for line in f if '"first-step"' in line]
        self.assertEqual(sorted(e["rank"] for e in firsts if e["attempt"] == 1), [0, 1, 2])
        self.assertEqual(r.stdout.count("finished"), 3)

    def test_no_hang_before_the_first_heartbeat_or_when_off(self):
        r = self.run_pacer("--hang-timeout", "0.5s", "--", *self.hang_cmd("--never-beat", "--steps", "30"), timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.logged("hang"), [])
        probe = "import os, sys; sys.exit(3 if 'PACER_HEARTBEAT_FILE' in os.environ else 0)"
        r = self.run_pacer("--hang-timeout", "0", "--", PYTHON, "-c", probe)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.run_pacer("--max-restarts", "0", "--", PYTHON, "-c", probe)  # auto: on
        self.assertEqual(r.returncode, 3, r.stderr)
        # Without a supervisor heartbeat() does nothing.
        out = subprocess.run([PYTHON, "-c", "import pacer.run; pacer.run.heartbeat(1); pacer.run.heartbeat()"],
                             env=bare_env(), capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_hang_timeout_and_heartbeat_errors(self):
        for bad in ("soon", "-5s", "1e999d"):
            r = self.run_pacer("--hang-timeout", bad, "--", "true")
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn("--hang-timeout", r.stderr)
        beat = "import pacer.run\ntry:\n    pacer.run.heartbeat(1)\nexcept Exception as e:\n    print(type(e).__name__, e)"
        # A local rank that is no number, or beyond the file's slots.
        for local_rank, says in (("abc", "'abc' is not a number"), ("999", "local rank 999 (from LOCAL_RANK)")):
            r = self.run_pacer("--hang-timeout", "1m", "--", "env", f"LOCAL_RANK={local_rank}", PYTHON, "-c", beat)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("Error", r.stdout)
            self.assertIn(says, r.stdout)
        # A heartbeat file that is not one.
        junk = os.path.join(self.d, "junk")
        with open(junk, "wb") as f:
            f.write(b"x" * 100)
        out = subprocess.run([PYTHON, "-c", beat], env=bare_env(PACER_HEARTBEAT_FILE=junk), capture_output=True,
                             text=True)
        self.assertIn("not a heartbeat file", out.stdout)
        self.assertIn(junk, out.stdout)
        with open(junk, "wb") as f:
            f.write(b"y" * (64 + 256 * 64))
        out = subprocess.run([PYTHON, "-c", beat], env=bare_env(PACER_HEARTBEAT_FILE=junk), capture_output=True,
                             text=True)
        self.assertIn("corrupt header", out.stdout)

    def test_walltime_checkpoint_then_resume_to_the_exact_state(self):
        # The end time is 30 s away (or less: it is whole seconds) and
        # checkpoints are asked for 30 s before it: at once; the trainer (0.2 s
        # a step) cannot have finished.
        r = self.run_pacer("--ckpt-dir", self.ckpt, "--end-time", "+30s", "--before", "30s", "--grace", "60s", "--",
                           *self.train_cmd("--sleep", "0.2"))
        self.assertEqual(r.returncode, 75, r.stderr)
        self.assertIn("not requeued: no Slurm job (bare)", r.stderr)
        log = read_log(self.log)
        committed = next(e for e in log if e["event"] == "committed")["committed_step"]
        self.assertLess(committed, 40)
        request = next(e for e in log if e["event"] == "checkpoint-request")
        self.assertIn("job ends in", request["message"])
        # Inside the window at start: a Slurm warning lost before pacer run
        # (trap '' USR1) is not needed, the request comes as CMD starts.
        walltime = next(e for e in log if e["event"] == "walltime")
        self.assertTrue(walltime["inside_window"])
        self.assertIn("already inside the --before window of 30 s", walltime["message"])
        self.assertIn("inside the window when CMD started", request["message"])
        started = next(e for e in log if e["event"] == "started")
        self.assertLess(request["unix"] - started["unix"], 5)
        self.assertIn(["checkpoint-request", "committed", "stop", "exited", "requeue"],
                      [self.kinds()[i:i + 5] for i in range(len(log))])
        # The next allocation: same command, resumes from the committed step
        # and finishes; its end time is far outside the window.
        os.unlink(self.log)
        r = self.run_pacer("--ckpt-dir", self.ckpt, "--end-time", "+1h", "--before", "30s", "--",
                           *self.train_cmd())
        self.assertEqual(r.returncode, 0, r.stderr)
        walltime = next(e for e in read_log(self.log) if e["event"] == "walltime")
        self.assertFalse(walltime["inside_window"])
        self.assertNotIn("checkpoint-request", self.kinds())
        starts = [e["step"] for e in read_log(self.events) if e["what"] == "start"]
        self.assertEqual(starts, [0, committed])
        self.assert_exact_state(40)

    def test_signal_is_passed_on_as_a_request_signal(self):
        # SIGUSR1 to pacer (as Slurm's --signal would) -> SIGUSR2 to the trainer. The
        # request file cannot be created (its directory does not exist), so
        # the signal is the only way the trainer can learn of the request.
        p = subprocess.Popen([PACER, "run", "--log", self.log, "--ckpt-dir", self.ckpt, "--request-signal", "USR2",
                              "--request-file", os.path.join(self.d, "missing", "req"), "--",
                              *self.train_cmd("--sleep", "0.2", steps=400, every=0)],
                             env=bare_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # No periodic saves (every=0): a commit can only come from the request.
        while not os.path.exists(self.events):  # the trainer has installed its handler
            time.sleep(0.05)
        p.send_signal(signal.SIGUSR1)
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 75, err)
        log = read_log(self.log)
        request = next(e for e in log if e["event"] == "checkpoint-request")
        self.assertIn("SIGUSR1 received", request["message"])
        self.assertIn("request file FAILED", request["message"])
        self.assertIn("SIGUSR2", request["message"])
        self.assertIn("committed", self.kinds())
        self.assertLess(next(e for e in log if e["event"] == "committed")["committed_step"], 400)

    def test_no_commit_within_grace_stops_anyway(self):
        r = self.run_pacer("--ckpt-dir", self.ckpt, "--end-time", "+30s", "--before", "30s", "--grace", "1s",
                           "--stop-timeout", "5s", "--", *self.train_cmd("--sleep", "0.2", "--ignore-requests", steps=400))
        self.assertEqual(r.returncode, 75, r.stderr)
        stop = next(e for e in read_log(self.log) if e["event"] == "stop")
        self.assertIn("no new committed step within the grace period of 1 s", stop["message"])
        self.assertIn("stopped without a new committed step", r.stderr)

    def test_requeues_without_progress_give_up(self):
        # Every allocation ends at its time limit without a new commit: the
        # second one in a row gives up instead of requeueing again.
        args = ("--ckpt-dir", self.ckpt, "--end-time", "+30s", "--before", "30s", "--grace", "0.5s",
                "--stop-timeout", "5s", "--", *self.train_cmd("--sleep", "0.2", "--ignore-requests", steps=400, every=0))
        state = os.path.join(self.ckpt, ".pacer-run.json")
        r = self.run_pacer(*args)
        self.assertEqual(r.returncode, 75, r.stderr)
        with open(state) as f:
            self.assertEqual(json.load(f)["no_progress"], 1)
        # The count survives a CMD stopped before it made --ckpt-dir (it
        # sleeps through the grace period instead of starting to train).
        shutil.rmtree(self.ckpt)
        slow = ("--ckpt-dir", self.ckpt, "--end-time", "+30s", "--before", "30s", "--grace", "0.5s",
                "--stop-timeout", "5s", "--", sys.executable, "-c", "import time; time.sleep(60)")
        self.assertEqual(self.run_pacer(*slow).returncode, 75)
        with open(state) as f:
            self.assertEqual(json.load(f)["no_progress"], 1)
        r = self.run_pacer(*args)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("giving up: 2 consecutive attempt(s) without a new committed step", r.stderr)
        self.assertIn("counting earlier allocations; not requeued", r.stderr)
        self.assertFalse(os.path.exists(state))
        # A resubmission after giving up starts counting afresh.
        self.assertEqual(self.run_pacer(*args).returncode, 75)

    def test_crash_restarts_and_give_up(self):
        r = self.run_pacer("--ckpt-dir", self.ckpt, "--restart-delay", "0", "--",
                           *self.train_cmd("--crash-at", "25"))
        self.assertEqual(r.returncode, 0, r.stderr)
        starts = [(e["attempt"], e["step"]) for e in read_log(self.events) if e["what"] == "start"]
        self.assertEqual(starts, [(0, 0), (1, 20)])
        self.assert_exact_state(40)
        # No restarts allowed; then three attempts in a row without a commit.
        os.remove(self.log)
        r = self.run_pacer("--max-restarts", "0", "--", "sh", "-c", "exit 4")
        self.assertEqual(r.returncode, 4)
        self.assertIn("restart limit of 0 reached", r.stderr)
        r = self.run_pacer("--restart-delay", "0", "--give-up-after", "3", "--", "sh", "-c", "exit 5")
        self.assertEqual(r.returncode, 5)
        self.assertIn("giving up: 3 consecutive attempt(s) without a new committed step", r.stderr)

    def test_forwarded_sigterm_ends_without_restart(self):
        p = subprocess.Popen([PACER, "run", "--log", self.log, "--", "sleep", "60"], env=bare_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not os.path.exists(self.log) or "started" not in self.kinds():
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM, err)
        self.assertIn("not restarted", err)

    def test_scontrol_missing_or_failing(self):
        fake = os.path.join(self.d, "bin")
        os.makedirs(fake)
        with open(os.path.join(fake, "scontrol"), "w") as f:
            f.write("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
        os.chmod(os.path.join(fake, "scontrol"), stat.S_IRWXU)
        cases = ((fake, "failed (exit 1)"), (os.path.join(self.d, "empty"), "scontrol: cannot run: not found"))
        for i, (path, expect) in enumerate(cases):
            if os.path.exists(self.log):
                os.remove(self.log)
            env = bare_env(SLURM_JOB_ID="4242", PATH=path)
            # A job of its own each (the same --ckpt-dir would carry the
            # first one's attempt without progress over and give up).
            r = self.run_pacer("--ckpt-dir", f"{self.ckpt}-{i}", "--grace", "1s", "--", "/bin/sh", "-c",
                               "kill -USR1 $PPID; exec /bin/sleep 30", env=env)
            self.assertEqual(r.returncode, 75, r.stderr)
            log = read_log(self.log)
            walltime = next(e for e in log if e["event"] == "walltime")
            self.assertIn(expect, walltime["message"])
            self.assertIn("requeue-failed", self.kinds())

    def test_vet_quick_gates_the_start(self):
        # The verdict is this machine's at that moment (load from other tests
        # can flip system checks), so the test follows the verdict pacer run
        # logged: pass starts CMD, fail does not.
        marker = os.path.join(self.d, "started")
        r = self.run_pacer("--vet", "quick", "--", "touch", marker, timeout=300)
        vet_event = next(e for e in read_log(self.log) if e["event"] == "vet")
        verdict = vet_event["verdict"]
        self.assertIn(verdict, ("pass", "fail"))
        if verdict == "pass":
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(os.path.exists(marker))
        else:
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertFalse(os.path.exists(marker))
            self.assertIn("CMD not started", r.stderr)


    def test_vet_options_reach_the_quick_vet(self):
        # An injected busy CPU fails system.load and refuses CMD; skipping
        # that check starts it. The other check gets an injected passing
        # value, so that this machine's state cannot change the verdict.
        marker = os.path.join(self.d, "started")
        vet = ["--vet", "quick", "--vet-only", "system.load,system.nofile", "--vet-inject", "system.nofile=1048576"]
        r = self.run_pacer(*vet, "--vet-inject", "system.load=100", "--", "touch", marker)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertFalse(os.path.exists(marker))
        self.assertEqual(self.logged("vet")[-1]["failed"], ["system.load"])
        r = self.run_pacer(*vet, "--vet-skip", "system.load", "--", "touch", marker)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(marker))
        self.assertIn("passed (1 checks)", self.logged("vet")[-1]["message"])

    def test_walltime_signal_during_the_vet_is_deferred_not_lost(self):
        # A vet that takes 2 s (cpu.flops for 2 s, any speed passes); USR1
        # sent while it runs must reach the first attempt as a request.
        profile = os.path.join(self.d, "slow.toml")
        with open(profile, "w") as f:
            f.write('name = "slow"\n[checks."cpu.flops"]\nfail_below = 1e-9\n'
                    '[checks."cpu.flops".quick]\nduration = "2s"\n')
        wait_for_request = ('for i in $(seq 100); do [ -e "$PACER_CKPT_REQUEST_FILE" ] && { echo asked; exit 0; }; '
                            'sleep 0.1; done; echo never; exit 0')
        p = subprocess.Popen([PACER, "run", "--log", self.log, "--vet", "quick", "--vet-profile", profile,
                              "--vet-only", "cpu.flops", "--grace", "30s", "--", "/bin/sh", "-c", wait_for_request],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=bare_env())
        deadline = time.monotonic() + 30
        while not (os.path.exists(self.log) and "start" in self.kinds()):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(self.kinds().index("vet") + 1, self.kinds().index("walltime"))  # the vet ran to its end
        self.assertEqual(out.strip(), "asked", err)
        [req] = self.logged("checkpoint-request")
        self.assertIn("USR1 received", req["message"])

    def test_bad_vet_options_are_usage_errors_naming_the_option(self):
        cases = [
            (["--vet-skip", "nosuch"], "--vet-skip 'nosuch'"),
            (["--vet-only", "system.load", "--vet-skip", "system.load"], "no checks selected"),
            (["--vet-profile", "nosuch"], "--vet-profile nosuch"),
            (["--vet-inject", "nosuch=1"], "--vet-inject 'nosuch=1'"),
            (["--vet-only", "system.nofile", "--vet-inject", "system.load=1"], "system.load' is not selected"),
            (["--vet-timeout", "soon"], "--vet-timeout soon"),
        ]
        marker = os.path.join(self.d, "started")
        for extra, expect in cases:
            r = self.run_pacer("--vet", "quick", *extra, "--", "touch", marker)
            self.assertEqual(r.returncode, 2, (extra, r.stderr))
            self.assertIn(expect, r.stderr)
            self.assertFalse(os.path.exists(marker))
        r = self.run_pacer("--vet-skip", "system.load", "--", "touch", marker)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("need --vet quick", r.stderr)

class PortsTest(unittest.TestCase):
    def ports(self, *args, env=None):
        return subprocess.run([PACER, "ports", *args], capture_output=True, text=True, env=env or bare_env())

    def test_deterministic_disjoint_ranges(self):
        a = json.loads(self.ports("-n", "2", "--json", "--job", "123", "--local-rank", "0").stdout)
        b = json.loads(self.ports("-n", "2", "--json", "--job", "123", "--local-rank", "1").stdout)
        env = bare_env(SLURM_JOB_ID="123", SLURM_LOCALID="1")
        c = json.loads(self.ports("-n", "2", "--json", env=env).stdout)
        self.assertEqual(c["range"], b["range"])
        self.assertEqual((c["job_from"], c["local_rank_from"]), ("SLURM_JOB_ID", "SLURM_LOCALID"))
        self.assertEqual(b["range"][0], a["range"][1] + 1)
        for r in (a, b):
            self.assertEqual(len(r["ports"]), 2)
            self.assertTrue(all(r["range"][0] <= p <= r["range"][1] for p in r["ports"]))
        plain = self.ports("-n", "3", "--job", "5").stdout.split()
        self.assertEqual(len(plain), 3)

    def test_busy_ports_are_skipped_and_exhaustion_is_an_error(self):
        args = ["--job", "77", "--local-rank", "2", "--per-rank", "4"]
        rng = json.loads(self.ports("-n", "1", "--json", *args).stdout)["range"]
        held = []
        try:
            for port in range(rng[0], rng[0] + 3):
                s = socket.socket()
                s.bind(("", port))
                held.append(s)
            r = json.loads(self.ports("-n", "1", "--json", *args).stdout)
            self.assertEqual(r["ports"], [rng[0] + 3])
            r = self.ports("-n", "2", *args)
            self.assertEqual(r.returncode, 3)
            self.assertIn(f"port range {rng[0]}-{rng[1]} (job 77, local rank 2) exhausted", r.stderr)
        finally:
            for s in held:
                s.close()
        self.assertEqual(self.ports("-n", "5", *args).returncode, 2)
        self.assertEqual(self.ports("--local-rank", "8", "--job", "1").returncode, 2)

    def test_ports_stay_outside_the_kernels_ephemeral_range(self):
        with tempfile.TemporaryDirectory(prefix="pacer-proc-") as root:
            ipv4 = os.path.join(root, "proc/sys/net/ipv4")
            os.makedirs(ipv4)
            with open(os.path.join(ipv4, "ip_local_port_range"), "w") as f:
                f.write("20000\t30000\n")
            with open(os.path.join(ipv4, "ip_local_reserved_ports"), "w") as f:
                f.write("25000-25127\n")
            seen = set()
            for job in range(0, 300, 7):
                r = self.ports("-n", "1", "--json", "--job", str(job), "--proc-root", root)
                self.assertEqual(r.returncode, 0, r.stderr)
                j = json.loads(r.stdout)
                self.assertEqual(j["ephemeral"], [20000, 30000])
                self.assertEqual(j["reserved"], [[25000, 25127]])
                lo, hi = j["range"]
                self.assertTrue(hi < 20000 or lo > 30000 or (lo >= 25000 and hi <= 25127), j["range"])
                seen.add(lo)
            self.assertIn(25000, seen)
            with open(os.path.join(ipv4, "ip_local_port_range"), "w") as f:
                f.write("20000\n")
            r = self.ports("--proc-root", root)
            self.assertEqual(r.returncode, 2)
            self.assertIn("ip_local_port_range", r.stderr)

    def test_exec_hands_the_ports_over(self):
        r = self.ports("-n", "2", "--job", "9", "--", "sh", "-c", 'echo "$PACER_PORTS|$PACER_PORT_0|$PACER_PORT_1"')
        self.assertEqual(r.returncode, 0, r.stderr)
        ports, p0, p1 = r.stdout.strip().split("|")
        self.assertEqual(ports, f"{p0} {p1}")


if __name__ == "__main__":
    unittest.main()
