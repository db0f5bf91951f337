#!/usr/bin/env bash
# pacer shard tokenize on every CPU of the GPU machine, next to spm_encode alone and as many
# spm_encode processes at once as there are CPUs (bench/tokenize_vs_spm.sh; bench/README.md,
# "Tokenizing"), on 64 MiB of Debian's real text carried from here: the machine has no Debian
# packages (no sentencepiece tools) and a trimmed /usr/share/doc.
#   here:  bash bench/device/tokenize_many_cores.sh pack [BUILD_DIR]
#            -> .device/tok (bin/: pacer, spm_encode, spm_train, spm_encode_api; lib/: their libraries
#               but glibc's) and .device/tok-corpus/text.tar.xz (the text, ~72 MiB before xz)
#   there: TOK_DIR=.device/tok OUT=DIR bash bench/device/tokenize_many_cores.sh   (carry .device/tok
#            and .device/tok-corpus). Settings: ROUNDS (5), MB (64), NAME (result name), API_ROUNDS (3).
#            About 8 minutes on 16 CPUs (pacer and spm_encode on one thread take ~25 s per round at MB=64).
# Results in $OUT: the bench's NAME.json/.md, spm_encode_api-*.txt (which libsentencepiece call
# encodes fastest, on 1 thread and on every CPU), lscpu.txt, machine.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = pack ]; then
  build=${2:-build}
  out=.device/tok
  rm -rf "$out" && mkdir -p "$out/bin" "$out/lib" .device/tok-corpus
  strip -o "$out/bin/pacer" "$build/bin/pacer"
  cp -L "$(command -v spm_encode)" "$(command -v spm_train)" "$out/bin/"
  g++ -O2 -std=c++20 bench/spm_encode_api.cpp -o "$out/bin/spm_encode_api" $(pkg-config --cflags --libs sentencepiece) -pthread
  # Every library they load but glibc's own (the machine's glibc runs them: Ubuntu 24.04 has 2.39,
  # and nothing here asks for a newer symbol version; checked below), the compiler's runtime (the
  # machine's is newer and compatible; an older one first in LD_LIBRARY_PATH would be forced on its
  # python3 too) and the GPU driver's.
  for b in "$out"/bin/*; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so|/libcuda\.so|/libnvidia-' |
    while read -r l; do cp -L "$l" "$out/lib/"; done
  need=$(for f in "$out"/bin/* "$out"/lib/*; do objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)
  echo "newest glibc symbol version needed: $need"
  rm -rf .device/tok-corpus/text && python3 bench/debian_text.py .device/tok-corpus/text 72
  tar -C .device/tok-corpus -cJf .device/tok-corpus/text.tar.xz text && rm -rf .device/tok-corpus/text
  du -sh "$out" .device/tok-corpus/text.tar.xz
  exit 0
fi

: "${OUT:?set OUT to the folder the results go to}" "${TOK_DIR:?set TOK_DIR to the folder pack made (.device/tok)}"
TOK_DIR=$(cd "$TOK_DIR" && pwd)
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$TOK_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$TOK_DIR/bin:$PATH
work=$(mktemp -d "${TMPDIR:-/tmp}/tok-many-XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' .device/tok-corpus/text.tar.xz "$work"
{ date -u; uptime; nproc; python3 --version; "$TOK_DIR/bin/pacer" --version; } > "$OUT/machine.txt" 2>&1 || true
lscpu > "$OUT/lscpu.txt" 2>&1 || true
cpus=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
: "${ROUNDS:=5}" "${MB:=64}" "${NAME:=tokenize_vs_spm-h200-$(date -u +%F)-many}"
ROUNDS=$ROUNDS MB=$MB NAME=$NAME OUTDIR=$OUT TEXT_DIR=$work/text PACER_PYTHON=python3 bash bench/tokenize_vs_spm.sh "$TOK_DIR"
# The library calls on their own (no files, no pipeline): 8 MiB of the same text, trained the same way,
# 3 rounds (API_ROUNDS), so that the whole script stays within ~8 minutes on 16 CPUs.
python3 - "$work" <<'EOF'
import os, sys
sys.path.insert(0, "bench")
import debian_text
w = sys.argv[1]
t = debian_text.text(8 << 20, w + "/text")
open(w + "/api.txt", "wb").write(t)
open(w + "/train.txt", "wb").write(t[: 2 << 20])
EOF
spm_train --input="$work/train.txt" --model_prefix="$work/tok" --vocab_size=8000 --model_type=bpe --byte_fallback=true --minloglevel=2 >/dev/null 2>&1
for n in 1 "$cpus"; do
  spm_encode_api "$work/tok.model" "$work/api.txt" "$n" "${API_ROUNDS:-3}" > "$OUT/spm_encode_api-${n}threads.txt" 2>&1 || echo "spm_encode_api $n: rc=$?" >> "$OUT/spm_encode_api-${n}threads.txt"
done
{ echo; uptime; } >> "$OUT/machine.txt"
