#!/usr/bin/env bash
# pacer curate classify vs Debian's `fasttext predict` (same model, same Debian text; 1 core and all
# cores) and near-duplicate recall/precision of pacer curate dedup on planted pairs. Results:
# bench/results/curate_vs_fasttext-DATE.{json,md}. Options: --trials N, --limit PARAGRAPHS, --cores N.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec python3 "$here/curate_vs_fasttext.py" "$@"
