"""examples/gpt/sbatch.sh in real Slurm batch jobs (tests/run/slurm_cluster.py's single-node cluster), 2 ranks each.

    PYTHONPATH=BUILD/python PACER_BIN=BUILD/bin/pacer /usr/bin/python3 -m unittest -v test_gpt_slurm

Three jobs of the tiny config on a small corpus (a few epochs in 24 steps), run one after the
other (each takes both CPUs of a 2-core machine):
- plain: uninterrupted, the checkpoint interval planned by `pacer plan ckpt`; then pacer score,
  pacer report and pacer plan step;
- killed: rank 1 is SIGKILLed mid-way; srun ends the other rank, pacer run restarts the job step
  and it resumes from the latest checkpoint;
- walltime: `--time=2 --signal=B:USR1@110` and `--before 110s`: the first allocation is slow, is asked
  for a checkpoint before its time limit, is requeued, and the next allocation resumes.
Afterwards every step's loss equals the plain run's bit for bit, every rank read the same documents
at every step, and within each epoch every token of the dataset was read exactly once (at most once
in the last, unfinished epoch) across the ranks and restarts.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.normpath(os.path.join(HERE, "..", "..", "examples", "gpt"))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "run")))

import slurm_cluster  # noqa: E402

PACER = os.path.abspath(os.environ.get("PACER_BIN", os.path.join(HERE, "../../build/bin/pacer")))
PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
STEPS = 24
TRAIN = "--threads 1 --device cpu --warmup 4 --keep-last 2"


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@unittest.skipUnless(shutil.which("spm_train"), "needs spm_train (Debian: sentencepiece)")
class GptSlurm(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = slurm_cluster.missing_reason()
        if reason:
            raise unittest.SkipTest(reason)
        cls.tmp = tempfile.mkdtemp(prefix="pacer-gpt-slurm-")
        os.chmod(cls.tmp, 0o755)
        # A tokenizer learnt on 60 KB of text, then a dataset of its smallest files (about 5,000 tokens:
        # 10 steps of 2 x 4 x 64 tokens an epoch), made with that tokenizer (prepare.py --tokenizer).
        vocab = os.path.join(cls.tmp, "vocab")
        r = subprocess.run([PYTHON, os.path.join(EXAMPLE, "prepare.py"), vocab, "--max-mb", "0.06",
                            "--vocab-size", "500", "--threads", "2"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise AssertionError("prepare.py failed:\n" + r.stderr)
        files, size = [], 0
        for f in sorted(os.listdir(os.path.join(vocab, "corpus")), key=lambda f: os.path.getsize(os.path.join(vocab, "corpus", f))):
            files += ["--input", os.path.join(vocab, "corpus", f)]
            size += os.path.getsize(os.path.join(vocab, "corpus", f))
            if size > 14000 and len(files) >= 4:
                break
        cls.data = os.path.join(cls.tmp, "prep", "data")
        r = subprocess.run([PYTHON, os.path.join(EXAMPLE, "prepare.py"), os.path.dirname(cls.data), *files,
                            "--tokenizer", os.path.join(vocab, "tok.model")], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise AssertionError("prepare.py --tokenizer failed:\n" + r.stderr)
        cls.cluster = slurm_cluster.start_or_skip(os.path.join(cls.tmp, "cluster"))
        # DDP's bucket size from pacer comm tune, over an all-reduce measured here with 2 MPI ranks.
        cls.tune = None
        mpirun = shutil.which("mpirun")
        if mpirun:
            bench, tune = os.path.join(cls.tmp, "bench.json"), os.path.join(cls.tmp, "tune.json")
            b = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", PACER, "comm", "bench",
                                "--max-size", "16MiB", "--iters", "5", "--output", bench], capture_output=True, timeout=120)
            with open(tune, "w") as f:
                t = subprocess.run([PACER, "comm", "tune", "--bench", bench, "--params", "5e5", "--backward", "100ms",
                                    "--json"], stdout=f, timeout=60) if b.returncode == 0 else b
            cls.tune = tune if t.returncode == 0 else None
        cls.jobs, cls.dirs = {}, {}
        # The order they run in: one job at a time fits the machine.
        cls.submit("plain", ["--time=5"], train="")
        cls.submit("killed", ["--time=5"], train="--ckpt-every 8 --hold-after 13" + (f" --comm-tune {cls.tune}" if cls.tune else ""),
                   run="--max-restarts 2 --restart-delay 0")
        # Slurm may send the warning up to a minute early: here anywhere in the first 10 s; --before 110s asks at
        # 10 s at the latest. The test gives the requeued job a longer limit, so the next allocation finishes.
        cls.submit("walltime", ["--time=2", "--signal=B:USR1@110"], train="--ckpt-every 100 --slow-first 0.5",
                   before="110s")

    # The vet gate (--vet quick) still runs before every job step, without the checks whose verdict
    # depends on how busy the shared test machine is: foreign load, CPU, storage and memory bandwidth
    # figures, and the memory other tests leave available.
    VET_SKIP = "system.load,system.mem_available,cpu,storage,memory.bandwidth"

    @classmethod
    def submit(cls, name, sbatch_args, train, run="", before="3m"):
        d = os.path.join(cls.tmp, name)
        os.makedirs(d)
        env = dict(cls.cluster.env, OUT=d, DATA=cls.data, EXAMPLE_DIR=EXAMPLE, PACER=PACER, PYTHON=PYTHON,
                   PYTHONPATH=os.environ.get("PYTHONPATH", ""), STEPS=str(STEPS), BATCH="4", SEQ="64",
                   TRAIN_ARGS=f"{TRAIN} {train}", RUN_ARGS=f"--grace 30s --stop-timeout 10s {run}", BEFORE=before,
                   VET_SKIP=cls.VET_SKIP, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(slurm_cluster.free_port()))
        out = subprocess.run([slurm_cluster._which("sbatch"), "--parsable", f"--job-name=gpt-{name}",
                              f"--output={d}/job.out", "--ntasks=2", *sbatch_args, os.path.join(EXAMPLE, "sbatch.sh")],
                             env=env, capture_output=True, text=True, check=True, cwd=d)
        cls.jobs[name], cls.dirs[name] = out.stdout.strip().split(";")[0], d

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        if os.environ.get("PACER_KEEP_SLURM") != "1":
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def output(self, name):
        try:
            with open(os.path.join(self.dirs[name], "job.out"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def finished(self, name, timeout=150):
        j = self.cluster.wait(self.jobs[name], timeout)
        self.assertEqual(j["JobState"], "COMPLETED", f"{j}\n{self.output(name)}")
        return j

    def assert_same_as_plain(self, name):
        self.finished("plain")
        want = {x["step"]: x for x in records(os.path.join(self.dirs["plain"], "ckpt", "losses.jsonl"))}
        got = {x["step"]: x for x in records(os.path.join(self.dirs[name], "ckpt", "losses.jsonl"))}
        self.assertEqual(sorted(got), list(range(STEPS)), self.output(name))
        for step in range(STEPS):
            self.assertEqual(got[step]["batch"], want[step]["batch"], f"step {step}: other tokens than the plain run's")
            self.assertEqual(got[step]["loss_hex"], want[step]["loss_hex"], f"step {step}: a loss differs from the plain run's")
        for rank in (0, 1):
            mine = records(os.path.join(self.dirs[name], "ckpt", f"samples-rank{rank}.jsonl"))
            plain = records(os.path.join(self.dirs["plain"], "ckpt", f"samples-rank{rank}.jsonl"))
            self.assertEqual(mine, plain, f"rank {rank} read other documents than in the plain run")
        self.assert_each_token_once(name)

    def assert_each_token_once(self, name):
        import pacer.data

        ds = pacer.data.open(self.data)
        lengths = [len(ds[d]) for d in range(len(ds))]
        per_epoch = {}
        for rank in (0, 1):
            recs = records(os.path.join(self.dirs[name], "ckpt", f"samples-rank{rank}.jsonl"))
            self.assertEqual([r["step"] for r in recs], list(range(STEPS)), f"rank {rank}: steps missing or repeated")
            for r in recs:
                seen = per_epoch.setdefault(r["epoch"], [0] * len(lengths))
                for doc, n in r["documents"]:
                    seen[doc] += n
        epochs = sorted(per_epoch)
        self.assertGreaterEqual(len(epochs), 2, "the run should cross an epoch boundary")
        for e in epochs[:-1]:
            self.assertEqual(per_epoch[e], lengths, f"epoch {e}: some token not read exactly once")
        self.assertTrue(all(s <= n for s, n in zip(per_epoch[epochs[-1]], lengths)), "a token read twice in the last epoch")

    def test_plain_run_plans_its_interval_and_reports(self):
        self.finished("plain")
        out, d = self.output("plain"), self.dirs["plain"]
        self.assertRegex(out, r"train: checkpoint every \d+ steps \(pacer plan ckpt: a save blocks")
        self.assertIn("DDP bucket_cap_mb 25 (DDP's default)", out)
        self.assertRegex(out, r"RESOURCE +SCORE +EVIDENCE(.|\n)*\nOK: [a-z-]+: ", "pacer score printed no verdict")
        self.assertTrue(os.path.getsize(os.path.join(d, "report.html")) > 1000)
        self.assertRegex(out, r"measured: step [\d.]+ ms \(predicted [\d.]+ ms")
        gate = [e for e in records(os.path.join(d, "run.jsonl")) if e["event"] == "vet"]
        self.assertTrue(gate and all(e["verdict"] == "pass" for e in gate), gate)  # the vet gate ran, with VET_SKIP
        self.assert_each_token_once("plain")
        import sqlite3

        db = sqlite3.connect(os.path.join(d, "gpt.db"))
        rows = db.execute("SELECT rank, COUNT(*), MIN(tokens), MIN(comm_s) FROM steps GROUP BY rank").fetchall()
        self.assertEqual([(r[0], r[1]) for r in rows], [(0, STEPS), (1, STEPS)])
        self.assertTrue(all(r[2] > 0 and r[3] is not None and r[3] >= 0 for r in rows), rows)

    def test_killed_rank_restarts_and_resumes(self):
        d = self.dirs["killed"]
        deadline = time.time() + 150
        pid = None
        while time.time() < deadline and pid is None:
            m = re.search(r"train: holding after step 13 \(rank 1, pid (\d+)\)", self.output("killed"))
            if m:
                pid = int(m.group(1))
            elif self.cluster.job(self.jobs["killed"]).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            else:
                time.sleep(0.3)
        self.assertIsNotNone(pid, "rank 1 never held after step 13:\n" + self.output("killed"))
        os.kill(pid, signal.SIGKILL)
        self.finished("killed")
        kinds = [e["event"] for e in records(os.path.join(d, "run.jsonl"))]
        self.assertIn("restart", kinds, self.output("killed"))
        self.assertIn("resumed from step 7", self.output("killed"))
        if self.tune:
            with open(self.tune) as f:
                cap = next(x["recommended"] for x in json.load(f)["settings"] if x["framework"] == "pytorch_ddp")
            self.assertIn(f"DDP bucket_cap_mb {cap:g} (pacer comm tune ({self.tune}))", self.output("killed"))
        self.assert_same_as_plain("killed")

    def test_walltime_requeues_and_resumes(self):
        # Once requeued, the job gets 5 minutes: its next allocation finishes instead of being asked again.
        job = self.jobs["walltime"]
        deadline = time.time() + 150
        while time.time() < deadline:
            j = self.cluster.job(job)
            if int(j.get("Restarts", "0") or 0) >= 1 or j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.2)
        subprocess.run([slurm_cluster._which("scontrol"), "update", f"JobId={job}", "TimeLimit=5"], env=self.cluster.env,
                       capture_output=True)
        j = self.finished("walltime", timeout=240)
        self.assertGreaterEqual(int(j["Restarts"]), 1, self.output("walltime"))
        log = records(os.path.join(self.dirs["walltime"], "run.jsonl"))
        kinds = [e["event"] for e in log]
        self.assertIn("checkpoint-request", kinds)
        self.assertIn("requeued", kinds)
        committed = next(e for e in log if e["event"] == "committed")["committed_step"]
        self.assertLess(committed, STEPS - 1)
        self.assertIn(f"resumed from step {committed}", self.output("walltime"))
        self.assert_same_as_plain("walltime")


if __name__ == "__main__":
    unittest.main()
