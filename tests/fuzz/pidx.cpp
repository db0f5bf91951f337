// Fuzzes the shard index reader: arbitrary bytes as the .pidx of a fixed, real shard
// (fixtures/shard.tar), then every sample read through it.
#include <filesystem>

#include "fuzz.hpp"
#include "pacer/data.hpp"
#include "shard_reads.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string shard = fuzz::place_fixture("shard.tar", "shard.tar");
  static const std::uint64_t shard_bytes = std::filesystem::file_size(shard);
  fuzz::write_bytes(data::index_path(shard), data, size);

  (void)data::read_index(shard, true);
  auto idx = data::read_index(shard, false);
  if (!idx) return 0;
  for (const auto& e : idx->entries)
    for (const auto& f : e.fields)
      PACER_FUZZ_CHECK(f.offset <= shard_bytes && f.size <= shard_bytes - f.offset,
                       "sample '%s' field '%s' [%llu, +%llu) accepted outside the %llu-byte shard", e.key.c_str(),
                       f.ext.c_str(), (unsigned long long)f.offset, (unsigned long long)f.size,
                       (unsigned long long)shard_bytes);

  auto read = fuzz::read_samples(shard);
  if (!read) return 0;
  for (const auto& s : *read)
    if (s)
      for (const auto& [ext, bytes] : s->fields)
        PACER_FUZZ_CHECK(bytes.size() <= shard_bytes, "field '%s' of %zu bytes from a %llu-byte shard", ext.c_str(),
                         bytes.size(), (unsigned long long)shard_bytes);
  return 0;
}
