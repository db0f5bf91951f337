"""Real text Debian ships, in a fixed order, for the tokenizer benchmarks (never generated words).

Every package's copyright file (/usr/share/doc/*/copyright), then /usr/share/common-licenses/*,
then every package's changelogs (/usr/share/doc/*/changelog*.gz, decompressed), each list in
name order: ~28 MB of copyright and license text on the 2-core VM, ~200 MB with the changelogs.

    python3 bench/debian_text.py DIR MB    # writes the files that make the first MB MiB into DIR,
                                           # named NNNNN-path, so that name order is this order
                                           # (the GPU machine's trimmed /usr/share/doc lacks them)
"""
import glob
import gzip
import os
import sys


def sources():
    """(path, reader) in benchmark order."""
    for p in sorted(glob.glob("/usr/share/doc/*/copyright")) + sorted(glob.glob("/usr/share/common-licenses/*")):
        yield p, lambda p=p: open(p, "rb").read()
    for p in sorted(glob.glob("/usr/share/doc/*/changelog*.gz")):
        yield p, lambda p=p: gzip.open(p, "rb").read()


def files(limit, text_dir=""):
    """(name, bytes) of whole files, in order, until they hold `limit` bytes: from `text_dir`'s files
    in name order when given, else from Debian's."""
    got = 0
    it = ((p, lambda p=p: open(p, "rb").read()) for p in sorted(glob.glob(text_dir + "/*"))) if text_dir else sources()
    for p, read in it:
        try:
            data = read()
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        yield p, data
        got += len(data)
        if got >= limit:
            return


def text(limit, text_dir=""):
    """The first `limit` bytes of those files, concatenated, cut back to a line end."""
    out = bytearray()
    for _, data in files(limit, text_dir):
        out += data
    out = out[:limit]
    return bytes(out[: out.rfind(b"\n") + 1])


if __name__ == "__main__":
    out_dir, mb = sys.argv[1], float(sys.argv[2])
    os.makedirs(out_dir, exist_ok=True)
    total = 0
    for i, (p, data) in enumerate(files(int(mb * (1 << 20)))):
        with open(os.path.join(out_dir, f"{i:05d}-" + p.strip("/").removesuffix(".gz").replace("/", "_")), "wb") as f:
            f.write(data)
        total += len(data)
    print(f"{i + 1} files, {total} bytes in {out_dir}")
