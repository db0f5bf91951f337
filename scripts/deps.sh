#!/usr/bin/env bash
# Installs the Debian 12 packages Pacer builds and tests with. Idempotent: only
# packages that are missing are installed, so a second run costs one dpkg query.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git
  libcli11-dev nlohmann-json3-dev libtomlplusplus-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev libsqlite3-dev libcpp-httplib-dev
  zlib1g-dev  # gzip-compressed shards (.tar.gz)
  python3-pil  # image decoders of pacer.data (optional at run time)
  libsentencepiece-dev sentencepiece python3-sentencepiece  # tokenizer models; spm_train makes the tests' model
  prometheus  # promtool and the server for the telemetry exporter tests
  python3 python3-dev pybind11-dev python3-numpy python3-torch
  libopenmpi-dev openmpi-bin
  mbw fio
  perftest  # ib_write_bw/ib_write_lat for vet --cluster RDMA pairs; the tests run its no-device path
  clang libclang-rt-dev  # libFuzzer and the sanitizer runtimes, for build/sanitize (docs/fuzzing.md)
  slurm-wlm munge
  chromium  # headless, for the pacer report integration test
  g++-aarch64-linux-gnu qemu-user-static googletest  # the aarch64 (Grace) cross-build test, tests/cross/aarch64.sh
  libfasttext-dev fasttext  # pacer curate's classifiers; the fasttext CLI is the benchmark's peer
  libsimdjson-dev  # pacer curate's JSON-lines parser (nlohmann stays the reference and the error messages)
)
# The report's charting library is installed with npm at build time
# (report/package-lock.json). A Node.js from NodeSource already ships npm and
# conflicts with Debian's npm package, so Debian's are added only without one.
if ! command -v npm >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "deps: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
