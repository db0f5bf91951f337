"""Integration tests for `pacer ckpt`: the real binary, its exit codes, output and what it does to directories.

The checkpoints are written by the pacer Python module, run by the python it
was built for ($PACER_PYTHON, default /usr/bin/python3, with numpy) and found
through $PACER_PYTHONPATH (default: python/ next to the binary's bin/), so the
python running these tests needs neither numpy nor the module.
"""
import json
import os
import shutil
import struct
import subprocess
import tempfile
import unittest

from cli_util import PACER, flip_byte, pacer

PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.environ.get("PACER_PYTHONPATH",
                            os.path.join(os.path.dirname(os.path.abspath(PACER)), os.pardir, "python"))

DATA_FILE = "rank-00000.bin"
PARTIAL = ".partial-step-000000000009-host-1-deadbeef"

# Writes checkpoints for the steps given; blob contents depend on the step.
WRITER = r"""
import json, sys
import numpy as np
import pacer
spec = json.loads(sys.argv[1])
ck = pacer.Checkpointer(spec["root"], keep_last=0, chunk_bytes=4096)
for s in spec["steps"]:
    blobs = {
        "weight": np.arange(s * 10000, s * 10000 + 3000, dtype=np.float32).reshape(30, 100),
        "count": np.array(s, dtype=np.int64),
        "tokens": b"tok" * s,
    }
    ck.save(s, blobs, meta={"step": s, "lr": 0.5}).wait()
"""



def step_dir(root, step):
    return os.path.join(root, f"step-{step:012d}")


def read_safetensors(path):
    """(header, {name: bytes}) of a safetensors file, read as the format describes it."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode())
    base = 8 + n
    data = {k: raw[base + v["data_offsets"][0]:base + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
    return n, header, data


# Loads a safetensors file into torch tensors with a reader written here (no
# safetensors package in Debian) and prints name, dtype, shape and sum.
TORCH_LOADER = r"""
import json, struct, sys, torch
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
types = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16, "F16": torch.float16}
out = {}
for k, v in header.items():
    if k == "__metadata__":
        continue
    b, e = v["data_offsets"]
    t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=types[v["dtype"]]).reshape(v["shape"])
    out[k] = [str(t.dtype), list(t.shape), float(t.double().sum())]
print(json.dumps(out))
"""



class CkptCli(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-ckpt-cli-")
        self.root = os.path.join(self.tmp.name, "ckpts")

    def tearDown(self):
        self.tmp.cleanup()

    def make(self, steps, partial=True):
        """Committed checkpoints for `steps` under self.root, and a leftover partial directory."""
        if "PACER_PYTHONPATH" not in os.environ and not os.path.exists(os.path.join(PYTHONPATH, "pacer", "__init__.py")):
            self.skipTest(f"no pacer Python module in {PYTHONPATH} (set PACER_PYTHONPATH)")
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        r = subprocess.run([PYTHON, "-c", WRITER, json.dumps({"root": self.root, "steps": list(steps)})],
                           capture_output=True, text=True, timeout=120, env=env)
        self.assertEqual(r.returncode, 0, f"writing checkpoints with {PYTHON} failed:\n{r.stdout}{r.stderr}")
        if partial:
            os.makedirs(os.path.join(self.root, PARTIAL))
            with open(os.path.join(self.root, PARTIAL, DATA_FILE), "wb") as f:
                f.write(b"half a save")

    def committed(self):
        return sorted(int(n[5:]) for n in os.listdir(self.root) if n.startswith("step-"))

    def corrupt(self, step, offset=100):
        flip_byte(os.path.join(step_dir(self.root, step), DATA_FILE), offset)

    def test_help(self):
        r = pacer("ckpt", "--help")
        self.assertEqual(r.returncode, 0)
        for sub in ["ls", "verify", "prune", "inspect", "export", "interval"]:
            self.assertIn(sub, r.stdout)
        self.assertIn("Exit codes", r.stdout)

    def test_ls_table_and_json(self):
        self.make([1, 2, 3])
        r = pacer("ckpt", "ls", self.root)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        for col in ["STEP", "SIZE", "STATUS", "PATH"]:
            self.assertIn(col, lines[0])
        rows = [line.split() for line in lines[1:] if line.strip()]
        # Newest first; the leftover is listed as partial, with why.
        self.assertEqual([row[0] for row in rows], ["9", "3", "2", "1"])
        self.assertIn("partial", lines[1])
        self.assertIn(PARTIAL, lines[1])
        self.assertIn("never committed", lines[1])
        for line, step in zip(lines[2:], [3, 2, 1]):
            self.assertIn("committed", line)
            self.assertIn(step_dir(self.root, step), line)

        r = pacer("ckpt", "ls", self.root, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.ckpt.ls/1")
        self.assertEqual(j["dir"], self.root)
        cks = j["checkpoints"]
        self.assertEqual([(c["step"], c["committed"]) for c in cks], [(9, False), (3, True), (2, True), (1, True)])
        self.assertEqual(cks[0]["path"], os.path.join(self.root, PARTIAL))
        self.assertIn("partial", cks[0]["problem"])
        for c in cks[1:]:
            self.assertEqual(c["path"], step_dir(self.root, c["step"]))
            self.assertEqual(c["bytes"], os.path.getsize(os.path.join(c["path"], DATA_FILE)))
            self.assertGreater(c["bytes"], 12000)  # the float32 weight alone
            self.assertFalse(c["verified"])  # not asked to
            self.assertEqual(c["problem"], "")

    def test_ls_verify(self):
        self.make([1, 2])
        r = pacer("ckpt", "ls", self.root, "--verify", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        by_step = {c["step"]: c for c in json.loads(r.stdout)["checkpoints"]}
        self.assertTrue(by_step[1]["verified"] and by_step[2]["verified"])
        self.assertFalse(by_step[9]["verified"])  # a leftover does not fail the listing
        self.corrupt(2)
        r = pacer("ckpt", "ls", self.root, "--verify")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        line2 = [line for line in r.stdout.splitlines() if line.split()[:1] == ["2"]][0]
        self.assertIn("CORRUPT", line2)
        line1 = [line for line in r.stdout.splitlines() if line.split()[:1] == ["1"]][0]
        self.assertIn("valid", line1)
        r = pacer("ckpt", "ls", self.root, "--verify", "--json")
        self.assertEqual(r.returncode, 1)
        by_step = {c["step"]: c for c in json.loads(r.stdout)["checkpoints"]}
        self.assertFalse(by_step[2]["verified"])
        self.assertIn("blob 'weight'", by_step[2]["problem"])
        self.assertTrue(by_step[1]["verified"])

    def test_verify(self):
        self.make([1, 2, 3])
        r = pacer("ckpt", "verify", self.root)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"OK: 3 checkpoint(s) checked in {self.root}", r.stdout)
        self.assertNotIn(PARTIAL, r.stdout)  # leftovers are not checkpoints

        self.corrupt(2, offset=5000)  # inside the weight blob (12,000 bytes at offset 0), second chunk
        r = pacer("ckpt", "verify", self.root)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("FAILED: 3 checkpoint(s) checked", r.stdout)
        self.assertIn("CORRUPT", r.stdout)
        self.assertIn("blob 'weight'", r.stdout + r.stderr)

        r = pacer("ckpt", "verify", self.root, "--json")
        self.assertEqual(r.returncode, 1)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.ckpt.verify/1")
        self.assertEqual(j["verdict"], "fail")
        by_step = {c["step"]: c for c in j["checkpoints"]}
        self.assertEqual(sorted(by_step), [1, 2, 3])
        self.assertFalse(by_step[2]["verified"])
        problem = by_step[2]["problem"]
        self.assertIn(os.path.join(step_dir(self.root, 2), DATA_FILE), problem)
        self.assertIn("blob 'weight'", problem)
        self.assertIn("checksum mismatch in bytes 4096..8192", problem)  # the chunk holding byte 5000
        self.assertTrue(by_step[1]["verified"] and by_step[3]["verified"])

        r = pacer("ckpt", "verify", self.root, "--step", "3", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["verdict"], "pass")
        self.assertEqual([c["step"] for c in j["checkpoints"]], [3])
        r = pacer("ckpt", "verify", self.root, "--step", "2")
        self.assertEqual(r.returncode, 1)
        self.assertIn("blob 'weight'", r.stdout)

        r = pacer("ckpt", "verify", self.root, "--step", "42")
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("no checkpoint for step 42", r.stderr)

    def test_verify_names_the_blob_under_a_long_path(self):
        # Under a deep root the text output still names the blob.
        self.root = os.path.join(self.tmp.name, "project", "team-with-a-long-name", "experiment-2026-11-29",
                                 "run-0042", "checkpoints")
        self.make([1], partial=False)
        self.corrupt(1)
        r = pacer("ckpt", "verify", self.root)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("blob 'weight'", r.stdout + r.stderr)

    def damage(self):
        """Steps 1..3, then step 1 loses its data file and step 2's is truncated."""
        self.make([1, 2, 3], partial=False)
        os.remove(os.path.join(step_dir(self.root, 1), DATA_FILE))
        with open(os.path.join(step_dir(self.root, 2), DATA_FILE), "r+b") as f:
            f.truncate(100)

    def test_verify_step_with_missing_and_truncated_files(self):
        self.damage()
        r = pacer("ckpt", "verify", self.root, "--step", "1", "--json")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        problem = json.loads(r.stdout)["checkpoints"][0]["problem"]
        self.assertIn(os.path.join(step_dir(self.root, 1), DATA_FILE), problem)
        self.assertIn("missing", problem)
        r = pacer("ckpt", "verify", self.root, "--step", "2", "--json")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        problem = json.loads(r.stdout)["checkpoints"][0]["problem"]
        self.assertIn("100 bytes", problem)
        self.assertIn("truncated", problem)
        self.assertEqual(pacer("ckpt", "verify", self.root, "--step", "3").returncode, 0)

    def test_verify_all_fails_on_missing_and_truncated_files(self):
        # A step directory with a missing or truncated data file is damage, not
        # a leftover: `verify` and `ls --verify` fail on it.
        self.damage()
        r = pacer("ckpt", "verify", self.root)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)

    def test_prune_keep_last(self):
        self.make([1, 2, 3, 4, 5])
        r = pacer("ckpt", "prune", self.root, "--keep-last", "2", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.ckpt.prune/1")
        self.assertEqual(sorted(j["removed"]), [1, 2, 3])
        self.assertEqual(self.committed(), [4, 5])
        self.assertTrue(os.path.isdir(os.path.join(self.root, PARTIAL)))  # not prune's business
        self.assertEqual(sorted(os.listdir(self.root)), sorted([PARTIAL, "step-000000000004", "step-000000000005"]))
        # Nothing more to do: idempotent.
        r = pacer("ckpt", "prune", self.root, "--keep-last", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: 0 checkpoint(s) removed", r.stdout)
        # The newest is never removed.
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("removed step 4", r.stdout)
        self.assertIn("OK: 1 checkpoint(s) removed", r.stdout)
        self.assertEqual(self.committed(), [5])

    def test_prune_keep_every(self):
        self.make(range(1, 9), partial=False)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "2", "--keep-every", "3", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(json.loads(r.stdout)["removed"]), [1, 2, 4, 5])
        self.assertEqual(self.committed(), [3, 6, 7, 8])
        # What is left still verifies.
        self.assertEqual(pacer("ckpt", "verify", self.root).returncode, 0)

    def test_prune_usage(self):
        self.make([1, 2], partial=False)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "0")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--keep-last", r.stderr)
        self.assertEqual(pacer("ckpt", "prune", self.root).returncode, 2)  # --keep-last is required
        self.assertEqual(self.committed(), [1, 2])

    def test_prune_keeps_the_newest_valid_step_when_the_newest_is_damaged(self):
        # The case: before, --keep-last 1 removed every valid step.
        self.make([1, 2, 3], partial=False)
        self.corrupt(3)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["newest_valid"], 2)
        self.assertEqual(j["removed"], [1])
        self.assertEqual(j["kept"], [2])
        self.assertEqual([(d["step"], d["removed"], d["moved_aside"]) for d in j["damaged"]], [(3, False, False)])
        self.assertIn("checksum mismatch", j["damaged"][0]["problem"])
        self.assertEqual(self.committed(), [2, 3])
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("damaged step 3 left in place", r.stdout)
        self.assertIn("--remove-damaged", r.stdout)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1", "--remove-damaged")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("removed damaged step 3", r.stdout)
        self.assertEqual(self.committed(), [2])
        self.assertEqual(pacer("ckpt", "verify", self.root).returncode, 0)

    def test_prune_removes_stale_partials_of_other_hosts(self):
        # A save that a dead node left behind: a newer step is committed and
        # nothing in it changed for two hours. A fresh one (a live saver on
        # another node) stays, as does the fixture's partial of step 9 (newer).
        self.make([1, 2, 3])
        stale = os.path.join(self.root, ".partial-step-000000000002-node-gone-4242-0000beef")
        fresh = os.path.join(self.root, ".partial-step-000000000002-node-busy-4242-0000beef")
        for d in (stale, fresh):
            os.makedirs(d)
            with open(os.path.join(d, DATA_FILE), "wb") as f:
                f.write(b"half a save")
        old = os.path.getmtime(stale) - 7200
        for p in (os.path.join(stale, DATA_FILE), stale):
            os.utime(p, (old, old))
        r = pacer("ckpt", "prune", self.root, "--keep-last", "3", "--dry-run", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual([(p["step"], p["path"]) for p in j["removed_partial"]], [(2, stale)])
        self.assertIn("nothing in it changed", j["removed_partial"][0]["problem"])
        self.assertTrue(os.path.isdir(stale))
        r = pacer("ckpt", "prune", self.root, "--keep-last", "3")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("removed stale partial save of step 2", r.stdout)
        self.assertFalse(os.path.exists(stale))
        self.assertTrue(os.path.isdir(fresh))
        self.assertTrue(os.path.isdir(os.path.join(self.root, PARTIAL)))
        self.assertEqual(self.committed(), [1, 2, 3])

    def test_prune_with_nothing_valid_exits_1_and_removes_nothing(self):
        self.make([1, 2], partial=False)
        self.corrupt(1)
        self.corrupt(2)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertEqual(self.committed(), [1, 2])

    def test_prune_dry_run_changes_nothing(self):
        self.make([1, 2, 3, 4])
        self.corrupt(4)
        def snapshot():
            return sorted((os.path.relpath(os.path.join(d, f), self.root), os.path.getsize(os.path.join(d, f)))
                          for d, _, fs in os.walk(self.root) for f in fs)
        before = snapshot()
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1", "--remove-damaged", "--dry-run")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("would remove step 2", r.stdout)
        self.assertIn("would remove step 1", r.stdout)
        self.assertIn("would remove damaged step 4", r.stdout)
        self.assertIn("nothing was changed", r.stdout)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1", "--dry-run", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertTrue(j["dry_run"])
        self.assertEqual(j["removed"], [2, 1])
        self.assertEqual(j["kept"], [3])
        self.assertEqual(snapshot(), before)

    def test_ls_shows_moved_aside_steps_as_damaged(self):
        self.make([1, 2], partial=False)
        aside = os.path.join(self.root, ".damaged-step-000000000002-20261201T081500Z-42")
        os.rename(step_dir(self.root, 2), aside)
        r = pacer("ckpt", "ls", self.root, "--verify")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)  # what is left verifies
        row = [line for line in r.stdout.splitlines() if aside in line][0]
        self.assertIn("damaged", row)
        j = json.loads(pacer("ckpt", "ls", self.root, "--json").stdout)
        by_path = {c["path"]: c for c in j["checkpoints"]}
        self.assertTrue(by_path[aside]["damaged"])
        self.assertFalse(by_path[aside]["committed"])
        self.assertEqual(by_path[aside]["step"], 2)
        self.assertEqual(pacer("ckpt", "verify", self.root).returncode, 0)  # not a checkpoint any more
        r = pacer("ckpt", "prune", self.root, "--keep-last", "3", "--remove-damaged", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual([(d["path"], d["removed"], d["moved_aside"]) for d in json.loads(r.stdout)["damaged"]], [(aside, True, True)])
        self.assertFalse(os.path.exists(aside))
        self.assertEqual(self.committed(), [1])

    def test_export_safetensors(self):
        self.make([1, 2], partial=False)
        out = os.path.join(self.tmp.name, "hf")
        r = pacer("ckpt", "export", self.root, "--safetensors", out, "--prefix", "", "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.ckpt.export/1")
        self.assertEqual(j["step"], 2)
        self.assertEqual(j["files"], [os.path.join(out, "model.safetensors")])
        self.assertEqual(j["tensors"], 2)  # weight and count; the bytes blob is not a tensor
        n, header, data = read_safetensors(os.path.join(out, "model.safetensors"))
        self.assertEqual((8 + n) % 8, 0)
        self.assertEqual(header["__metadata__"], {"format": "pt"})
        self.assertEqual(header["weight"]["dtype"], "F32")
        self.assertEqual(header["weight"]["shape"], [30, 100])
        self.assertEqual(header["count"], {"dtype": "I64", "shape": [], "data_offsets": header["count"]["data_offsets"]})
        self.assertNotIn("tokens", header)
        self.assertEqual(list(struct.unpack("<3000f", data["weight"])), [float(v) for v in range(20000, 23000)])
        self.assertEqual(struct.unpack("<q", data["count"]), (2,))

        # Sharded: the index maps each tensor to its file.
        r = pacer("ckpt", "export", self.root, "--step", "1", "--safetensors", out, "--prefix", "", "--max-shard-size", "5KB")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("exported step 1", r.stdout)
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.assertEqual(index["weight_map"], {"count": "model-00001-of-00002.safetensors",
                                               "weight": "model-00002-of-00002.safetensors"})
        self.assertEqual(index["metadata"]["total_size"], 12008)
        self.assertFalse(os.path.exists(os.path.join(out, "model.safetensors")))
        _, _, data = read_safetensors(os.path.join(out, "model-00002-of-00002.safetensors"))
        self.assertEqual(struct.unpack("<3000f", data["weight"])[:2], (10000.0, 10001.0))

        # No blob under the default prefix "model/": a usage error naming what there is.
        r = pacer("ckpt", "export", self.root, "--safetensors", out)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("'model/...'", r.stderr)
        self.assertIn("weight", r.stderr)
        self.assertEqual(pacer("ckpt", "export", self.root).returncode, 2)  # --safetensors is required
        r = pacer("ckpt", "export", self.root, "--safetensors", out, "--max-shard-size", "lots")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--max-shard-size", r.stderr)

    def test_export_loads_in_torch(self):
        torch_python = "/usr/bin/python3"
        if subprocess.run([torch_python, "-c", "import torch"], capture_output=True).returncode != 0:
            self.skipTest("no torch for /usr/bin/python3")
        self.make([3], partial=False)
        out = os.path.join(self.tmp.name, "hf")
        r = pacer("ckpt", "export", self.root, "--safetensors", out, "--prefix", "")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = subprocess.run([torch_python, "-c", TORCH_LOADER, os.path.join(out, "model.safetensors")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = json.loads(r.stdout)
        self.assertEqual(got["weight"][:2], ["torch.float32", [30, 100]])
        self.assertEqual(got["weight"][2], float(sum(range(30000, 33000))))
        self.assertEqual(got["count"], ["torch.int64", [], 3.0])

    def test_inspect(self):
        self.make([1, 2])
        r = pacer("ckpt", "inspect", self.root, "--step", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"step 1 in {step_dir(self.root, 1)} (1 rank(s), created ", r.stdout)
        for col in ["BLOB", "DTYPE", "SHAPE", "SIZE", "LAYOUT"]:
            self.assertIn(col, r.stdout)
        rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
        self.assertIn("float32", rows["weight"])
        self.assertIn("[30, 100]", rows["weight"])
        self.assertIn("replicated", rows["weight"])
        self.assertIn("int64", rows["count"])
        self.assertIn("[]", rows["count"])
        self.assertIn("bytes", rows["tokens"])
        self.assertIn("[3]", rows["tokens"])
        meta_line = next(l for l in r.stdout.splitlines() if l.startswith("meta: "))
        meta = json.loads(meta_line[len("meta: "):])
        self.assertEqual(meta.pop("pacer")["schema"], "pacer.state/1")  # the Python state's structure
        self.assertEqual(meta, {"lr": 0.5, "step": 1})

        r = pacer("ckpt", "inspect", self.root, "--step", "2", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["step"], 2)
        self.assertEqual(j["dir"], step_dir(self.root, 2))
        self.assertEqual(j["world_size"], 1)
        self.assertEqual(j["chunk_bytes"], 4096)
        self.assertEqual({k: v for k, v in j["meta"].items() if k != "pacer"}, {"step": 2, "lr": 0.5})
        blobs = {b["name"]: b for b in j["blobs"]}
        self.assertEqual((blobs["weight"]["dtype"], blobs["weight"]["shape"], blobs["weight"]["size"]),
                         ("float32", [30, 100], 12000))
        self.assertEqual(len(blobs["weight"]["chunks"]), 3)  # 12,000 bytes in 4 KiB chunks
        self.assertEqual((blobs["count"]["dtype"], blobs["count"]["shape"], blobs["count"]["size"]), ("int64", [], 8))
        self.assertEqual((blobs["tokens"]["dtype"], blobs["tokens"]["shape"], blobs["tokens"]["size"]), ("bytes", [6], 6))
        self.assertEqual([f["name"] for f in j["files"]], [DATA_FILE])

        # Without --step: the newest committed one (the partial step 9 is not).
        r = pacer("ckpt", "inspect", self.root, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["step"], 2)

        r = pacer("ckpt", "inspect", self.root, "--step", "42")
        self.assertEqual(r.returncode, 2)
        self.assertIn("step-000000000042", r.stderr)

    def test_inspect_empty_dir(self):
        os.makedirs(self.root)
        r = pacer("ckpt", "inspect", self.root)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a committed checkpoint", r.stderr)

    def test_interval(self):
        r = pacer("ckpt", "interval", "--save-cost", "40s", "--mtbf", "8h", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.ckpt.interval/1")
        self.assertEqual(j["save_cost_s"], 40)
        self.assertEqual(j["mtbf_s"], 8 * 3600)
        # Daly: sqrt(2dM) (1 + sqrt(d/2M)/3 + d/(18M)) - d; Young: sqrt(2dM).
        d, m = 40.0, 28800.0
        x = d / (2 * m)
        self.assertAlmostEqual(j["interval_s"], (2 * d * m) ** 0.5 * (1 + x ** 0.5 / 3 + x / 9) - d, places=6)
        self.assertAlmostEqual(j["young_interval_s"], (2 * d * m) ** 0.5, places=6)
        self.assertAlmostEqual(j["interval_s"], 1491.34, places=2)

        r = pacer("ckpt", "interval", "--save-cost", "40s", "--mtbf", "8h")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Daly", r.stdout)
        self.assertIn("Young", r.stdout)

        for args, needle in [
            (["--save-cost", "soon", "--mtbf", "8h"], "soon"),
            (["--save-cost", "40s", "--mtbf", "0s"], "--mtbf"),
            (["--save-cost", "-5s", "--mtbf", "8h"], "-5s"),
        ]:
            r = pacer("ckpt", "interval", *args)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stdout}{r.stderr}")
            self.assertIn(needle, r.stderr, args)
        self.assertEqual(pacer("ckpt", "interval", "--save-cost", "40s").returncode, 2)  # --mtbf is required

    def test_interval_agrees_with_plan_ckpt(self):
        # One question, two doors: the same flags, figures, names and text.
        for args in (["--save-cost", "40s", "--mtbf", "8h"],
                     ["--save-cost", "90s", "--restart-cost", "15m", "--node-mtbf", "1000d", "--nodes", "512",
                      "--campaign", "30d", "--interval", "3h"]):
            c, p = pacer("ckpt", "interval", *args), pacer("plan", "ckpt", *args)
            self.assertEqual((c.returncode, p.returncode), (0, 0), c.stderr + p.stderr)
            self.assertEqual(c.stdout, p.stdout)
            cj = json.loads(pacer("ckpt", "interval", *args, "--json").stdout)
            pj = json.loads(pacer("plan", "ckpt", *args, "--json").stdout)
            self.assertEqual(cj.pop("schema"), "pacer.ckpt.interval/1")
            self.assertEqual(pj.pop("schema"), "pacer.plan.ckpt/1")
            self.assertEqual(cj["interval_s"], cj["daly_interval_s"])  # no --write-time: Daly's
            self.assertEqual(cj, pj)

    def test_usage_errors_exit_2(self):
        missing = os.path.join(self.tmp.name, "missing")
        a_file = os.path.join(self.tmp.name, "file")
        with open(a_file, "w") as f:
            f.write("x")
        for sub in [["ls"], ["ls", "--verify"], ["verify"], ["prune", "--keep-last", "2"], ["inspect"]]:
            for d in (missing, a_file):
                r = pacer("ckpt", sub[0], d, *sub[1:])
                self.assertEqual(r.returncode, 2, f"{sub} {d}: {r.stdout}{r.stderr}")
                self.assertIn(f"{d}: not a directory", r.stderr)
            r = pacer("ckpt", *sub)  # no directory at all
            self.assertEqual(r.returncode, 2, f"{sub}: {r.stdout}{r.stderr}")
        self.assertFalse(os.path.exists(missing))  # nothing was created
        self.assertEqual(pacer("ckpt").returncode, 2)  # a subcommand is required
        self.assertEqual(pacer("ckpt", "frobnicate", self.tmp.name).returncode, 2)
        self.assertEqual(pacer("ckpt", "ls", self.tmp.name, "--no-such-flag").returncode, 2)
        self.assertEqual(pacer("ckpt", "verify", self.tmp.name, "--step", "minus-one").returncode, 2)

    def test_empty_dir(self):
        os.makedirs(self.root)
        r = pacer("ckpt", "ls", self.root, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["checkpoints"], [])
        r = pacer("ckpt", "verify", self.root)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: 0 checkpoint(s) checked", r.stdout)
        r = pacer("ckpt", "prune", self.root, "--keep-last", "1", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["removed"], [])


if __name__ == "__main__":
    unittest.main()
