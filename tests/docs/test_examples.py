"""Every ```python and ```sh block of README.md and docs/*.md runs, so that no example can go stale.

How a block runs (markers are HTML comments on the line right before a block, so readers do not see them):

- The blocks of one file run in order, in one temporary directory that holds the data they name,
  prepared by `fixture()` below (samples/, shards/ with 100 shards, data/tokens and
  data/corpus_text_document token datasets, layers.csv). Absolute paths under /scratch, /dev/shm,
  /data, /lustre and /local are mapped into that directory.
- Python blocks run in a fresh interpreter each ($PACER_PYTHON, with $PACER_PYTHONPATH), after PRELUDE:
  the names the docs take from the reader's own training loop (model, opt, loader, step, loss, ...).
  Without CUDA, device="cuda" runs as device="cpu".
- sh blocks run with `bash -e -o pipefail`, build/bin first on PATH and a `my-server` stub (the reader's
  own service). A block whose lines start with `$ ` is a transcript: its commands run one by one; with
  `<!-- example: output -->` each one's output (stdout and stderr) must match the lines shown, `...`
  standing for any number of lines.
- `<!-- example: skip (REASON) -->`: not run, and REASON is required. Every `pacer` command line in an
  sh block, run or skipped, is still checked against the CLI: each subcommand and option must be one
  that `pacer ... --help` lists.
- `<!-- example: twice (REASON) -->`: a Python block run two times in the same directory (the second
  run resumes from what the first saved).
"""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, os.pardir, os.pardir))
PACER = os.path.abspath(os.environ.get("PACER_BIN", os.path.join(ROOT, "build", "bin", "pacer")))
PYTHON = os.environ.get("PACER_PYTHON", "/usr/bin/python3")
PYTHONPATH = os.environ.get("PACER_PYTHONPATH", os.path.join(os.path.dirname(os.path.dirname(PACER)), "python"))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAPPED = ("scratch", "dev/shm", "data", "lustre", "local")
TIMEOUT = 120

# What a reader's training script has defined by the time an example runs.
PRELUDE = """
import numpy as np
import torch
import pacer, pacer.data, pacer.run
import pacer.telemetry as tm

rank, world = 0, 1
device = "cpu"
step, steps, epochs = 1000, 1000, 1
loss = torch.tensor(2.5)
i, n, t_data, t_comm, lr = 1, 4096, 0.01, 0.02, 3e-4
ckpt_meta = {}


class Model(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
loader = pacer.data.Loader(pacer.data.open("data/tokens"), batch_size=4, seq_len=64, pack=True)


def state():
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "loader": loader.state_dict(), "rng": pacer.rng_state()}


def train(batch):
    pass


def train_step(batch=None):
    pass


def batches(loader):
    while True:  # epoch after epoch
        yield from loader
"""


class Block:
    def __init__(self, path, line, lang, code, marker):
        self.path, self.line, self.lang, self.code, self.marker = path, line, lang, code, marker

    @property
    def name(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"

    def directive(self, word):
        """The text after `example: WORD` in the marker, or None."""
        m = re.match(rf"example:\s*{word}\b\s*(.*)$", self.marker or "")
        return m.group(1).strip() if m else None


def blocks(path):
    """The fenced python and sh blocks of a Markdown file, with the marker comment right before each."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) in ("python", "sh"):
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            c = re.match(r"^<!--\s*(.*?)\s*-->\s*$", lines[k]) if k >= 0 else None
            out.append(Block(path, start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n", c.group(1) if c else None))
        i = j + 1
    return out


def map_paths(code, root):
    return re.sub(r"(?<![\w./-])/(%s)(?=/|\b)" % "|".join(re.escape(p) for p in MAPPED),
                  lambda m: os.path.join(root, m.group(1)), code)


def run(cmd, cwd, env, timeout=TIMEOUT, **kw):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def fixture(d):
    """The data the examples name, in d."""
    env = dict(os.environ)
    os.makedirs(os.path.join(d, "samples"))
    for k in range(100):
        with open(os.path.join(d, "samples", f"{k:06d}.jpg"), "wb") as f:
            f.write(bytes([k % 256]) * 700)
        with open(os.path.join(d, "samples", f"{k:06d}.json"), "w") as f:
            f.write('{"label": %d}' % (k % 10))
    # One sample a shard: shards/train-000000.tar .. train-000099.tar, as the brace range in docs/data.md names.
    r = run([PACER, "shard", "pack", "samples", "shards", "--target-size", "1KB"], d, env)
    assert r.returncode == 0, r.stdout + r.stderr
    os.makedirs(os.path.join(d, "data"))
    with open(os.path.join(d, "corpus.txt"), "w") as f:
        for k in range(400):
            f.write(f"document {k}: " + "the quick brown fox jumps over the lazy dog " * (1 + k % 5) + "\n")
    for prefix in ("data/tokens", "data/corpus_text_document"):
        r = run([PACER, "shard", "tokenize", "corpus.txt", prefix], d, env)
        assert r.returncode == 0, r.stdout + r.stderr
    # A SentencePiece model and text to tokenize with it: license texts Debian ships (docs/data.md "Tokenizing").
    licenses = "/usr/share/common-licenses/"
    r = run(["spm_train", f"--input={licenses}Apache-2.0", "--model_prefix=tok", "--vocab_size=300", "--minloglevel=2"], d, env)
    assert r.returncode == 0, r.stdout + r.stderr
    os.makedirs(os.path.join(d, "books"))
    with open(os.path.join(d, "corpus.jsonl"), "w") as out:
        for name in ("BSD", "MPL-2.0"):
            with open(licenses + name) as f:
                text = f.read()
            shutil.copy(licenses + name, os.path.join(d, "books", name + ".txt"))
            out.write(json.dumps({"text": text}) + "\n")
    # The layers behind the pipeline example's output in README.md (and docs/plan.md).
    with open(os.path.join(d, "layers.csv"), "w") as f:
        f.write("layer,time_ms,memory_mb\nembed,6,300\n" + "".join(f"block{k},2.0,120\n" for k in range(30)) + "head,9,500\n")
    stubs = os.path.join(d, ".stubs")
    os.makedirs(stubs)
    with open(os.path.join(stubs, "my-server"), "w") as f:
        f.write('#!/bin/sh\necho "my-server: PACER_PORTS=$PACER_PORTS"\n')
    os.chmod(os.path.join(stubs, "my-server"), 0o755)
    # `python3` in sh blocks is the interpreter the Python blocks use (the one with torch and numpy),
    # not whichever comes first on the caller's PATH (a pyenv shim, a virtualenv).
    os.symlink(PYTHON, os.path.join(stubs, "python3"))


def block_env(d):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(PACER), os.path.join(d, ".stubs"), env.get("PATH", "")])
    env["PYTHONPATH"] = PYTHONPATH
    env.pop("PACER_TELEMETRY_DB", None)
    for k in [k for k in env if k.startswith("SLURM_") or k.startswith("PACER_CKPT_")]:
        del env[k]
    return env


# ---------------------------------------------------------------------------------------------------------
# Transcripts

def transcript(code):
    """[(command, [expected output lines])] of a block whose commands start with `$ `."""
    steps, cmd = [], None
    for line in code.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            steps.append([line[2:], []])
            cmd = steps[-1]
        elif cmd is not None and cmd[0].endswith("\\") and not cmd[1]:
            cmd[0] += "\n" + line
        elif cmd is not None:
            cmd[1].append(line)
    return [(c, out) for c, out in steps]


def matches(expected, actual):
    """Whether the lines match, `...` in expected standing for any number of lines."""
    expected = [e.rstrip() for e in expected]
    actual = [a.rstrip() for a in actual]

    def at(i, j):
        if i == len(expected):
            return j == len(actual)
        if expected[i] == "...":
            return any(at(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and expected[i] == actual[j] and at(i + 1, j + 1)

    return at(0, 0)


# ---------------------------------------------------------------------------------------------------------
# Checking pacer command lines against the CLI's own help

_help = {}


def cli_help(words):
    """(subcommands, options) that `pacer WORDS --help` lists."""
    key = tuple(words)
    if key not in _help:
        r = subprocess.run([PACER, *words, "--help"], capture_output=True, text=True, timeout=30)
        subs, opts, section = set(), set(), None
        for line in r.stdout.splitlines():
            if re.match(r"^\w[\w ]*:$", line):
                section = line[:-1].lower()
                continue
            m = re.match(r"^\s{2}(\S+)", line)
            if not m:
                continue
            if section == "subcommands":
                subs.add(m.group(1))
            elif section == "options":
                for name in m.group(1).split(","):
                    opts.add(name)
        _help[key] = (subs, opts)
    return _help[key]


def command_lines(code):
    """Each shell command line of a block (continuations joined, `$ ` prompts and transcript output left out)."""
    lines = code.split("\n")
    is_transcript = any(l.startswith("$ ") for l in lines)
    out, cur = [], None
    for line in lines:
        if cur is not None:
            cur += " " + line.rstrip("\\")
            if not line.endswith("\\"):
                out.append(cur)
                cur = None
            continue
        if is_transcript:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.endswith("\\"):
            cur = line[:-1]
        else:
            out.append(line)
    return out


def tokens(line):
    try:
        toks = shlex.split(line, comments=True)
    except ValueError:
        toks = line.split("#", 1)[0].split()
    out = []
    for k, t in enumerate(toks):
        if k and toks[k - 1] == "-c":
            # sh -c 'SCRIPT' NAME ARGS...: the script, with ARGS where it says "$@".
            return out[:-1] + tokens(t.replace('"$@"', shlex.join(toks[k + 2:])))
        out.append(t.lstrip("$(`").rstrip(")`;"))
    return out


def pacer_problems(code):
    """What in the block's pacer command lines the CLI does not know."""
    problems = []
    for line in command_lines(code):
        toks = tokens(line)
        for k, t in enumerate(toks):
            if t != "pacer" and not t.endswith("/pacer"):
                continue
            words, rest = [], toks[k + 1:]
            while rest:
                subs, _ = cli_help(words)
                if subs and rest[0] in subs:
                    words.append(rest.pop(0))
                elif subs and not words:
                    problems.append(f"`pacer {rest[0]}`: not a pacer subcommand ({line.strip()})")
                    rest = []
                else:
                    break
            _, opts = cli_help(words)
            for r in rest:
                if r == "--":
                    break
                r = r.strip("[]")
                if r.startswith("-") and len(r) > 1 and not re.match(r"^-\d", r):
                    name = r.split("=", 1)[0]
                    if name not in opts:
                        problems.append(f"`pacer {' '.join(words)}` has no option {name} ({line.strip()})")
    return problems


# ---------------------------------------------------------------------------------------------------------

class DocExamples(unittest.TestCase):
    """One test per Markdown file: its blocks run in order, each failure naming FILE:LINE."""

    @classmethod
    def setUpClass(cls):
        if not os.access(PACER, os.X_OK):
            raise unittest.SkipTest(f"no pacer binary at {PACER} (set PACER_BIN)")
        if not os.path.exists(os.path.join(PYTHONPATH, "pacer", "__init__.py")):
            raise unittest.SkipTest(f"no pacer Python module in {PYTHONPATH} (set PACER_PYTHONPATH)")
        cls.template = tempfile.TemporaryDirectory(prefix="pacer-doc-fixture-")
        fixture(cls.template.name)
        r = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True,
                           timeout=TIMEOUT)
        cls.cuda = r.stdout.strip() == "True"

    @classmethod
    def tearDownClass(cls):
        cls.template.cleanup()

    def run_file(self, path):
        found = blocks(path)
        with tempfile.TemporaryDirectory(prefix="pacer-doc-") as tmp:
            d = os.path.join(tmp, "work")
            shutil.copytree(self.template.name, d, symlinks=True)
            env = block_env(d)
            for b in found:
                with self.subTest(block=b.name):
                    self.run_block(b, d, env)

    def run_block(self, b, d, env):
        skip = b.directive("skip")
        if skip is not None:
            self.assertRegex(skip, r"^\(.+\)$", f"{b.name}: a skip marker says why: <!-- example: skip (REASON) -->")
        if b.lang == "sh":
            self.assertEqual(pacer_problems(b.code), [], f"{b.name}: stale pacer command line")
        else:
            compile(b.code, b.name, "exec")  # even a skipped block must be Python
        if skip is not None:
            return
        code = map_paths(b.code, d)
        if b.lang == "python":
            if not self.cuda:
                code = code.replace('device="cuda"', 'device="cpu"')
            for _ in range(2 if b.directive("twice") is not None else 1):
                script = PRELUDE + "\n# ---- " + b.name + "\n" + code
                r = run([PYTHON, "-c", script], d, env)
                self.assertEqual(r.returncode, 0, f"{b.name} failed:\n{code}\n{r.stdout}{r.stderr}")
        elif any(line.startswith("$ ") for line in code.split("\n")):
            compare = b.directive("output") is not None
            for cmd, expected in transcript(code):
                r = run(["bash", "-e", "-o", "pipefail", "-c", f"{{ {cmd}\n}} 2>&1"], d, env)
                self.assertEqual(r.returncode, 0, f"{b.name}: `{cmd}` failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
                if compare:
                    self.assertTrue(matches(expected, r.stdout.rstrip("\n").split("\n")),
                                    f"{b.name}: `{cmd}` printed\n{r.stdout}\ninstead of\n" + "\n".join(expected))
        else:
            r = run(["bash", "-e", "-o", "pipefail", "-c", code], d, env)
            self.assertEqual(r.returncode, 0, f"{b.name} failed (exit {r.returncode}):\n{code}\n{r.stdout}{r.stderr}")


for _path in DOCS:
    def _test(self, path=_path):
        self.run_file(path)
    setattr(DocExamples, "test_" + re.sub(r"\W", "_", os.path.relpath(_path, ROOT)), _test)


class RunLoop(unittest.TestCase):
    """The training loop of docs/run.md answers a pending checkpoint request with one save, not one per step."""

    def test_one_save_per_request(self):
        if not os.path.exists(os.path.join(PYTHONPATH, "pacer", "__init__.py")):
            self.skipTest(f"no pacer Python module in {PYTHONPATH}")
        loop = [b for b in blocks(os.path.join(ROOT, "docs", "run.md")) if "checkpoint_requested()" in b.code]
        self.assertEqual(len(loop), 1, "docs/run.md: the training loop with checkpoint_requested()")
        with tempfile.TemporaryDirectory(prefix="pacer-doc-run-") as d:
            fixture(d)
            request = os.path.join(d, "request")
            with open(request, "w") as f:
                f.write("{}")  # the request stays pending: pacer run removes it only when CMD is stopped
            env = dict(block_env(d), PACER_CKPT_REQUEST_FILE=request, PACER_CKPT_DIR=os.path.join(d, "ckpt"))
            count = textwrap.dedent("""
                saves = []
                _save = pacer.Checkpointer.save
                def _counted(self, step, *args, **kwargs):
                    saves.append(step)
                    return _save(self, step, *args, **kwargs)
                pacer.Checkpointer.save = _counted
                steps = 5
                """)
            script = PRELUDE + count + map_paths(loop[0].code, d) + "\nprint('saves', saves)\n"
            r = run([PYTHON, "-c", script], d, env)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("saves [1]\n", r.stdout, "a pending request is answered by one save")


class Checks(unittest.TestCase):
    """The extraction and the CLI check themselves: a test that cannot fail is a defect."""

    def test_a_stale_option_or_subcommand_is_found(self):
        if not os.access(PACER, os.X_OK):
            self.skipTest(f"no pacer binary at {PACER}")
        self.assertEqual(pacer_problems("pacer ckpt ls DIR --verify --json\n"), [])
        self.assertEqual(len(pacer_problems("pacer ckpt ls DIR --no-such-flag\n")), 1)
        self.assertEqual(len(pacer_problems("mpirun -np 4 pacer frobnicate --json\n")), 1)
        self.assertEqual(pacer_problems("$ pacer plan ckpt --save-cost 90s \\\n    --mtbf 8h\njob MTBF --not-a-flag\n"), [])
        self.assertEqual(len(pacer_problems("$ pacer plan ckpt --save-cost 90s \\\n    --mtbfs 8h\n")), 1)
        self.assertEqual(pacer_problems("pacer run --ckpt-dir d -- torchrun --nproc-per-node=8 train.py\n"), [])
        self.assertEqual(pacer_problems("pacer score DB [--run ID] [--json]\n"), [])
        wrapped = "mpirun -np 4 sh -c 'exec pacer vet --node-name \"n$R\" \"$@\"' sh --cluster %s --need 3\n"
        self.assertEqual(pacer_problems(wrapped % "--quick"), [])
        self.assertEqual(len(pacer_problems(wrapped % "--quik")), 1)

    def test_markers_and_transcripts_are_read(self):
        with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
            f.write("text\n\n<!-- example: skip (why) -->\n```sh\npacer vet\n```\n\n```python\nx = 1\n```\n```cpp\nint x;\n```\n")
        try:
            found = blocks(f.name)
        finally:
            os.unlink(f.name)
        self.assertEqual([(b.lang, b.line, b.directive("skip")) for b in found], [("sh", 4, "(why)"), ("python", 8, None)])
        self.assertEqual(transcript("$ a \\\n  b\nout1\n$ c\n"), [("a \\\n  b", ["out1"]), ("c", [])])
        self.assertTrue(matches(["x", "...", "z"], ["x", "y1", "y2", "z"]))
        self.assertFalse(matches(["x", "z"], ["x", "y", "z"]))
        self.assertEqual(map_paths('open("/scratch/a"); "/data/tokens"; "x/data/y"', "/t"),
                         'open("/t/scratch/a"); "/t/data/tokens"; "x/data/y"')


if __name__ == "__main__":
    unittest.main()
