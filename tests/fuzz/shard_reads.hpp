// Shared by the tar, pidx and dirindex targets: what a loader does with a shard once its index is accepted.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "fuzz.hpp"
#include "pacer/data.hpp"

namespace pacer::fuzz {

// Opens the shard as a dataset and reads its first samples both ways (one copy, and into a batch
// buffer); returns what read() gave for each (nothing where it failed), or nothing when the
// dataset does not open.
inline std::optional<std::vector<std::optional<data::Dataset::Sample>>> read_samples(const std::string& shard) {
  auto ds = data::Dataset::open(std::vector<std::string>{shard});
  if (!ds) return std::nullopt;
  std::vector<std::optional<data::Dataset::Sample>> out;
  data::BatchBuffer buf;
  const std::uint64_t n = std::min<std::uint64_t>((*ds)->size(), 64);
  for (std::uint64_t i = 0; i < n; ++i) {
    auto s = (*ds)->read(i);
    out.push_back(s ? std::optional(std::move(*s)) : std::nullopt);
    auto e = (*ds)->read_into(i, buf);
    if (!e) continue;
    for (const auto& f : e->fields)
      PACER_FUZZ_CHECK(f.offset <= buf.size() && f.size <= buf.size() - f.offset, "sample %llu: a field outside its batch buffer",
                       (unsigned long long)i);
  }
  return out;
}

// What an index accepted for `shard` promises, read back: every field inside the shard's
// `shard_bytes`, and every sample a dataset reads through it no larger.
inline void check_index_reads(const std::string& shard, std::uint64_t shard_bytes) {
  if (auto idx = data::read_index(shard, false))
    for (const auto& e : idx->entries)
      for (const auto& f : e.fields)
        PACER_FUZZ_CHECK(f.offset <= shard_bytes && f.size <= shard_bytes - f.offset,
                         "sample '%s' field '%s' [%llu, +%llu) accepted outside the %llu-byte shard", e.key.c_str(),
                         f.ext.c_str(), (unsigned long long)f.offset, (unsigned long long)f.size,
                         (unsigned long long)shard_bytes);
  auto read = read_samples(shard);
  if (!read) return;
  for (const auto& s : *read)
    if (s)
      for (const auto& [ext, bytes] : s->fields)
        PACER_FUZZ_CHECK(bytes.size() <= shard_bytes, "field '%s' of %zu bytes from a %llu-byte shard", ext.c_str(),
                         bytes.size(), (unsigned long long)shard_bytes);
}

}  // namespace pacer::fuzz
