// The data the crash writer saves, shared with the reliability tests so they
// can regenerate every expected byte: each blob's size, dtype, shape and bytes
// are a pure function of (step, blob index), and each byte of (step, blob
// index, byte index).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pacer/checkpoint.hpp"

namespace pacer::test::crash {

// Small chunks and a small staging budget, so that big blobs span many
// checksum chunks and save() has to wait for the writer to free buffers.
inline constexpr std::uint64_t kChunkBytes = 64ull << 10;
inline constexpr std::uint64_t kStagingBytes = 256ull << 10;
inline constexpr int kBlobs = 3;

inline std::string blob_name(int i) {
  static const char* const kNames[kBlobs] = {"small", "weights", "optimizer"};
  return kNames[i];
}

inline std::string blob_dtype(int i) { return i == 1 ? "float32" : "bytes"; }

// 0: 1..4 KiB (one chunk); 1: 64..320 KiB float32 (one to five chunks,
// usually a partial last chunk); 2: 1..4 MiB (16..64 chunks, usually a
// partial last chunk).
inline std::uint64_t blob_size(std::uint64_t step, int i) {
  switch (i) {
    case 0: return 1024 + (step * 131) % 3072;
    case 1: return 4 * (16 * 1024 + (step * 7919) % (64 * 1024));
    default: return (1ull << 20) + (step * 104729) % (3ull << 20);
  }
}

inline std::vector<std::int64_t> blob_shape(std::uint64_t step, int i) {
  if (i == 1) return {static_cast<std::int64_t>(blob_size(step, i) / 4)};
  return {};
}

inline std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Byte k of blob i at `step` is byte k % 8 (little end first) of word k / 8
// of a splitmix64 stream seeded by (step, i).
inline void fill(std::uint64_t step, int i, unsigned char* dst, std::uint64_t size) {
  std::uint64_t x = step * 0xD1B54A32D192ED03ull ^ (static_cast<std::uint64_t>(i) + 1) * 0x8CB92BA72F3D8DD7ull;
  std::uint64_t k = 0;
  for (; k + 8 <= size; k += 8) {
    const std::uint64_t w = splitmix64(x);
    for (int b = 0; b < 8; ++b) dst[k + b] = static_cast<unsigned char>(w >> (8 * b));
  }
  if (k < size) {
    const std::uint64_t w = splitmix64(x);
    for (int b = 0; k < size; ++k, ++b) dst[k] = static_cast<unsigned char>(w >> (8 * b));
  }
}

inline std::vector<unsigned char> make_blob(std::uint64_t step, int i) {
  std::vector<unsigned char> v(blob_size(step, i));
  fill(step, i, v.data(), v.size());
  return v;
}

// The index of the first byte of `data` that differs from blob i at `step`,
// or `size` when all match (sizes are the caller's to compare).
inline std::uint64_t first_mismatch(std::uint64_t step, int i, const unsigned char* data, std::uint64_t size) {
  const std::vector<unsigned char> want = make_blob(step, i);
  const std::uint64_t n = std::min<std::uint64_t>(size, want.size());
  for (std::uint64_t k = 0; k < n; ++k)
    if (data[k] != want[k]) return k;
  return n;
}

// Views of one step's blobs over `buffers` (filled by make_blob).
inline std::vector<ckpt::BlobView> views(std::uint64_t step, const std::vector<std::vector<unsigned char>>& buffers) {
  std::vector<ckpt::BlobView> out;
  for (int i = 0; i < kBlobs; ++i) {
    ckpt::BlobView v;
    v.name = blob_name(i);
    v.data = buffers[static_cast<std::size_t>(i)].data();
    v.size = buffers[static_cast<std::size_t>(i)].size();
    v.dtype = blob_dtype(i);
    v.shape = blob_shape(step, i);
    out.push_back(std::move(v));
  }
  return out;
}

inline std::vector<std::vector<unsigned char>> make_step(std::uint64_t step) {
  std::vector<std::vector<unsigned char>> b;
  for (int i = 0; i < kBlobs; ++i) b.push_back(make_blob(step, i));
  return b;
}

// The options the writer runs with (keep_last and fast tier are its flags).
inline ckpt::Options options(const std::string& root, const std::string& fast, int keep_last) {
  ckpt::Options o;
  o.root = root;
  if (!fast.empty()) o.fast_tier = fast;
  o.keep_last = keep_last;
  o.chunk_bytes = kChunkBytes;
  o.staging_bytes = kStagingBytes;
  o.pin_staging = false;
  return o;
}

}  // namespace pacer::test::crash
