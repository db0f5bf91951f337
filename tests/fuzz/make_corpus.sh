#!/usr/bin/env bash
# Regenerates the fixtures and seed corpora of tests/fuzz with pacer's own tools (the CLI and the
# Python module of a build), plus a few edge cases. Run it again when a format changes:
#   tests/fuzz/make_corpus.sh [BUILD]        (default: build)
# The outputs are committed; fuzzing never writes here.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
pacer="$build/bin/pacer"
py=/usr/bin/python3
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

fix="$here/fixtures"
corpus="$here/corpus"
rm -rf "$fix" "$corpus"
mkdir -p "$fix" "$corpus"/{tar,pidx,dirindex,idx,manifest,profile,baseline,steps,tokenize}

# --- Tar shards: one packed by `pacer shard pack` (the pidx fixture), and GNU/pax/ustar variants by tar(1).
mkdir -p "$tmp/src"
printf 'a cat' > "$tmp/src/000001.txt"; printf '{"label": 1}' > "$tmp/src/000001.json"
printf 'a dog' > "$tmp/src/000002.txt"; printf '{"label": 2}' > "$tmp/src/000002.json"
printf '\x00\x01\x02' > "$tmp/src/000003.bin"
"$pacer" shard pack "$tmp/src" "$tmp/packed" --prefix fix >/dev/null
cp "$tmp/packed/fix-000000.tar" "$fix/shard.tar"
cp "$fix/shard.tar" "$corpus/tar/packed.tar"
"$pacer" shard index "$fix/shard.tar" >/dev/null
mv "$fix/shard.tar.pidx" "$corpus/pidx/shard.pidx"
long="$(printf 'd%.0s' $(seq 1 60))/$(printf 'n%.0s' $(seq 1 120))"
mkdir -p "$tmp/t/$(dirname "$long")" "$tmp/t/sub"
printf 'long' > "$tmp/t/$long.txt"
printf 'x' > "$tmp/t/sub/k.a"; printf 'yy' > "$tmp/t/sub/k.b"; ln -s k.a "$tmp/t/sub/link.a"
for fmt in gnu pax ustar oldgnu; do
  # ustar cannot hold the long name: its variant is the rest.
  if [ $fmt = ustar ]; then what=(sub); else what=(sub "$long.txt"); fi
  (cd "$tmp/t" && tar --format=$fmt -b 1 --owner=0 --group=0 --mtime=@0 -cf "$corpus/tar/$fmt.tar" "${what[@]}")
done
head -c 1024 /dev/zero > "$corpus/tar/empty.tar"
gzip -n -9 -c "$corpus/tar/packed.tar" > "$corpus/tar/packed.tar.gz"  # gzip shards are read through zlib

# --- pidx edge cases, for the same shard: no samples; a sample without fields; a field that wraps
# past 2^64. Their reserved word is 1, so the target fixes their size and checksums up (pidx.cpp).
$py - "$corpus/pidx/shard.pidx" "$corpus/pidx" <<'PY'
import struct, sys
src, out = sys.argv[1], sys.argv[2]
b = open(src, "rb").read()
head = b[:12] + struct.pack("<I", 1) + b[16:24]
tail = b[32:96]
def write(name, samples, entries):
    open(f"{out}/{name}", "wb").write(head + struct.pack("<Q", samples) + tail + entries)
write("no-samples.pidx", 0, b"")
write("no-fields.pidx", 1, struct.pack("<H", 3) + b"key" + struct.pack("<H", 0))
write("offset-wraps.pidx", 1, struct.pack("<H", 3) + b"key" + struct.pack("<H", 1) + struct.pack("<H", 3) + b"txt"
      + struct.pack("<QQ", 2**64 - 16777216, 16775935))
PY

# --- A directory index holding the fixture's record, as a dataset open of 16 shards writes it
# (copies of the fixture), and one of only its header and table, whose reserved word is 1 so
# that the target seals it (dirindex.cpp).
mkdir -p "$tmp/dir"
for i in $(seq -w 1 15); do cp "$fix/shard.tar" "$tmp/dir/s$i.tar"; done
cp "$fix/shard.tar" "$tmp/dir/shard.tar"
PYTHONPATH="$build/python" $py -c 'import pacer.data, sys; pacer.data.open(sys.argv[1])' "$tmp/dir/*.tar"
cp "$tmp/dir/.pacer-index" "$corpus/dirindex/sixteen.pacer-index"
$py - "$corpus/dirindex/sixteen.pacer-index" "$corpus/dirindex/table-only.pacer-index" <<'PY'
import struct, sys
b = open(sys.argv[1], "rb").read()
table = struct.unpack_from("<Q", b, 24)[0]
open(sys.argv[2], "wb").write(b[:12] + struct.pack("<I", 1) + b[16:48 + table])
PY

# --- Text for the tokenizer's reader: real text Debian ships, JSON lines, and invalid UTF-8.
cp /usr/share/common-licenses/BSD "$corpus/tokenize/bsd.txt"
printf 'Licensed to you\nunder the\n\xff terms\n' > "$corpus/tokenize/bad-utf8.txt"
printf '{"text": "GNU General Public License"}\n{"text": "caf\\u00e9"}\n\n' > "$corpus/tokenize/lines.jsonl"

# --- Megatron token dataset by `pacer shard tokenize`; variants of its .idx over the same .bin.
printf 'the quick brown fox\njumps over\n\nthe lazy dog\n' > "$tmp/docs.txt"
"$pacer" shard tokenize "$tmp/docs.txt" "$tmp/tok" >/dev/null
cp "$tmp/tok.bin" "$fix/tokens.bin"
cp "$tmp/tok.idx" "$corpus/idx/tokens.idx"
$py - "$tmp/tok.idx" "$corpus/idx" <<'PY'
import struct, sys
src, out = sys.argv[1], sys.argv[2]
b = open(src, "rb").read()
code = b[17]
seqs, docs = struct.unpack_from("<QQ", b, 18)
pos = 34
lengths = struct.unpack_from(f"<{seqs}i", b, pos); pos += 4 * seqs
pointers = struct.unpack_from(f"<{seqs}q", b, pos); pos += 8 * seqs
doc_index = struct.unpack_from(f"<{docs}q", b, pos)
size = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}[code]
def idx(code, lengths, pointers, doc_index):
    return (b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, code, len(lengths), len(doc_index))
            + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
            + struct.pack(f"<{len(doc_index)}q", *doc_index))
# The same bytes read as uint8: lengths in bytes.
open(f"{out}/as-uint8.idx", "wb").write(idx(1, [l * size for l in lengths], pointers, doc_index))
# Every sequence one document.
open(f"{out}/one-document.idx", "wb").write(idx(code, lengths, pointers, [0, seqs]))
# Nothing at all.
open(f"{out}/empty.idx", "wb").write(idx(code, [], [], [0]))
PY

# --- A checkpoint saved by the Python module: its MANIFEST.json is the seed, its data files the fixture.
PYTHONPATH="$build/python" $py - "$tmp/ckpt" <<'PY'
import sys
import numpy as np
from pacer.checkpoint import Checkpointer, Shard
ck = Checkpointer(sys.argv[1], keep_last=0, chunk_bytes=4096)  # two chunks for "w"
state = {"w": np.arange(1100, dtype=np.float32).reshape(100, 11), "ids": np.arange(5, dtype=np.int64),
         "rows": Shard(np.ones((3, 2), dtype=np.float16), 0, [3, 2]), "note": b"raw bytes", "lr": 0.5, "step": 7}
ck.save(7, state, meta={"run": "fuzz"}).wait()
PY
step="$tmp/ckpt/step-000000000007"
cp "$step/MANIFEST.json" "$corpus/manifest/MANIFEST.json"
mkdir -p "$fix/ckpt"
for f in "$step"/*; do
  [ "$(basename "$f")" = MANIFEST.json ] || cp "$f" "$fix/ckpt/"
done

# --- Vet profiles (the built-in ones and small layers) and a baseline written by `pacer vet --json`.
cp "$root/profiles/default.toml" "$root/profiles/h200.toml" "$corpus/profile/"
cat > "$corpus/profile/layer.toml" <<'TOML'
name = "site"
inherits = "h200"

[baseline]
fail_ratio = 0.8
warn_ratio = 0.9

[storage]
paths = ["$TMPDIR", "/scratch"]

[cluster]
outlier_warn = 2.5
outlier_min_nodes = 4

[checks."system.load"]
warn_above = 4
timeout = "5s"
TOML
printf 'name = "bare"\ninherits = "none"\n' > "$corpus/profile/bare.toml"
"$pacer" vet --quick --only system.load,system.nofile,system.mem_available,system.clocksource --json > "$corpus/baseline/report.json" || true
printf '{"schema": "pacer.vet/1", "checks": []}' > "$corpus/baseline/no-checks.json"

# --- Step records as a training script appends them.
cat > "$corpus/steps/steps.jsonl" <<'JSONL'
{"step": 1, "loss": 2.5, "tokens": 4096, "data_wait_s": 0.01, "comm_s": 0.2, "step_time_s": 0.5, "t": 1764400000.1, "rank": 0, "node": "gpu017"}
{"step": 2, "loss": 2.4, "tokens": 4096, "step_time_s": 0.49, "rank": 1, "lr": 0.0003, "grad_norm": 1.5}
{"step": 3, "loss": null}
not json
{"step": "x"}
JSONL
printf '{"step": 12}' > "$corpus/steps/one.json"
echo "corpus: $(find "$corpus" -type f | wc -l) files, fixtures: $(find "$fix" -type f | wc -l) files"
