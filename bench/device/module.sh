#!/usr/bin/env bash
# The pacer Python module for a GPU machine whose Python differs from
# Debian's (the H200 machine has Python 3.12 and no package registry).
#
#   bash bench/device/module.sh pack [BUILD_DIR]   # here: stripped static libs + headers into .device/
#   bash bench/device/module.sh build              # there: compile python/*.cpp against them
#
# After `build`, PYTHONPATH=.device/python and LD_LIBRARY_PATH=.device/lib.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device
case "${1:-}" in
  pack)
    build=${2:-build}
    rm -rf "$out" && mkdir -p "$out/lib" "$out/include"
    for a in "$build"/lib/libpacer_*.a; do strip --strip-debug -o "$out/lib/$(basename "$a")" "$a"; done
    cp -r /usr/include/nlohmann /usr/include/fmt "$out/include/"
    cp /usr/include/xxhash.h "$out/include/"
    mkdir -p "$out/pybind11" && cp -r /usr/include/pybind11 "$out/pybind11/"  # Debian's, should the machine's not compile
    mkdir -p "$out/bin" && strip -o "$out/bin/pacer_unit_tests" "$build/bin/pacer_unit_tests" && strip -o "$out/bin/pacer" "$build/bin/pacer"
    cp -r "$build/generated" "$out/generated"
    # Libraries the device image lacks (Ubuntu 24.04 has fmt 9, xxhash, sqlite, OpenMPI 4).
    for l in libtomlplusplus.so.3 libcpp-httplib.so.0.11 libsentencepiece.so.0 libfasttext.so.0 libsimdjson.so.14; do cp -L "/lib/x86_64-linux-gnu/$l" "$out/lib/"; done
    cp /usr/local/cuda/lib64/libcudart_static.a "$out/lib/"
    du -sh "$out"
    ;;
  build)
    py=${PYTHON:-python3}
    pyinc="-I$($py -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    inc=$($py -m pybind11 --includes 2>/dev/null || echo "$pyinc -I$out/pybind11")
    suffix=$($py -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    mkdir -p "$out/python/pacer" "$out/obj"
    compile() {
      local pids=()
      for src in python/*.cpp; do
        g++ -O2 -std=c++20 -fPIC -fvisibility=hidden -Iinclude -I"$out/generated" -I"$out/include" $1 \
            -c "$src" -o "$out/obj/$(basename "$src" .cpp).o" & pids+=($!)
      done
      local ok=0
      for p in "${pids[@]}"; do wait "$p" || ok=1; done
      return $ok
    }
    compile "$inc" || { echo "module: retrying with Debian's pybind11 headers" >&2; compile "$pyinc -I$out/pybind11"; }
    libs=$(ls "$out"/lib/libpacer_*.a)
    g++ -shared -o "$out/python/pacer/_pacer$suffix" "$out"/obj/*.o -Wl,--start-group $libs -Wl,--end-group \
        -L"$out/lib" "$out/lib/libcudart_static.a" -l:libtomlplusplus.so.3 -l:libcpp-httplib.so.0.11 -l:libsentencepiece.so.0 \
        -l:libfmt.so.9 -l:libxxhash.so.0 -l:libsqlite3.so.0 -l:libmpi.so.40 -l:libz.so.1 -lrt -ldl -lpthread
    cp python/pacer/*.py "$out/python/pacer/"
    echo "module: $out/python/pacer/_pacer$suffix"
    ;;
  *) echo "usage: $0 pack [BUILD_DIR] | build" >&2; exit 2 ;;
esac
