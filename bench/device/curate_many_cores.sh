#!/usr/bin/env bash
# pacer curate classify vs fastText's own `fasttext predict` at 1, 2, 4, 8, 16 ... cores, on a host
# without Debian's text or packages (the GPU machine): bench/curate_vs_fasttext.py on a corpus and
# binaries carried from a Debian 12 machine (bench/README.md, curate section).
#
# Here (the Debian machine, after `make build`), the lead-side preparation, one command:
#   bash bench/device/curate_many_cores.sh pack [BUILD_DIR]
# writes .device-curate/ (ignored by git; not under .device/, which module.sh pack empties):
#   corpus/curate-corpus.tar.gz  this machine's bench corpus: the labelled paragraphs of
#                                /usr/share/doc/*/copyright, changelog.Debian.gz and /usr/share/man/man1
#                                as curate_vs_fasttext.py reads them (label TAB paragraph), plus a note
#                                of where and when (~12 MB)
#   libs/bin/{pacer,fasttext}    the stripped pacer CLI and Debian's fasttext CLI
#   libs/lib/*.so*               every shared library either needs except glibc's, libstdc++ and
#                                libgcc_s (the device image has newer ones) (~14 MB)
# There (device tool `run`, carry [".device-curate"], timeout 600):
#   OUT=$OUT PACER_DEVICE_LIBS=.device-curate/libs bash bench/device/curate_many_cores.sh run
# Environment: PACER_DEVICE_LIBS (default .device-curate/libs), CURATE_CORPUS (default
# .device-curate/corpus/curate-corpus.tar.gz), CORES (default "1 2 4 8 16", capped at the CPUs this
# process may use), TRIALS (default 3), REPEAT (default 8: the corpus labelled 8 times over, so that
# 16 cores still run about a second next to loading the model), LIMIT (paragraphs, default all),
# PYTHON (default python3).
# Leaves in $OUT: curate_vs_fasttext-DATE-many-cores.{json,md} (bench/results format), bench.log,
# machine.txt. LD_LIBRARY_PATH is set for pacer and fasttext only: Python keeps its own libraries.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=.device-curate

case "${1:-}" in
  pack)
    set -e
    build=${2:-build}
    rm -rf "$dest" && mkdir -p "$dest/corpus" "$dest/libs/bin" "$dest/libs/lib"
    tmp=$(mktemp -d)
    python3 bench/curate_vs_fasttext.py --save-corpus "$tmp/corpus.tsv.gz" --limit 100000000
    gzip -dc "$tmp/corpus.tsv.gz" > "$tmp/corpus.tsv"
    { echo "bench corpus of bench/curate_vs_fasttext.py (label TAB paragraph), from $(hostname) on $(date -u +%FT%TZ)";
      echo "sources: /usr/share/doc/*/copyright, changelog.Debian.gz, /usr/share/man/man1 of $(. /etc/os-release; echo "$PRETTY_NAME")";
      echo "paragraphs: $(wc -l < "$tmp/corpus.tsv")"; } > "$tmp/README.txt"
    tar -C "$tmp" -czf "$dest/corpus/curate-corpus.tar.gz" corpus.tsv README.txt
    rm -rf "$tmp"
    strip -o "$dest/libs/bin/pacer" "$build/bin/pacer"
    cp "$(command -v fasttext)" "$dest/libs/bin/fasttext"
    ldd "$build/bin/pacer" "$(command -v fasttext)" | awk '$3 ~ /^\// {print $3}' | sort -u |
      grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|libpthread|libdl|librt)\.so' |
      while read -r l; do cp -L "$l" "$dest/libs/lib/"; done
    du -sh "$dest/corpus" "$dest/libs"
    ;;
  run)
    : "${OUT:?set OUT to the folder the results go to}"
    libs=$(cd "${PACER_DEVICE_LIBS:-$dest/libs}" && pwd) || { echo "curate_many_cores: no PACER_DEVICE_LIBS folder" >&2; exit 2; }
    corpus=${CURATE_CORPUS:-$dest/corpus/curate-corpus.tar.gz}
    [ -f "$corpus" ] || { echo "curate_many_cores: no corpus at $corpus (run pack here and carry $dest)" >&2; exit 2; }
    py=${PYTHON:-python3}
    ncpu=$("$py" -c 'import os; print(len(os.sched_getaffinity(0)))')
    cores=""
    for n in ${CORES:-1 2 4 8 16}; do [ "$n" -le "$ncpu" ] && cores="$cores${cores:+,}$n"; done
    work=$(mktemp -d)
    tar -C "$work" -xzf "$corpus"
    { date -u; uptime 2>/dev/null || cat /proc/loadavg; echo "cpus allowed: $ncpu; core counts: $cores"; grep -m1 'model name' /proc/cpuinfo;
      cat "$work/README.txt"; LD_LIBRARY_PATH=$libs/lib ldd "$libs/bin/pacer" | grep -i 'not found'; } > "$OUT/machine.txt" 2>&1
    PYTHONUNBUFFERED=1 "$py" bench/curate_vs_fasttext.py --corpus "$work/corpus.tsv" --limit "${LIMIT:-1000000}" --cores "$cores" --trials "${TRIALS:-3}" \
      --repeat "${REPEAT:-8}" --pacer "$libs/bin/pacer" --fasttext "$libs/bin/fasttext" --lib-path "$libs/lib" --out "$OUT" \
      --name "curate_vs_fasttext-$(date -u +%F)-many-cores" 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    { date -u; uptime 2>/dev/null || cat /proc/loadavg; echo "rc=$rc"; } >> "$OUT/machine.txt"
    rm -rf "$work"
    exit "$rc"
    ;;
  *) echo "usage: $0 pack [BUILD_DIR] | run" >&2; exit 2 ;;
esac
