// Shared by the libFuzzer targets: a private scratch directory for parsers that read paths, and the
// fixtures (tests/fuzz/fixtures) some inputs are read against.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#ifndef PACER_FUZZ_FIXTURES
#error "PACER_FUZZ_FIXTURES (the tests/fuzz/fixtures folder) must be defined"
#endif

namespace pacer::fuzz {

// Created once per process, removed at exit. On tmpfs when there is one: every
// input is written to a file, thousands of times a second.
inline const std::string& scratch() {
  // Never destroyed: the exit handler that removes the directory runs after static destructors.
  static const std::string* dir = [] {
    std::string base = "/tmp";
    if (const char* t = std::getenv("TMPDIR"); t && *t) base = t;
    else if (::access("/dev/shm", W_OK) == 0) base = "/dev/shm";
    auto* d = new std::string(base + "/pacer-fuzz-XXXXXX");
    if (!::mkdtemp(d->data())) {
      std::perror("pacer fuzz: mkdtemp");
      std::abort();
    }
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch(), ec);
    });
    return d;
  }();
  return *dir;
}

inline void write_bytes(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) {
    std::fprintf(stderr, "pacer fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

inline std::string fixture(const char* name) { return std::string(PACER_FUZZ_FIXTURES) + "/" + name; }

// Copies a fixture into the scratch directory (once, at start-up) and returns its new path.
inline std::string place_fixture(const char* name, const std::string& as) {
  const std::string to = scratch() + "/" + as;
  std::error_code ec;
  std::filesystem::copy(fixture(name), to, std::filesystem::copy_options::overwrite_existing |
                                               std::filesystem::copy_options::recursive, ec);
  if (ec) {
    std::fprintf(stderr, "pacer fuzz: cannot copy fixture %s: %s\n", name, ec.message().c_str());
    std::abort();
  }
  return to;
}

}  // namespace pacer::fuzz

// A property the parser promises (beyond not crashing) that does not hold: a
// lie is a finding like a crash, so it aborts and libFuzzer saves the input.
#define PACER_FUZZ_CHECK(cond, ...)                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "pacer fuzz: %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                  \
      std::fprintf(stderr, "\n");                                         \
      std::abort();                                                       \
    }                                                                     \
  } while (0)
