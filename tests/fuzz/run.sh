#!/usr/bin/env bash
# Runs one libFuzzer target for ctest (cmake/sanitized.cmake registers it; docs/fuzzing.md):
#   run.sh regressions NAME BINARY WORKDIR          every file in regressions/NAME, once
#   run.sh fuzz NAME BINARY WORKDIR SECONDS         fuzzing from corpus/NAME for SECONDS
#   run.sh skip REASON                              says why there is no fuzzing here (exit 77: skipped)
# New inputs go to WORKDIR/NAME (kept, so later runs start where this one ended), crashing inputs
# to WORKDIR/NAME-crashes/; the source tree is never written.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="$1"
if [ "$mode" = skip ]; then
  echo "fuzz: skipped: $2"
  exit 77
fi
name="$2" bin="$3" work="$4"
# Every input is bounded in time and memory: a parser that hangs or allocates beyond its input's
# size is a finding like a crash.
# -error_exitcode: libFuzzer's default, 77, is what ctest takes for "skipped".
opts=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -error_exitcode=1)
[ -f "$here/$name.dict" ] && opts+=("-dict=$here/$name.dict")
# The targets' scratch directories go below one folder of this run, removed at the end: a target
# that crashes or times out exits without removing its own.
base=/tmp
[ -w /dev/shm ] && base=/dev/shm
export TMPDIR="$(mktemp -d "$base/pacer-fuzz-run-XXXXXX")"
trap 'rm -rf "$TMPDIR"' EXIT
if [ ! -x "$bin" ]; then
  echo "fuzz: $bin is missing: build the main tree with 'make build SANITIZE=ON' first (it builds build/sanitize)" >&2
  exit 1
fi

case "$mode" in
  regressions)
    shopt -s nullglob
    inputs=("$here/regressions/$name"/*)
    if [ ${#inputs[@]} -eq 0 ]; then
      echo "fuzz.$name.regressions: skipped: tests/fuzz/regressions/$name holds no inputs yet"
      exit 77
    fi
    echo "fuzz.$name.regressions: ${#inputs[@]} input(s)"
    "$bin" "${opts[@]}" "${inputs[@]}"
    ;;
  fuzz)
    seconds="$5"
    mkdir -p "$work/$name" "$work/$name-crashes"
    rc=0
    "$bin" "${opts[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$work/$name-crashes/" "$work/$name" "$here/corpus/$name" || rc=$?
    if [ $rc -ne 0 ]; then
      echo >&2
      echo "fuzz.$name: the input above is in $work/$name-crashes/. Reproduce with: $bin FILE" >&2
      echo "Once the parser is fixed, copy it into tests/fuzz/regressions/$name/ so it stays fixed." >&2
    fi
    exit $rc
    ;;
  *)
    echo "usage: run.sh regressions|fuzz|skip ..." >&2
    exit 2
    ;;
esac
