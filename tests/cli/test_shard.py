"""Integration tests for `pacer shard`: the real binary, the shards it writes, its exit codes and output.

Shards are read back with Python's tarfile and GNU tar, so the python running
these tests needs nothing beyond the standard library.
"""
import filecmp
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import unittest

from cli_util import PACER, flip_byte, pacer

TARGET = 64000  # --target-size 64KB (SI)
LONG_PAX = "nested/" + "x" * 120                 # 127-byte key: needs a pax path record
LONG_PREFIX = "d" * 60 + "/" + "e" * 60 + "/s"   # fits ustar's prefix + name fields




def sample_fields(i):
    fields = {"txt": f"sample {i}\n".encode(), "json": json.dumps({"i": i, "tag": "t" * (i % 13)}).encode()}
    if i % 10:  # every tenth sample has no .bin: samples need not share their fields
        fields["bin"] = bytes((i * 7 + j) % 256 for j in range((i * 53) % 1500))
    return fields


def make_tree(root, n=300):
    """n samples (plus two with long names) in nested directories; returns {key: {ext: bytes}}."""
    expected = {}
    subdirs = ["", "nested", "nested/deeper", "other"]
    for i in range(n):
        d = subdirs[i % 4]
        expected[(d + "/" if d else "") + f"s{i:05d}"] = sample_fields(i)
    expected[LONG_PAX] = {"txt": b"pax\n"}
    expected[LONG_PREFIX] = {"txt": b"prefix\n", "json": b"{}"}
    for key, fields in expected.items():
        for ext, data in fields.items():
            path = os.path.join(root, f"{key}.{ext}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    # Not samples: hidden files and directories.
    with open(os.path.join(root, ".DS_Store"), "w") as f:
        f.write("x")
    os.makedirs(os.path.join(root, ".git"))
    with open(os.path.join(root, ".git", "HEAD.txt"), "w") as f:
        f.write("x")
    return expected


def index_content(data):
    """An index's bytes less what it records of the shard's file (mtime, inode, change time, when its
    headers were hashed) and the header checksum covering them: a rewritten shard of the same bytes
    is another file, and so its index differs there only."""
    return data[:32] + data[40:56] + data[96:]


def same_output(a, b, name):
    return index_content(a) == index_content(b) if name.endswith(".pidx") else a == b


def member_order(expected):
    """Archive member names in the order pack writes them: by key, then extension."""
    return [f"{k}.{e}" for k in sorted(expected) for e in sorted(expected[k])]


def files_state(d):
    """{name: (bytes, mtime_ns)} of every file in d."""
    out = {}
    for name in os.listdir(d):
        p = os.path.join(d, name)
        with open(p, "rb") as f:
            out[name] = (f.read(), os.stat(p).st_mtime_ns)
    return out


class ShardCli(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-shard-cli-")
        self.src = os.path.join(self.tmp.name, "src")
        self.out = os.path.join(self.tmp.name, "out")
        os.makedirs(self.src)

    def tearDown(self):
        self.tmp.cleanup()

    def pack(self, *extra, src=None, out=None, target="64KB"):
        r = pacer("shard", "pack", src or self.src, out or self.out, "--target-size", target, "--json", *extra)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return json.loads(r.stdout)

    def manifest(self, out=None):
        with open(os.path.join(out or self.out, "manifest.json")) as f:
            return json.load(f)

    def packed(self):
        self.expected = make_tree(self.src)
        return self.pack()

    def test_help(self):
        r = pacer("shard", "--help")
        self.assertEqual(r.returncode, 0)
        for sub in ["pack", "index", "inspect", "verify", "Exit codes"]:
            self.assertIn(sub, r.stdout)
        r = pacer("shard", "pack", "--help")
        self.assertEqual(r.returncode, 0)
        for opt in ["--target-size", "--prefix", "--jobs", "--json"]:
            self.assertIn(opt, r.stdout)

    def test_pack_directory(self):
        j = self.packed()
        m = self.manifest()
        n = len(self.expected)
        self.assertEqual(j["schema"], "pacer.shard.pack/1")
        self.assertEqual(m["schema"], "pacer.shards/1")
        self.assertEqual(m["samples"], n)
        self.assertEqual(j["samples"], n)
        self.assertRegex(m["version"], r"^[0-9a-f]{16}$")
        self.assertEqual(j["version"], m["version"])
        shards = m["shards"]
        # About 1.6 KB of data and three 512-byte headers per sample: many shards.
        self.assertGreaterEqual(len(shards), 10)
        self.assertEqual([s["path"] for s in shards], [f"train-{i:06d}.tar" for i in range(len(shards))])
        self.assertEqual(j["written"], len(shards))
        self.assertEqual(j["up_to_date"], 0)
        self.assertEqual(sum(s["samples"] for s in shards), n)
        self.assertEqual(sorted(os.listdir(self.out)),
                         sorted(["manifest.json"] + [s["path"] for s in shards] + [s["path"] + ".pidx" for s in shards]))

        names = []
        prev_key = None
        for i, s in enumerate(shards):
            path = os.path.join(self.out, s["path"])
            size = os.path.getsize(path)
            self.assertEqual(s["bytes"], size)
            self.assertLessEqual(size, TARGET)
            self.assertEqual(size % 512, 0)
            self.assertRegex(s["xxh3"], r"^[0-9a-f]{16}$")
            with open(path, "rb") as f:
                f.seek(size - 1024)
                self.assertEqual(f.read(), b"\0" * 1024)  # the two end-of-archive blocks
            with tarfile.open(path) as t:
                members = t.getmembers()
                keys = []
                for mem in members:
                    self.assertTrue(mem.isfile())
                    key, ext = self.split(mem.name)
                    self.assertEqual(t.extractfile(mem).read(), self.expected[key][ext], mem.name)
                    if not keys or keys[-1] != key:
                        keys.append(key)
                self.assertEqual(len(keys), s["samples"])
                self.assertEqual(len(set(keys)), len(keys))  # a sample's files are consecutive
                self.assertNotEqual(keys[0], prev_key)       # and never split across shards
                prev_key = keys[-1]
                names += [mem.name for mem in members]
                # Greedy sizing: the next shard's first sample would not have fit in this one.
                if i + 1 < len(shards):
                    nxt = os.path.join(self.out, shards[i + 1]["path"])
                    with tarfile.open(nxt) as tn:
                        ms = tn.getmembers()
                        first_key = self.split(ms[0].name)[0]
                        rest = [mm for mm in ms if self.split(mm.name)[0] != first_key]
                        first_bytes = rest[0].offset if rest else os.path.getsize(nxt) - 1024
                    self.assertGreater(size + first_bytes, TARGET)
        self.assertEqual(names, member_order(self.expected))

        # GNU tar agrees on the member list, long names included, in order.
        listed = []
        for s in shards:
            r = subprocess.run(["tar", "-tf", os.path.join(self.out, s["path"])], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stderr, "")
            listed += r.stdout.splitlines()
        self.assertEqual(listed, member_order(self.expected))
        self.assertIn(LONG_PAX + ".txt", listed)
        self.assertIn(LONG_PREFIX + ".json", listed)

        # And extracts exactly the source files.
        x = os.path.join(self.tmp.name, "x")
        os.makedirs(x)
        for s in shards:
            subprocess.run(["tar", "-xf", os.path.join(self.out, s["path"]), "-C", x], check=True)
        for key, fields in self.expected.items():
            for ext in fields:
                self.assertTrue(filecmp.cmp(os.path.join(x, f"{key}.{ext}"), os.path.join(self.src, f"{key}.{ext}"), shallow=False))

    @staticmethod
    def split(name):
        slash = name.rfind("/")
        dot = name.index(".", slash + 1)
        return name[:dot], name[dot + 1:]

    def test_pack_human_output(self):
        make_tree(self.src, n=40)
        r = pacer("shard", "pack", self.src, self.out, "--target-size", "20KB")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")  # no progress line when stderr is not a terminal
        lines = r.stdout.splitlines()
        for col in ["SHARD", "SAMPLES", "SIZE", "XXH3", "STATUS"]:
            self.assertIn(col, lines[0])
        self.assertIn("train-000000.tar", lines[1])
        self.assertIn("written", lines[1])
        self.assertRegex(lines[-1], rf"^OK: \d+ shard\(s\), 42 samples, .* in {self.out} \(\d+ written, 0 up to date\)$")

    def test_inspect(self):
        self.packed()
        m = self.manifest()
        mpath = os.path.join(self.out, "manifest.json")
        r = pacer("shard", "inspect", mpath, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.shard.inspect/1")
        self.assertEqual(j["samples"], len(self.expected))
        self.assertEqual([s["samples"] for s in j["shards"]], [s["samples"] for s in m["shards"]])
        self.assertEqual([s["bytes"] for s in j["shards"]], [s["bytes"] for s in m["shards"]])
        self.assertEqual([s["path"] for s in j["shards"]], [os.path.join(self.out, s["path"]) for s in m["shards"]])
        counts = {}
        for fields in self.expected.values():
            for ext in fields:
                counts[ext] = counts.get(ext, 0) + 1
        self.assertEqual(j["fields"], counts)
        self.assertEqual(j["first_keys"], sorted(self.expected)[:5])
        self.assertEqual(j["shards"][0]["first_key"], sorted(self.expected)[0])
        self.assertEqual(j["shards"][-1]["last_key"], sorted(self.expected)[-1])

        r = pacer("shard", "inspect", os.path.join(self.out, "train-{000000..000001}.tar"))
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        for col in ["SHARD", "SAMPLES", "SIZE", "FIELDS", "FIRST KEY"]:
            self.assertIn(col, lines[0])
        self.assertIn("train-000000.tar", lines[1])
        self.assertIn("bin,json,txt", lines[1])
        n2 = m["shards"][0]["samples"] + m["shards"][1]["samples"]
        self.assertIn(f"2 shard(s), {n2} samples", r.stdout)
        self.assertIn("first keys: " + ", ".join(sorted(self.expected)[:5]), r.stdout)

        # inspect reads; it writes no index.
        os.remove(os.path.join(self.out, "train-000000.tar.pidx"))
        r = pacer("shard", "inspect", os.path.join(self.out, "train-000000.tar"), "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["samples"], m["shards"][0]["samples"])
        self.assertFalse(os.path.exists(os.path.join(self.out, "train-000000.tar.pidx")))

    def test_verify(self):
        self.packed()
        m = self.manifest()
        mpath = os.path.join(self.out, "manifest.json")
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"OK: {len(m['shards'])} shard(s), {len(self.expected)} samples verified", r.stdout)
        r = pacer("shard", "verify", os.path.join(self.out, "train-*.tar"), "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["schema"], "pacer.shard.verify/1")
        self.assertEqual(j["verdict"], "pass")
        self.assertEqual(len(j["shards"]), len(m["shards"]))

        # A flipped byte in sample data: only the manifest's checksum sees it.
        bad = os.path.join(self.out, m["shards"][2]["path"])
        with tarfile.open(bad) as t:
            data_offset = t.getmembers()[0].offset_data
        flip_byte(bad, data_offset)
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"FAILED: {bad}: xxh3", r.stdout)
        self.assertIn(bad, r.stderr)
        r = pacer("shard", "verify", mpath, "--json")
        self.assertEqual(r.returncode, 1)
        j = json.loads(r.stdout)
        self.assertEqual(j["verdict"], "fail")
        rows = {s["path"]: s for s in j["shards"]}
        self.assertFalse(rows[bad]["ok"])
        self.assertIn(m["shards"][2]["xxh3"], rows[bad]["problem"])
        self.assertEqual([p for p, s in rows.items() if not s["ok"]], [bad])
        self.assertEqual(pacer("shard", "verify", os.path.join(self.out, "train-*.tar")).returncode, 0)

        # A flipped byte in a header: the scan fails, with or without a manifest.
        flip_byte(bad, 0)
        r = pacer("shard", "verify", os.path.join(self.out, "train-*.tar"))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"FAILED: {bad}: ", r.stdout)
        self.assertIn("checksum", r.stdout)

    def test_manifests_of_the_wrong_shape_are_usage_errors_naming_the_file(self):
        # Valid JSON of another shape was "internal error", exit 3, naming nothing.
        self.packed()
        mpath = os.path.join(self.out, "manifest.json")
        good = self.manifest()
        shard = good["shards"][0]["path"]
        cases = {
            "[1, 2]": "not a pacer shard manifest",
            '"text"': "not a pacer shard manifest",
            json.dumps({"schema": "pacer.shards/1", "shards": [{"path": shard, "xxh3": 5}]}): "xxh3 is not a string",
            json.dumps({"schema": "pacer.shards/1", "shards": [{"path": shard}], "version": 5}): "version is not a string",
            json.dumps({"schema": "pacer.shards/1", "shards": [{"path": shard}], "samples": -4}): "samples is not a non-negative integer",
            json.dumps({"schema": "pacer.shards/1", "shards": [{"path": shard}, {"path": "./" + shard}]}): "is listed twice",
        }
        for text, why in cases.items():
            with open(mpath, "w") as f:
                f.write(text)
            r = pacer("shard", "verify", mpath)
            self.assertEqual(r.returncode, 2, (text, r.stdout, r.stderr))
            self.assertIn(mpath, r.stderr, text)
            self.assertIn(why, r.stderr, text)
        # A pack rerun over an output whose manifest has another shape packs again.
        with open(mpath, "w") as f:
            f.write("[1]")
        self.pack()
        self.assertEqual(self.manifest()["schema"], "pacer.shards/1")

    def test_verify_index_problems(self):
        self.packed()
        m = self.manifest()
        mpath = os.path.join(self.out, "manifest.json")
        s0, s1 = (os.path.join(self.out, s["path"]) for s in m["shards"][:2])
        # An index of another shard of the same size: the offsets or keys differ.
        shutil.copy(s1 + ".pidx", s0 + ".pidx")
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"FAILED: {s0}: ", r.stdout)
        self.assertIn("index", r.stdout)
        # A missing index is no problem (readers build one), only reported.
        os.remove(s1 + ".pidx")
        r = pacer("shard", "verify", mpath, "--json")
        self.assertEqual(r.returncode, 1)
        rows = {s["path"]: s for s in json.loads(r.stdout)["shards"]}
        self.assertEqual((rows[s1]["ok"], rows[s1]["problem"], rows[s1]["indexed"]), (True, "", False))
        self.assertFalse(rows[s0]["ok"])
        self.assertTrue(rows[s0]["indexed"])
        self.assertFalse(os.path.exists(s1 + ".pidx"), "verify writes nothing")
        # `index` rebuilds both.
        r = pacer("shard", "index", s0, s1, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual([s["samples"] for s in j["shards"]], [s["samples"] for s in m["shards"][:2]])
        self.assertEqual(j["shards"][0]["index"], s0 + ".pidx")
        r = pacer("shard", "index", s0)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: 1 shard(s) indexed", r.stdout)
        self.assertEqual(pacer("shard", "verify", mpath).returncode, 0)
        # A shard the manifest lists but that is gone.
        os.remove(s1)
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"FAILED: {s1}: missing", r.stdout)
        # A tampered manifest: its version no longer matches its checksums.
        self.pack()
        m["shards"][0]["xxh3"] = "0" * 16
        with open(mpath, "w") as f:
            json.dump(m, f)
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("manifest version", r.stdout)

    def test_verify_without_indexes_passes_and_writes_nothing(self):
        # As on a read-only dataset that was published without its indexes.
        self.packed()
        m = self.manifest()
        for sh in m["shards"]:
            os.remove(os.path.join(self.out, sh["path"] + ".pidx"))
        before = sorted(os.listdir(self.out))
        mpath = os.path.join(self.out, "manifest.json")
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("ok (no index)", r.stdout)
        self.assertNotIn("FAILED", r.stdout)
        r = pacer("shard", "verify", mpath, "--json")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["verdict"], "pass")
        self.assertEqual({s["indexed"] for s in j["shards"]}, {False})
        self.assertEqual(sorted(os.listdir(self.out)), before)

    def test_crafted_shards_and_specs_end_quickly_with_the_file_named(self):
        # A GNU base-256 size near 2^64 (which used to loop forever), and a duplicate field.
        def write_tar(path, members):
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    t.addfile(info, __import__("io").BytesIO(data))

        huge = os.path.join(self.tmp.name, "huge.tar")
        write_tar(huge, [("a.txt", b"A"), ("big.bin", b"")])
        with open(huge, "r+b") as f:  # big.bin's header is the third block: give it size 2^64 - 1
            f.seek(1024)
            h = bytearray(f.read(512))
            h[124:136] = b"\x80" + b"\0" * 3 + b"\xff" * 8
            h[148:156] = b" " * 8
            h[148:155] = f"{sum(h):06o}\0".encode()
            f.seek(1024)
            f.write(h)
        dup = os.path.join(self.tmp.name, "dup.tar")
        write_tar(dup, [("k.txt", b"1"), ("k.txt", b"2")])
        for shard, needle in [(huge, "runs past the end"), (dup, "sample 'k' has field 'txt' twice")]:
            for sub in ("inspect", "index"):
                r = pacer("shard", sub, shard, timeout=30)
                self.assertEqual(r.returncode, 2, f"{sub} {shard}: {r.stdout}{r.stderr}")
                self.assertIn(shard, r.stderr)
                self.assertIn(needle, r.stderr)
            r = pacer("shard", "verify", shard, timeout=30)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn(f"FAILED: {shard}: ", r.stdout)
            self.assertFalse(os.path.exists(shard + ".pidx"))
        spec = os.path.join(self.tmp.name, "x-{0..18446744073709551615}.tar")
        for sub in ("inspect", "verify"):
            r = pacer("shard", sub, spec, timeout=30)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn("does not fit 64 bits", r.stderr)

    def test_rerun_is_a_noop(self):
        self.packed()
        before = files_state(self.out)
        time.sleep(0.05)
        j = self.pack()
        self.assertEqual(j["written"], 0)
        self.assertEqual(j["up_to_date"], len(self.manifest()["shards"]))
        self.assertFalse(j["manifest_changed"])
        self.assertTrue(all(s["status"] == "up to date" for s in j["shards"]))
        self.assertEqual(files_state(self.out), before)  # same bytes, same mtimes
        r = pacer("shard", "pack", self.src, self.out, "--target-size", "64KB")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("(0 written,", r.stdout)

    def test_interrupted_pack_is_completed(self):
        self.packed()
        before = files_state(self.out)
        m = self.manifest()
        n = len(m["shards"])
        # As if killed: one shard never renamed into place, one half written, the manifest gone.
        gone = m["shards"][3]["path"]
        os.remove(os.path.join(self.out, gone))
        os.remove(os.path.join(self.out, gone + ".pidx"))
        with open(os.path.join(self.out, "." + gone + ".partial"), "wb") as f:
            f.write(b"half a shard")
        half = m["shards"][5]["path"]
        with open(os.path.join(self.out, half), "r+b") as f:
            f.truncate(4096)
        os.remove(os.path.join(self.out, "manifest.json"))
        j = self.pack()
        self.assertEqual(j["written"], 2)
        self.assertEqual(j["up_to_date"], n - 2)
        self.assertEqual(sorted(s["path"] for s in j["shards"] if s["status"] == "written"), sorted([gone, half]))
        after = files_state(self.out)
        self.assertEqual(sorted(after), sorted(before))  # the temporary is gone too
        for name, (data, mtime) in before.items():
            self.assertTrue(same_output(after[name][0], data, name), name)  # identical bytes, manifest included
            if name not in (gone, gone + ".pidx", half, half + ".pidx", "manifest.json"):
                self.assertEqual(after[name][1], mtime, name)  # untouched
        self.assertEqual(pacer("shard", "verify", os.path.join(self.out, "manifest.json")).returncode, 0)

    def test_changed_sources(self):
        self.packed()
        old = self.manifest()
        # A changed file changes its shard; fewer, bigger shards replace the rest.
        key = sorted(self.expected)[-1]
        with open(os.path.join(self.src, key + ".txt"), "wb") as f:
            f.write(b"changed\n")
        j = self.pack(target="200KB")
        m = self.manifest()
        self.assertLess(len(m["shards"]), len(old["shards"]))
        self.assertNotEqual(m["version"], old["version"])
        self.assertEqual(sorted(j["removed"]), sorted(
            [s["path"] for s in old["shards"][len(m["shards"]):]] + [s["path"] + ".pidx" for s in old["shards"][len(m["shards"]):]]))
        self.assertEqual(sorted(n for n in os.listdir(self.out) if n.endswith(".tar")), [s["path"] for s in m["shards"]])
        with tarfile.open(os.path.join(self.out, m["shards"][-1]["path"])) as t:
            self.assertEqual(t.extractfile(key + ".txt").read(), b"changed\n")
        self.assertEqual(pacer("shard", "verify", os.path.join(self.out, "manifest.json")).returncode, 0)
        # Touching a source (same bytes, new mtime) rewrites the shard that holds it, only that one.
        p = os.path.join(self.src, sorted(self.expected)[0] + ".txt")
        st = os.stat(p)
        os.utime(p, (st.st_atime, st.st_mtime + 10))
        j = self.pack(target="200KB")
        self.assertEqual([s["path"] for s in j["shards"] if s["status"] == "written"], [m["shards"][0]["path"]])

    def test_jobs_give_identical_shards(self):
        make_tree(self.src)
        out1, out2 = os.path.join(self.tmp.name, "j1"), os.path.join(self.tmp.name, "j2")
        self.pack("--jobs", "1", out=out1)
        j = self.pack("--jobs", "2", out=out2)
        self.assertEqual(j["written"], len(self.manifest(out2)["shards"]))
        names = sorted(os.listdir(out1))
        self.assertEqual(names, sorted(os.listdir(out2)))
        self.assertGreater(len(names), 20)
        for name in names:
            with open(os.path.join(out1, name), "rb") as f1, open(os.path.join(out2, name), "rb") as f2:
                self.assertTrue(same_output(f1.read(), f2.read(), name), name)
        # Parallel reruns are no-ops too.
        self.assertEqual(self.pack("--jobs", "4", out=out2)["written"], 0)

    def test_prefix(self):
        make_tree(self.src, n=20)
        self.pack("--prefix", "val")
        m = self.manifest()
        self.assertTrue(all(s["path"].startswith("val-") for s in m["shards"]))
        self.assertEqual(m["prefix"], "val")

    def test_big_sample_gets_a_shard_of_its_own(self):
        for key, size in [("a", 100), ("b", 5000), ("c", 100), ("d", 100)]:
            with open(os.path.join(self.src, key + ".bin"), "wb") as f:
                f.write(b"x" * size)
        self.pack(target="4KB")
        m = self.manifest()
        self.assertEqual([s["samples"] for s in m["shards"]], [1, 1, 2])  # "b" is never split
        self.assertGreater(m["shards"][1]["bytes"], 4000)
        with tarfile.open(os.path.join(self.out, m["shards"][1]["path"])) as t:
            self.assertEqual(t.getnames(), ["b.bin"])

    def test_output_inside_the_source(self):
        make_tree(self.src, n=30)
        out = os.path.join(self.src, "shards")
        j = self.pack(out=out)
        self.assertEqual(j["samples"], 32)
        before = files_state(out)
        j = self.pack(out=out)  # the shards are not samples of the next run
        self.assertEqual((j["samples"], j["written"]), (32, 0))
        self.assertEqual(files_state(out), before)

    def test_progress_on_a_terminal(self):
        import pty

        make_tree(self.src, n=30)
        master, slave = pty.openpty()
        try:
            r = subprocess.run([PACER, "shard", "pack", self.src, self.out, "--target-size", "16KB"], stdout=subprocess.PIPE,
                               stderr=slave, text=True, timeout=60)
            os.close(slave)
            slave = None
            err = b""
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the other side is closed
                    break
                if not chunk:
                    break
                err += chunk
        finally:
            if slave is not None:
                os.close(slave)
            os.close(master)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertRegex(err.decode(), r"\r\[\d+/\d+ shards\] ")
        self.assertTrue(err.endswith(b"\r"), err[-80:])  # the line is cleared at the end
        self.assertNotIn("shards]", r.stdout)

    def test_pack_jsonl(self):
        src = os.path.join(self.tmp.name, "data.jsonl")
        lines = [json.dumps({"id": i, "text": "w" * (i * 37 % 300)}) for i in range(120)]
        with open(src, "w") as f:
            for i, line in enumerate(lines):
                f.write(line + "\n")
                if i == 10:
                    f.write("\n")  # blank lines are not samples, but count as lines
        j = self.pack(src=src, target="16KB")
        self.assertEqual(j["samples"], 120)
        m = self.manifest()
        self.assertGreater(len(m["shards"]), 2)
        got = []
        for s in m["shards"]:
            with tarfile.open(os.path.join(self.out, s["path"])) as t:
                got += [(mem.name, t.extractfile(mem).read().decode()) for mem in t.getmembers()]
        want_names = [f"{i + 1:09d}.json" for i in range(11)] + [f"{i + 2:09d}.json" for i in range(11, 120)]
        self.assertEqual([g[0] for g in got], want_names)
        self.assertEqual([g[1] for g in got], lines)
        self.assertEqual(pacer("shard", "verify", os.path.join(self.out, "manifest.json")).returncode, 0)
        self.assertEqual(self.pack(src=src, target="16KB")["written"], 0)

        # Plain text: field "txt".
        txt = os.path.join(self.tmp.name, "lines.txt")
        with open(txt, "w") as f:
            f.write("alpha\nbeta\r\ngamma")  # CRLF and a last line without a newline
        out = os.path.join(self.tmp.name, "txt-out")
        self.pack(src=txt, out=out)
        with tarfile.open(os.path.join(out, "train-000000.tar")) as t:
            self.assertEqual([(mem.name, t.extractfile(mem).read()) for mem in t.getmembers()],
                             [("000000001.txt", b"alpha"), ("000000002.txt", b"beta"), ("000000003.txt", b"gamma")])

        bad = os.path.join(self.tmp.name, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"ok": 1}\n{"broken": \n')
        r = pacer("shard", "pack", bad, os.path.join(self.tmp.name, "bad-out"))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn(f"{bad}:2:", r.stderr)

    def test_unsafe_member_names(self):
        # A foreign shard whose member would escape the extraction root.
        shard = os.path.join(self.tmp.name, "evil-000000.tar")
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
            for name in ["ok.txt", "../evil.txt"]:
                info = tarfile.TarInfo(name)
                info.size = 2
                t.addfile(info, fileobj=__import__("io").BytesIO(b"hi"))
        r = pacer("shard", "index", shard)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("../evil.txt", r.stderr)
        self.assertFalse(os.path.exists(shard + ".pidx"))
        r = pacer("shard", "verify", shard)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("escapes", r.stdout)
        # A manifest naming a shard outside its directory.
        mpath = os.path.join(self.tmp.name, "m", "manifest.json")
        os.makedirs(os.path.dirname(mpath))
        with open(mpath, "w") as f:
            json.dump({"schema": "pacer.shards/1", "shards": [{"path": "../evil-000000.tar"}], "samples": 2, "version": ""}, f)
        r = pacer("shard", "verify", mpath)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("..", r.stderr)

    def test_usage_errors_exit_2(self):
        make_tree(self.src, n=5)
        missing = os.path.join(self.tmp.name, "missing")
        a_file = os.path.join(self.tmp.name, "file")
        with open(a_file, "w") as f:
            f.write("x")
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty)
        cases = [
            (["pack", missing, self.out], missing),
            (["pack", self.src, a_file], "not a directory"),
            (["pack", empty, self.out], "no samples"),
            (["pack", self.src, self.out, "--target-size", "big"], "--target-size"),
            (["pack", self.src, self.out, "--target-size", "0"], "--target-size"),
            (["pack", self.src, self.out, "--jobs", "0"], "--jobs"),
            (["pack", self.src, self.out, "--prefix", "a/b"], "--prefix"),
            (["pack", self.src, self.out, "--prefix", "../up"], "--prefix"),
            (["index", missing], missing),
            (["inspect", missing], missing),
            (["inspect", os.path.join(self.tmp.name, "x-{1..}.tar")], "bad range"),
            (["inspect", os.path.join(self.tmp.name, "nothing-*.tar")], "matches no file"),
            (["verify", missing + ".json"], missing),
            (["verify", missing], missing),
            (["verify", os.path.join(self.tmp.name, "x-{000..002}.tar")], "no such shard"),
        ]
        for args, needle in cases:
            r = pacer("shard", *args)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stdout}{r.stderr}")
            self.assertIn(needle, r.stderr, args)
        self.assertFalse(os.path.exists(self.out))  # nothing was created
        not_manifest = os.path.join(self.tmp.name, "other.json")
        with open(not_manifest, "w") as f:
            f.write('{"schema": "something/1"}')
        r = pacer("shard", "verify", not_manifest)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("not a pacer shard manifest", r.stderr)
        self.assertEqual(pacer("shard").returncode, 2)  # a subcommand is required
        self.assertEqual(pacer("shard", "pack", self.src).returncode, 2)  # OUT is required
        self.assertEqual(pacer("shard", "frobnicate").returncode, 2)
        self.assertEqual(pacer("shard", "inspect", a_file, "--no-such-flag").returncode, 2)
        self.assertEqual(pacer("shard", "pack", self.src, self.out, "--jobs", "many").returncode, 2)


LICENSES = "/usr/share/common-licenses/"


class TokenizeCli(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pacer-tokenize-")
        cls.dir = cls.tmp.name
        with open(LICENSES + "Apache-2.0", "rb") as f:
            cls.apache = f.read()
        subprocess.run(["spm_train", f"--input={LICENSES}Apache-2.0", f"--model_prefix={cls.dir}/tok", "--vocab_size=300",
                        "--model_type=bpe", "--minloglevel=2"], check=True, capture_output=True)
        cls.model = os.path.join(cls.dir, "tok.model")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name, data=None):
        p = os.path.join(self.dir, name)
        if data is not None:
            with open(p, "wb") as f:
                f.write(data)
        return p

    def test_sentencepiece_model_several_inputs_and_the_manifest(self):
        text = self.path("apache.txt", self.apache)
        jsonl = self.path("docs.jsonl", b'{"body": "Licensed under the Apache License"}\n{"body": "Version 2.0"}\n')
        prefix = self.path("corpus")
        r = pacer("shard", "tokenize", text, jsonl, prefix, "--model", self.model, "--field", "body", "--threads", "2", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        lines = [l for l in self.apache.split(b"\n") if l]
        self.assertEqual(j["schema"], "pacer.shard.tokenize/2")
        self.assertEqual([i["documents"] for i in j["inputs"]], [len(lines), 2])
        self.assertEqual((j["dtype"], j["vocab_size"], j["eod"], j["threads"]), ("uint16", 300, 2, 2))
        self.assertEqual(j["tokenizer"]["path"], self.model)
        with open(prefix + ".manifest.json") as f:
            m = json.load(f)
        self.assertEqual(m["tokens"], j["tokens"])
        self.assertEqual(os.path.getsize(prefix + ".bin"), 2 * j["tokens"])
        self.assertEqual(m["bin"]["bytes"], 2 * j["tokens"])
        # The human form: a row per input and OK.
        r = pacer("shard", "tokenize", text, prefix + "2", "--model", self.model, "--no-eod")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("apache.txt", r.stdout)
        self.assertIn("no end-of-document token", r.stdout)
        self.assertTrue(r.stdout.strip().splitlines()[-1].startswith("OK:"), r.stdout)

    def test_the_test_vocabulary_and_bytes(self):
        vocab = self.path("vocab.txt", b"hello\nworld\n \n")
        text = self.path("docs.txt", b"hello world\n\nworld hello!\n")
        prefix = self.path("v")
        r = pacer("shard", "tokenize", text, prefix, "--vocab", vocab, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual((j["documents"], j["tokens"], j["dtype"], j["eod"]), (2, 7, "uint16", None))
        self.assertEqual(j["tokenizer"]["kind"], "vocabulary")
        with open(prefix + ".idx", "rb") as f:
            self.assertEqual(f.read(9), b"MMIDIDX\x00\x00")
        self.assertEqual(os.path.getsize(prefix + ".bin"), 7 * 2)
        r = pacer("shard", "tokenize", text, prefix + "b", "--eod", "255", "--json")  # bytes: ids 0..255
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["tokens"], len("hello world") + len("world hello!") + 2)

    def test_bad_input(self):
        text = self.path("ok.txt", b"Licensed\n")
        prefix = self.path("bad")
        with open(LICENSES + "BSD", "rb") as f:
            not_a_model = self.path("bsd.model", f.read())
        r = pacer("shard", "tokenize", text, prefix, "--model", not_a_model)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("bsd.model: not a SentencePiece model", r.stderr)
        # A model or vocabulary that cannot be read is a usage error (2), as one that does not parse.
        for flag in ("--model", "--vocab"):
            r = pacer("shard", "tokenize", text, prefix, flag, self.path("nothing") + ".bin")
            self.assertEqual(r.returncode, 2, (flag, r.stderr))
            self.assertIn("nothing.bin", r.stderr)
        r = pacer("shard", "tokenize", self.path("empty.txt", b"\n"), prefix, "--model", self.model)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("empty.txt: no documents", r.stderr)
        r = pacer("shard", "tokenize", self.path("missing.txt"), prefix, "--model", self.model)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("missing.txt", r.stderr)
        r = pacer("shard", "tokenize", self.path("nofield.jsonl", b'{"body": "x"}\n'), prefix, "--model", self.model)
        self.assertEqual(r.returncode, 2)
        self.assertIn("nofield.jsonl:1: not a JSON object with a string field 'text'", r.stderr)
        # A lone surrogate escape is invalid JSON, said as such (not "no string field").
        r = pacer("shard", "tokenize", self.path("surrogate.jsonl", b'{"text": "ok"}\n{"text": "a\\ud800b"}\n'), prefix, "--model", self.model)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("surrogate.jsonl:2: not valid JSON", r.stderr)
        self.assertIn("U+D800", r.stderr)
        bad = self.path("latin1.txt", b"Licensed\nto you\nLizenzgeb\xfchr\n")
        r = pacer("shard", "tokenize", bad, prefix, "--model", self.model, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        i = json.loads(r.stdout)["inputs"][0]
        self.assertEqual((i["documents"], i["bad_utf8"], i["first_bad_utf8_line"]), (3, 1, 3))
        r = pacer("shard", "tokenize", bad, prefix, "--model", self.model, "--bad-utf8", "fail")
        self.assertEqual(r.returncode, 2)
        self.assertIn("latin1.txt:3: not valid UTF-8", r.stderr)
        for args in ([text], [text, prefix, "--model", self.model, "--vocab", text], [text, prefix, "--eod", "1", "--no-eod"],
                     [text, prefix, "--bad-utf8", "ignore"], [text, prefix, "--model", self.model, "--eod", "300"],
                     [text, prefix, "--document", "paragraph"]):
            r = pacer("shard", "tokenize", *args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))


if __name__ == "__main__":
    unittest.main()
