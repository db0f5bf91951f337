#!/usr/bin/env python3
"""Builds the example's training data from text Debian ships: a SentencePiece model and a Megatron token dataset.

    python3 examples/gpt/prepare.py OUT [--vocab-size 4000] [--max-mb 8] [--input FILE ...]

OUT/corpus/      the text files used (copies, so the dataset can be rebuilt from what is recorded)
OUT/tok.model    a SentencePiece BPE model trained with spm_train on the corpus
OUT/data.bin/.idx/.manifest.json   the tokens (`pacer shard tokenize --document file`: one document per file)

Default corpus: /usr/share/common-licenses/* and /usr/share/doc/*/copyright, in name order, up to --max-mb.
Exit codes: 0 done, 2 bad input (a file that is not text, a missing tool), 3 a tool failed.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys

DEFAULT_GLOBS = ["/usr/share/common-licenses/*", "/usr/share/doc/*/copyright"]


def fail(code, message):
    print(f"prepare: {message}", file=sys.stderr)
    sys.exit(code)


def text_problem(data):
    """Why `data` is not text (None when it is): a NUL byte, or bytes that are not UTF-8."""
    if b"\0" in data:
        return "a NUL byte at offset %d (a binary file?)" % data.index(b"\0")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start}"
    return None


def find_tool(name, env):
    given = os.environ.get(env)
    path = shutil.which(given or name)
    if not path:
        hint = "Debian: apt-get install sentencepiece" if name.startswith("spm_") else f"set ${env} to build/bin/pacer"
        where = f"${env}={given}" if given else "PATH"
        fail(2, f"{name} not found ({where}; {hint})")
    return path


def collect(inputs, max_bytes):
    """(path, bytes) of the corpus. Explicit inputs must all be text; from the default globs, non-text is skipped."""
    explicit = bool(inputs)
    paths = inputs if explicit else sorted(p for g in DEFAULT_GLOBS for p in glob.glob(g))
    chosen, total, seen = [], 0, set()
    for p in paths:
        real = os.path.realpath(p)
        if real in seen or not os.path.isfile(real):
            if explicit and not os.path.isfile(real):
                fail(2, f"{p}: not a regular file")
            continue
        seen.add(real)
        try:
            with open(real, "rb") as f:
                data = f.read()
        except OSError as e:
            fail(2, f"{p}: {e.strerror}")
        problem = text_problem(data)
        if problem:
            if explicit:
                fail(2, f"{p}: not text: {problem}")
            continue
        if not data.strip():
            continue
        chosen.append((p, data))
        total += len(data)
        if total >= max_bytes:
            break
    if not chosen:
        fail(2, "no text in the corpus (" + (", ".join(inputs) if explicit else ", ".join(DEFAULT_GLOBS)) + ")")
    return chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--input", action="append", default=[], help="a text file of the corpus (repeatable; "
                    "default: Debian's license and copyright files)")
    ap.add_argument("--max-mb", type=float, default=8.0, help="corpus size bound in MiB (default 8)")
    ap.add_argument("--vocab-size", type=int, default=4000, help="SentencePiece pieces (default 4000)")
    ap.add_argument("--threads", type=int, default=None, help="tokenizer threads (default: every CPU)")
    ap.add_argument("--tokenizer", help="an existing SentencePiece model to tokenize with (default: train one)")
    a = ap.parse_args()
    if a.vocab_size < 100 or a.vocab_size > 65536:
        fail(2, f"--vocab-size {a.vocab_size}: between 100 and 65536")
    if a.tokenizer:
        if not os.path.isfile(a.tokenizer):
            fail(2, f"--tokenizer {a.tokenizer}: no such file (a SentencePiece .model; leave --tokenizer out "
                    "to train one on the corpus with spm_train)")
        with open(a.tokenizer, "rb") as f:
            head = f.read(4096)
        # A SentencePiece model is a protobuf whose first field (pieces, field 1, length-delimited) is tag 0x0a.
        if not head or head[0] != 0x0A:
            fail(2, f"--tokenizer {a.tokenizer}: not a SentencePiece model (it does not start as one)")
    spm_train = None if a.tokenizer else find_tool("spm_train", "SPM_TRAIN")
    pacer = find_tool("pacer", "PACER_BIN")

    files = collect(a.input, int(a.max_mb * (1 << 20)))
    corpus = os.path.join(a.out, "corpus")
    os.makedirs(corpus, exist_ok=True)
    for old in os.listdir(corpus):
        os.unlink(os.path.join(corpus, old))
    names = []
    for i, (p, data) in enumerate(files):
        # Numbered copies keep the order and make names unique (every package's file is called "copyright").
        name = os.path.join(corpus, f"{i:05d}-" + p.strip("/").replace("/", "_"))
        with open(name, "wb") as f:
            f.write(data)
        names.append(name)
    joined = os.path.join(a.out, "spm-input.txt")
    with open(joined, "wb") as f:
        for _, data in files:
            f.write(data if data.endswith(b"\n") else data + b"\n")

    prefix = os.path.join(a.out, "tok")
    if a.tokenizer:
        if os.path.realpath(a.tokenizer) != os.path.realpath(prefix + ".model"):
            shutil.copyfile(a.tokenizer, prefix + ".model")  # the dataset's manifest names the copy beside it
        os.unlink(joined)
    # Deterministic: one thread, no sampling of sentences, so the same corpus gives the same model.
    cmd = [spm_train, f"--input={joined}", f"--model_prefix={prefix}", f"--vocab_size={a.vocab_size}",
           "--model_type=bpe", "--byte_fallback=true", "--character_coverage=1.0", "--num_threads=1",
           "--input_sentence_size=0", "--shuffle_input_sentence=false", "--minloglevel=2"]
    if not a.tokenizer:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            fail(3, f"spm_train exited {r.returncode}:\n" + r.stdout.decode(errors="replace")[-2000:])
        os.unlink(joined)

    cmd = [pacer, "shard", "tokenize", *names, os.path.join(a.out, "data"), "--model", prefix + ".model",
           "--document", "file", "--bad-utf8", "fail"]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        # Its own exit codes carry over: 2 for bad input (a file it cannot read as text), 3 for a failure.
        fail(3 if r.returncode == 3 else 2,
             f"pacer shard tokenize exited {r.returncode}:\n" + r.stdout.decode(errors="replace"))
    size = sum(len(d) for _, d in files)
    pieces = "given" if a.tokenizer else f"{a.vocab_size} pieces"
    print(f"prepare: {len(files)} files, {size / (1 << 20):.1f} MiB -> {prefix}.model ({pieces}), "
          f"{os.path.join(a.out, 'data')} (.bin/.idx/.manifest.json)")


if __name__ == "__main__":
    main()
