"""`pacer run` inside real Slurm batch jobs on a single-node cluster started by the test.

Five jobs run side by side (one CPU each, as many at once as the machine has CPUs):
- signal: `sbatch --signal=B:USR1@55 --time=1`; the first run is slow enough that
  Slurm's warning comes before it ends; pacer asks for a checkpoint, waits for
  the committed step, stops the trainer and requeues the job; the requeued run
  resumes from that step and finishes.
- endtime: no --signal; pacer learns EndTime from `scontrol show job` and asks
  for the checkpoint `--before 50s` of it.
- crash: the trainer crashes once; pacer restarts it within the allocation from
  the latest committed step.
- giveup: the trainer crashes at once every time; pacer gives up after two
  attempts without a new committed step and exits with its status.
- early: Slurm's warning comes before `exec pacer run` (and is lost there);
  pacer finds the job inside its `--before` window and asks for the
  checkpoint as CMD starts.
Each finished run must hold exactly the state of an uninterrupted run.

Skips, saying why, when Slurm or munge is not installed or not running as
root; PACER_REQUIRE_SLURM=1 turns a cluster that does not come up into a failure.
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import slurm_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
PACER = os.path.abspath(os.environ.get("PACER_BIN", os.path.join(HERE, "../../build/bin/pacer")))
PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.path.abspath(os.environ.get("PACER_PYTHONPATH", os.path.join(os.path.dirname(PACER), os.pardir, "python")))
TRAIN = os.path.join(HERE, "train.py")
STEPS = 60

JOB = """#!/bin/bash
#SBATCH --job-name=pacer-{name}
#SBATCH --output={dir}/job.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --time=1
{extra_sbatch}
export PYTHONPATH={pythonpath}
# The first run is slow, so that the time limit comes before the end; a
# requeued run is fast. What the runs compute does not depend on it.
SLEEP={slow}
if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then SLEEP=0; fi
{pre_exec}
# A warning that came before the exec would end bash (USR1's default action).
# Ignored, it is discarded, not kept for pacer: --before (at least the
# warning's lead) stands in for it.
trap '' USR1
exec {pacer} run --ckpt-dir {dir}/ckpt --grace 30s --stop-timeout 10s --restart-delay 0 \\
    --log {dir}/run.jsonl {run_args} -- \\
    {python} {train} --steps {steps} --every 10 --sleep $SLEEP --events {dir}/events.jsonl {train_args}
"""


# The first run waits, noting Slurm's warning, until the warning has come
# (USR1@55 of a 1 min job: in its first seconds, or when slurmctld next looks).
EARLY = """if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  trap 'touch {dir}/early-usr1' USR1
  for i in $(seq 40); do [ -e {dir}/early-usr1 ] && break; sleep 1; done
fi"""


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class SlurmRunTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = slurm_cluster.missing_reason()
        if reason:
            raise unittest.SkipTest(reason)
        cls.tmp = tempfile.mkdtemp(prefix="pacer-slurm-")
        os.chmod(cls.tmp, 0o755)
        cls.cluster = slurm_cluster.start_or_skip(os.path.join(cls.tmp, "cluster"))
        cls.jobs = {}
        cls.dirs = {}
        specs = {
            "signal": dict(extra_sbatch="#SBATCH --signal=B:USR1@55", run_args="--signal USR1", slow="2", train_args=""),
            "endtime": dict(extra_sbatch="", run_args="--before 50s", slow="2", train_args=""),
            "crash": dict(extra_sbatch="", run_args="--max-restarts 2", slow="0", train_args="--crash-at 35"),
            "giveup": dict(extra_sbatch="", run_args="--max-restarts 5 --give-up-after 2", slow="0",
                           train_args="--crash-always"),
            # The warning comes while the script still runs (the trap notes
            # it), before pacer run exists; pacer finds itself inside its
            # --before window at start and asks for the checkpoint at once.
            "early": dict(extra_sbatch="#SBATCH --signal=B:USR1@55", run_args="--signal USR1 --before 58s", slow="2",
                          train_args="", pre_exec=EARLY),
        }
        for name, spec in specs.items():
            d = os.path.join(cls.tmp, name)
            os.makedirs(d)
            script = os.path.join(d, "job.sh")
            spec["pre_exec"] = spec.get("pre_exec", "").format(dir=d)
            with open(script, "w") as f:
                f.write(JOB.format(name=name, dir=d, pacer=PACER, python=PYTHON, train=TRAIN, pythonpath=PYTHONPATH,
                                   steps=STEPS, **spec))
            cls.dirs[name] = d
            cls.jobs[name] = cls.cluster.sbatch(script)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        if os.environ.get("PACER_KEEP_SLURM") != "1":  # for a post-mortem of the logs
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def finished(self, name, timeout=240):
        j = self.cluster.wait(self.jobs[name], timeout)
        d = self.dirs[name]
        with open(os.path.join(d, "job.out"), errors="replace") as f:
            self.output = f.read()
        return j, read_jsonl(os.path.join(d, "run.jsonl")), read_jsonl(os.path.join(d, "events.jsonl"))

    def assert_exact_state(self, name):
        out = subprocess.run([PYTHON, TRAIN, "--check", os.path.join(self.dirs[name], "ckpt"), "--steps", str(STEPS)],
                             env=dict(os.environ, PYTHONPATH=PYTHONPATH), capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "EQUAL", out.stderr)

    def assert_requeued_and_resumed(self, name, reason_word):
        job, log, events = self.finished(name)
        self.assertEqual(job["JobState"], "COMPLETED", f"{job}\n{self.output}")
        self.assertGreaterEqual(int(job["Restarts"]), 1, self.output)
        kinds = [e["event"] for e in log]
        self.assertIn("checkpoint-request", kinds, self.output)
        self.assertIn("committed", kinds, self.output)
        self.assertIn("requeued", kinds, self.output)
        request = next(e for e in log if e["event"] == "checkpoint-request")
        self.assertIn(reason_word, request["message"])
        # The requeued run started from the step committed on request. (The
        # trainer's own "save" line may be missing: pacer stops it as soon as
        # the commit is visible, perhaps before it wrote that line.)
        committed = next(e for e in log if e["event"] == "committed")["committed_step"]
        saved = [e for e in events if e["what"] == "save" and e["requested"] and e["restart"] == 0]
        self.assertLessEqual(len(saved), 1, events)
        if saved:
            self.assertEqual(saved[0]["step"], committed)
        resumed = [e for e in events if e["what"] == "start" and e["restart"] == 1]
        self.assertEqual(resumed[0]["step"], committed, events)
        self.assertLess(committed, STEPS)
        self.assertEqual(events[-1]["what"], "done")
        self.assert_exact_state(name)

    def test_signal_checkpoints_requeues_and_resumes(self):
        self.assert_requeued_and_resumed("signal", "SIGUSR1")

    def test_end_time_from_scontrol(self):
        self.assert_requeued_and_resumed("endtime", "job ends in")
        walltime = next(e for e in read_jsonl(os.path.join(self.dirs["endtime"], "run.jsonl"))
                        if e["event"] == "walltime")
        self.assertIn("scontrol show job", walltime["message"])

    def test_warning_before_pacer_run_is_not_lost(self):
        self.assert_requeued_and_resumed("early", "inside the window when CMD started")
        self.assertTrue(os.path.exists(os.path.join(self.dirs["early"], "early-usr1")), self.output)
        log = read_jsonl(os.path.join(self.dirs["early"], "run.jsonl"))
        walltime = next(e for e in log if e["event"] == "walltime")
        self.assertTrue(walltime["inside_window"], walltime)
        self.assertNotIn("SIGUSR1 received", " ".join(e["message"] for e in log))

    def test_crash_restarts_from_committed_step(self):
        job, log, events = self.finished("crash")
        self.assertEqual(job["JobState"], "COMPLETED", self.output)
        self.assertEqual(int(job["Restarts"]), 0)
        self.assertIn("restart", [e["event"] for e in log])
        self.assertEqual([e["step"] for e in events if e["what"] == "crash"], [35])
        starts = [e for e in events if e["what"] == "start"]
        self.assertEqual([(e["attempt"], e["step"]) for e in starts], [(0, 0), (1, 30)])
        self.assert_exact_state("crash")

    def test_gives_up_without_progress(self):
        job, log, events = self.finished("giveup")
        self.assertEqual(job["JobState"], "FAILED", self.output)
        self.assertEqual(job["ExitCode"], "3:0")
        give_up = [e for e in log if e["event"] == "give-up"]
        self.assertEqual(len(give_up), 1, self.output)
        self.assertIn("2 consecutive attempt(s) without a new committed step", give_up[0]["message"])
        self.assertEqual(len([e for e in events if e["what"] == "start"]), 2)


if __name__ == "__main__":
    unittest.main()
