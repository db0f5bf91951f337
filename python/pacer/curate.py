"""pacer.curate: score a data-set version with Python callables, in worker processes.

fastText classifiers run inside `pacer curate classify`; a model fastText cannot
express (a torch model, a regular expression, a language detector) is a
callable here::

    import pacer.curate
    version = pacer.curate.classify("v0123456789abcdef", "length", len, processes=2)

Each sample's text goes to `fn(text)` in a pool of `processes` worker
processes (default: every CPU); its return value (a number, string, bool or
None) becomes the sample's value in the score column `name`, written beside
the data by `pacer curate import-scores`, which records the new version with
its parent, the callable's name and a checksum of the values. The binary is
$PACER_BIN, else `pacer` on PATH; the store is `store`, else $PACER_DATA_STORE,
else ./pacer-data (docs/curate.md).
"""
import json
import multiprocessing
import os
import shutil
import subprocess
import tempfile

__all__ = ["Error", "classify", "samples"]


class Error(RuntimeError):
    """A pacer curate command failed; the message is its own."""


def _binary():
    return os.environ.get("PACER_BIN") or shutil.which("pacer") or "pacer"


def _run(args, store):
    cmd = [_binary(), "curate", *args]
    if store:
        cmd += ["--store", os.fspath(store)]
    return subprocess.run(cmd, capture_output=True, text=True)


def samples(source, store=None):
    """The samples of a version (or of input files) as dicts {input, row, id, text}."""
    r = _run(["samples", _version(source, store)], store)
    if r.returncode != 0:
        raise Error(r.stderr.strip() or f"pacer curate samples exited with {r.returncode}")
    return [json.loads(line) for line in r.stdout.splitlines() if line]


def _describe(fn):
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}.{name}"


def _check(value, name):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # numpy and torch scalars
    item = getattr(value, "item", None)
    if callable(item):
        return _check(item(), name)
    raise Error(f"{name}: the callable returned a {type(value).__name__}; a score is a number, string, bool or None")


def _version(source, store):
    """A version id: `source` itself, or the raw version of input files (registered when new)."""
    if isinstance(source, str) and len(source) == 17 and source.startswith("v"):
        return source
    paths = [os.fspath(source)] if isinstance(source, (str, os.PathLike)) else [os.fspath(p) for p in source]
    cmd = [_binary(), "data", "add", *paths, "--json"] + (["--store", os.fspath(store)] if store else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Error(r.stderr.strip() or f"pacer data add exited with {r.returncode}")
    return json.loads(r.stdout)["version"]


def classify(source, name, fn, processes=None, store=None, chunksize=64):
    """Scores every sample of `source` with fn(text) in worker processes; returns the new version id."""
    version = _version(source, store)
    rows = samples(version, store)
    texts = [s["text"] for s in rows]
    workers = processes or len(os.sched_getaffinity(0))
    if workers <= 1 or len(texts) < 2:
        values = [fn(t) for t in texts]
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            values = pool.map(fn, texts, chunksize=max(1, chunksize))
    fd, tmp = tempfile.mkstemp(suffix=".jsonl", prefix="pacer-scores-")
    try:
        with os.fdopen(fd, "w") as f:
            for s, v in zip(rows, values):
                f.write(json.dumps({"input": s["input"], "row": s["row"], "value": _check(v, name)}) + "\n")
        r = _run(["import-scores", version, name, tmp, "--callable", _describe(fn), "--json"], store)
        if r.returncode != 0:
            raise Error(r.stderr.strip() or f"pacer curate import-scores exited with {r.returncode}")
        return json.loads(r.stdout)["version"]
    finally:
        os.unlink(tmp)
