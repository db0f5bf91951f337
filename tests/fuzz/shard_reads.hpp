// Shared by the tar and pidx targets: what a loader does with a shard once its index is accepted.
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

}  // namespace pacer::fuzz
