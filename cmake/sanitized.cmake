# A second build tree, build/sanitize, that `make test-slow` builds and tests too (docs/fuzzing.md):
# the library, the unit tests and the Python module under ASan + UBSan, and, with clang's
# libFuzzer, the fuzz targets of tests/fuzz. One tree serves both, so test-slow pays for one
# extra build of the library: with clang everything in it also carries libFuzzer's coverage
# instrumentation, which the unit and Python tests simply do not use.
# Off by default: the tree is a second build of everything, which with the main one and the tests took
# CI past 30 minutes on two cores (2,606 s on 2026-12-04). `make test-slow` turns both on.
option(PACER_SANITIZED_TESTS "Build the unit tests and the Python module with ASan + UBSan in build/sanitize and run them" OFF)
option(PACER_FUZZ "Build the fuzz targets with clang in build/sanitize and run them (skipped without clang)" OFF)
set(PACER_FUZZ_SECONDS 10 CACHE STRING "Seconds `make test-slow` fuzzes each target")
set(PACER_UNIT_SHARDS 4 CACHE STRING "ctest tests the sanitized unit tests are split into")

# The sanitized tree itself, or a build that is sanitized as a whole, adds no other.
if(PACER_SANITIZE OR PACER_FUZZ_TARGETS OR NOT (PACER_SANITIZED_TESTS OR PACER_FUZZ))
  return()
endif()

include(${PROJECT_SOURCE_DIR}/tests/fuzz/targets.cmake)
set(PACER_SANITIZED_DIR ${CMAKE_BINARY_DIR}/sanitize)

# clang with libFuzzer (Debian: clang and libclang-rt-dev): compile and link a probe.
set(PACER_HAVE_LIBFUZZER OFF)
set(PACER_NO_FUZZ_WHY "PACER_FUZZ is OFF")
if(PACER_FUZZ)
  find_program(PACER_CLANGXX NAMES clang++ clang++-16 clang++-15 clang++-14)
  find_program(PACER_CLANG NAMES clang clang-16 clang-15 clang-14)
  set(PACER_NO_FUZZ_WHY "no clang++ found (scripts/deps.sh installs clang and libclang-rt-14-dev)")
  if(PACER_CLANGXX AND PACER_CLANG)
    set(probe ${CMAKE_BINARY_DIR}/CMakeFiles/libfuzzer-probe)
    file(WRITE ${probe}/probe.cpp "extern \"C\" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n")
    execute_process(COMMAND ${PACER_CLANGXX} -fsanitize=fuzzer,address,undefined probe.cpp -o probe
      WORKING_DIRECTORY ${probe} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(PACER_HAVE_LIBFUZZER ON)
    else()
      set(PACER_NO_FUZZ_WHY "${PACER_CLANGXX} cannot link -fsanitize=fuzzer (install libclang-rt-14-dev)")
    endif()
  endif()
endif()
if(PACER_HAVE_LIBFUZZER)
  message(STATUS "pacer: fuzz targets ON (${PACER_CLANGXX})")
else()
  message(STATUS "pacer: fuzz targets OFF: ${PACER_NO_FUZZ_WHY}")
endif()
if(PACER_HAVE_LIBFUZZER)
  set(san_cxx ${PACER_CLANGXX})
  set(san_cc ${PACER_CLANG})
  set(asan_runtime_name libclang_rt.asan-${CMAKE_SYSTEM_PROCESSOR}.so)
else()
  set(san_cxx ${CMAKE_CXX_COMPILER})
  set(san_cc ${CMAKE_C_COMPILER})
  set(asan_runtime_name libasan.so)
endif()

set(san_targets)
if(PACER_SANITIZED_TESTS)
  list(APPEND san_targets pacer_unit_tests ckpt_crash_writer)
  if(TARGET pacer_python)
    list(APPEND san_targets pacer_python)
  endif()
endif()
if(PACER_HAVE_LIBFUZZER)
  list(APPEND san_targets pacer_fuzz_targets)
endif()
if(NOT san_targets)
  add_test(NAME fuzz COMMAND bash ${PROJECT_SOURCE_DIR}/tests/fuzz/run.sh skip "${PACER_NO_FUZZ_WHY}")
  set_tests_properties(fuzz PROPERTIES SKIP_RETURN_CODE 77)
  return()
endif()

# Make's jobserver reaches the sub-build only through $(MAKE): `make -j2` stays two jobs in all.
if(CMAKE_GENERATOR MATCHES "Make")
  set(san_build $(MAKE) ${san_targets})
else()
  set(san_build ${CMAKE_COMMAND} --build . --target ${san_targets})
endif()
include(ExternalProject)
ExternalProject_Add(pacer_sanitized
  SOURCE_DIR ${PROJECT_SOURCE_DIR}
  BINARY_DIR ${PACER_SANITIZED_DIR}
  CMAKE_ARGS -DCMAKE_CXX_COMPILER=${san_cxx} -DCMAKE_C_COMPILER=${san_cc}
  CMAKE_CACHE_ARGS
    -DPACER_SANITIZE:BOOL=ON
    -DPACER_FUZZ_TARGETS:BOOL=${PACER_HAVE_LIBFUZZER}
    # CPU code only, one rank: the sanitizers watch the parsers and the host-side logic.
    -DPACER_CUDA:BOOL=OFF -DPACER_MPI:BOOL=OFF -DPACER_NCCL:BOOL=OFF
    -DPACER_PYTHON:BOOL=${PACER_PYTHON}
    # -O1 with line tables, as sanitizers are usually run: readable stacks, a lighter compile than -O2 -g.
    -DCMAKE_BUILD_TYPE:STRING=RelWithDebInfo
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO:STRING=-O1 -g1"
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO:STRING=-O1 -g1"
    -DCMAKE_CXX_COMPILER_LAUNCHER:STRING=${CMAKE_CXX_COMPILER_LAUNCHER}
    -DCMAKE_C_COMPILER_LAUNCHER:STRING=${CMAKE_C_COMPILER_LAUNCHER}
    -DPACER_REPORT_NODE_INSTALLED:PATH=${CMAKE_BINARY_DIR}/report_node
  BUILD_COMMAND ${san_build}
  INSTALL_COMMAND ""
  BUILD_ALWAYS ON
  # pacer_report installs uplot into report_node, which the sub-build copies.
  DEPENDS pacer_report)

# Leaks are reported too, except in Python (the interpreter keeps its objects at exit).
set(san_env "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")

if(PACER_SANITIZED_TESTS)
  # The unit tests split into shards, so ctest -j runs them side by side.
  math(EXPR last "${PACER_UNIT_SHARDS} - 1")
  foreach(k RANGE ${last})
    add_test(NAME sanitize.unit.${k} COMMAND ${PACER_SANITIZED_DIR}/bin/pacer_unit_tests
      WORKING_DIRECTORY ${PACER_SANITIZED_DIR}/tests)
    set_tests_properties(sanitize.unit.${k} PROPERTIES TIMEOUT 1200
      ENVIRONMENT "${san_env};GTEST_TOTAL_SHARDS=${PACER_UNIT_SHARDS};GTEST_SHARD_INDEX=${k}")
  endforeach()

  # The Python module under ASan: python3 itself is not instrumented, so the runtime comes
  # first by LD_PRELOAD (it must be the first library loaded).
  if(TARGET pacer_python)
    execute_process(COMMAND ${san_cxx} -print-file-name=${asan_runtime_name} OUTPUT_VARIABLE asan_runtime OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT IS_ABSOLUTE "${asan_runtime}" OR NOT EXISTS "${asan_runtime}")
      message(STATUS "pacer: ${asan_runtime_name} not found: the sanitized Python tests are skipped")
    else()
      foreach(mod checkpoint checkpoint_state checkpoint_ranks data telemetry run)
        add_test(NAME sanitize.python.${mod}
          COMMAND ${PACER_PYTHON_EXECUTABLE} -m unittest test_${mod}
          WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/tests/python)
        set_tests_properties(sanitize.python.${mod} PROPERTIES TIMEOUT 1200
          ENVIRONMENT "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1;ASAN_OPTIONS=detect_leaks=0;LD_PRELOAD=${asan_runtime};PYTHONPATH=${PACER_SANITIZED_DIR}/python;PACER_BIN=$<TARGET_FILE:pacer_cli>")
      endforeach()
    endif()
  endif()
endif()

# Targets whose fuzzing finds, within seconds, a crash whose fix is on another branch: registered
# but disabled until it lands (their inputs wait in tests/fuzz/pending/NAME; docs/fuzzing.md).
set(PACER_FUZZ_AWAITING_FIXES)

if(PACER_HAVE_LIBFUZZER)
  foreach(name ${PACER_FUZZ_NAMES})
    set(run bash ${PROJECT_SOURCE_DIR}/tests/fuzz/run.sh)
    # Every input kept in regressions/NAME, once.
    add_test(NAME fuzz.${name}.regressions
      COMMAND ${run} regressions ${name} ${PACER_SANITIZED_DIR}/bin/fuzz_${name} ${PACER_SANITIZED_DIR}/fuzz)
    # Bounded fuzzing from corpus/NAME and the inputs earlier runs found (build/sanitize/fuzz/NAME).
    add_test(NAME fuzz.${name}
      COMMAND ${run} fuzz ${name} ${PACER_SANITIZED_DIR}/bin/fuzz_${name} ${PACER_SANITIZED_DIR}/fuzz ${PACER_FUZZ_SECONDS})
    set_tests_properties(fuzz.${name}.regressions fuzz.${name} PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
    if(name IN_LIST PACER_FUZZ_AWAITING_FIXES)
      set_tests_properties(fuzz.${name} PROPERTIES DISABLED TRUE)
    endif()
  endforeach()
else()
  add_test(NAME fuzz COMMAND bash ${PROJECT_SOURCE_DIR}/tests/fuzz/run.sh skip "${PACER_NO_FUZZ_WHY}")
  set_tests_properties(fuzz PROPERTIES SKIP_RETURN_CODE 77)
endif()
