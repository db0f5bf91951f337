// Test data for checkpoint tests: reproducible non-zero bytes, and damaging one byte of a file.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace pacer::test {

// n bytes of an xorshift sequence from `seed` (never a run of zeros).
inline std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

// Flips bits of the byte at `offset` of `file` in place.
inline void flip_byte(const std::string& file, std::uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace pacer::test
