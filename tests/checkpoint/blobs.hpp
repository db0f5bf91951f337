// Test blobs for the checkpointer tests: reproducible bytes, views of them, and small chunk and staging sizes.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "blob_data.hpp"
#include "pacer/checkpoint.hpp"

namespace pacer::ckpt::test_blobs {

using test::pattern;

inline BlobView view(const std::string& name, const std::vector<unsigned char>& data, std::string dtype = "bytes",
                     std::vector<std::int64_t> shape = {}) {
  BlobView v;
  v.name = name;
  v.data = data.data();
  v.size = data.size();
  v.dtype = std::move(dtype);
  v.shape = std::move(shape);
  return v;
}

inline std::vector<unsigned char> read_all(Reader& r, const std::string& name, std::uint64_t size) {
  std::vector<unsigned char> out(size);
  Status st = r.read(name, out.data(), size);
  EXPECT_TRUE(st) << st.error().message;
  return out;
}

inline Options small_options(const std::string& root) {
  Options o;
  o.root = root;
  o.chunk_bytes = 4096;  // many chunks even for small test blobs
  o.staging_bytes = 64 * 1024;
  o.warn = [](const std::string&) {};
  return o;
}

}  // namespace pacer::ckpt::test_blobs
