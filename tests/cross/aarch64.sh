#!/usr/bin/env bash
# The Grace (aarch64) build, kept from rotting: cross-compiles the core, hw
# and vet sources and their unit tests with Debian's g++-aarch64-linux-gnu and
# runs them under qemu-aarch64-static, the GPU error checks included (against
# an aarch64 build of the fake NVML). Only what proves that the Grace build
# compiles and runs: no MPI, NCCL or CUDA (the GPU libraries are dlopen'd),
# fmt and toml++ header-only, GoogleTest from Debian's sources.
#
#   tests/cross/aarch64.sh SOURCE_DIR BUILD_DIR [OUT_DIR]
#
# BUILD_DIR is a native build (for its generated sources); OUT_DIR defaults to
# BUILD_DIR/cross-aarch64. Prints "skipped '...'" and exits 0 without the tools.
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
out=${3:-$build/cross-aarch64}
cxx=aarch64-linux-gnu-g++
qemu=qemu-aarch64-static
gtest=/usr/src/googletest/googletest
for tool in "$cxx" "$qemu"; do
  command -v "$tool" >/dev/null || { echo "skipped 'no $tool (scripts/deps.sh installs it)'"; exit 0; }
done
[ -f "$gtest/src/gtest-all.cc" ] || { echo "skipped 'no GoogleTest sources in $gtest'"; exit 0; }
launcher=""
if [ -z "${CCACHE_DISABLE:-}" ] && command -v ccache >/dev/null; then launcher=ccache; fi

lib=(core/error.cpp core/units.cpp core/stats.cpp core/atomic_file.cpp core/table.cpp core/progress.cpp
     core/host_buffer.cpp core/mapped_file.cpp core/posix_io.cpp core/process.cpp core/time.cpp
     hw/system.cpp hw/nvml.cpp hw/gpu_errors.cpp hw/libraries.cpp hw/cuda_host.cpp hw/gpu_bench_nocuda.cpp
     vet/check.cpp vet/profile.cpp vet/registry.cpp vet/runner.cpp vet/report.cpp vet/outliers.cpp
     vet/probes_system.cpp vet/probes_cpu.cpp vet/probes_memory.cpp vet/probes_storage.cpp vet/probes_gpu.cpp
     vet/probes_gpu_active.cpp vet/probes_software.cpp vet/probes_gpu_errors.cpp vet/probes_grace.cpp vet/probes_fabric.cpp)
# make test runs the tests of what the Grace build adds or changes (the FLOP
# kernel, the GPU error checks, the kernel-log parser) and core's; make
# test-slow (PACER_SLOW_TESTS=1) all of core's, hw's and vet's. CI time is the
# constraint: a cold build of the full set takes about 250 s of CPU.
tests=(core/test_units.cpp core/test_atomic_file.cpp core/test_table.cpp core/test_posix_io.cpp
       core/test_mapped_file.cpp core/test_host_buffer.cpp hw/test_gpu_errors.cpp vet/test_cpu_probe.cpp
       vet/test_gpu_errors.cpp)
opt=-O0
if [ "${PACER_SLOW_TESTS:-}" = 1 ]; then
  tests+=(hw/test_system.cpp vet/test_profile.cpp vet/test_judge.cpp vet/test_runner.cpp vet/test_gpu_nvml.cpp)
  opt=-O1
  out=$out-full
fi

mkdir -p "$out/obj" "$out/fake_nvml"

# One line per object: SOURCE OBJECT [FLAGS...]. -O0/-O1: the point is that
# it compiles and runs, not its speed; the FLOP kernel keeps the native
# build's flags so that the vector code that runs is the real one.
units=()
for f in "${lib[@]}"; do
  # No trailing blank: xargs -L would join the next line.
  extra=""; [ "$f" = vet/probes_cpu.cpp ] && extra=" -O3 -ffp-contract=fast"
  units+=("$src/src/$f $out/obj/${f//\//_}.o$extra")
done
units+=("$build/generated/builtin_profiles.cpp $out/obj/builtin_profiles.o")
for f in "${tests[@]}"; do units+=("$src/tests/$f $out/obj/test_${f//\//_}.o"); done
for f in gtest-all.cc gtest_main.cc; do units+=("$gtest/src/$f $out/obj/$f.o"); done
objs=()
for u in "${units[@]}"; do set -- $u; objs+=("$2"); done

export PACER_CROSS_CXX="$launcher $cxx"
export PACER_CROSS_FLAGS="-std=c++20 $opt -g0 -Wall -Wextra -DFMT_HEADER_ONLY -DTOML_HEADER_ONLY=1 -I$src/include -I$src/src -I$build/generated -I$src/tests -I$gtest -I$gtest/include"
# Two at a time, as the CI machine has two cores. Every object is compiled
# again (ccache, when there, makes that cheap): without dependency tracking a
# kept object could be stale.
printf '%s\n' "${units[@]}" | xargs -P "${PACER_CROSS_JOBS:-2}" -L 1 bash -c '
  s=$0 o=$1; shift
  $PACER_CROSS_CXX $PACER_CROSS_FLAGS "$@" -c "$s" -o "$o" || exit 255'
$cxx -o "$out/pacer_aarch64_tests" "${objs[@]}" -pthread -ldl
$cxx -std=c++20 -O1 -g0 -shared -fPIC -o "$out/fake_nvml/libnvidia-ml.so.1" "$src/tests/telemetry/fake_nvml.cpp"

# The guest's loader and libraries come from the cross toolchain's sysroot.
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
cd "$out"
# qemu-user takes madvise(MADV_HUGEPAGE) without passing it on, so the huge
# page advice of core's HostBuffer cannot be seen in smaps there.
filter=${PACER_CROSS_FILTER:--HostBuffer.AdviseHugePagesCoversWholeHugePagesOnly:HostBuffer.HugeBufferIsAdvised}
LD_LIBRARY_PATH="$out/fake_nvml" $qemu ./pacer_aarch64_tests --gtest_brief=1 --gtest_filter="$filter"
# Both FLOP kernels: qemu's default CPU has 512-bit SVE; a Neoverse N1 has none.
PACER_EXPECT_CPU_KERNEL=sve $qemu ./pacer_aarch64_tests --gtest_brief=1 --gtest_filter='CpuProbe.*'
QEMU_CPU=neoverse-n1 PACER_EXPECT_CPU_KERNEL=neon $qemu ./pacer_aarch64_tests --gtest_brief=1 --gtest_filter='CpuProbe.*'
