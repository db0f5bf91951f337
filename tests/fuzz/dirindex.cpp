// Fuzzes the directory index reader: arbitrary bytes as DIR/.pacer-index beside a fixed, real shard
// (fixtures/shard.tar, without a shard.tar.pidx), then the shard's record read and every sample
// read through it.
//
// The file carries checksums of its header and table, so random bytes stop at the first one. An
// input whose reserved word (bytes 12-15) is odd is "fixed up" first: the magic, the version and
// both checksums are set to what the reader expects, so that the table's rows get fuzzed too. The
// records behind them are index images with checksums of their own (the pidx target fuzzes those).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include <xxhash.h>

#include "data/tar_internal.hpp"
#include "fuzz.hpp"
#include "pacer/data.hpp"
#include "shard_reads.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string shard = fuzz::place_fixture("shard.tar", "shard.tar");
  static const std::uint64_t shard_bytes = std::filesystem::file_size(shard);
  static const std::string file = fuzz::scratch() + "/" + data::kDirIndexName;
  std::vector<std::uint8_t> bytes(data, data + size);
  std::uint32_t reserved = 0;
  if (bytes.size() >= 48 && (std::memcpy(&reserved, bytes.data() + 12, 4), reserved & 1)) {
    reserved = 0;
    std::memcpy(bytes.data() + 12, &reserved, 4);
    std::memcpy(bytes.data(), "PACERDIR", 8);
    const std::uint32_t version = 1;
    std::memcpy(bytes.data() + 8, &version, 4);
    std::uint64_t table = 0;
    std::memcpy(&table, bytes.data() + 24, 8);
    table = std::min<std::uint64_t>(table, bytes.size() - 48);
    std::memcpy(bytes.data() + 24, &table, 8);
    const std::uint64_t table_sum = XXH3_64bits(bytes.data() + 48, static_cast<std::size_t>(table));
    std::memcpy(bytes.data() + 32, &table_sum, 8);
    const std::uint64_t head_sum = XXH3_64bits(bytes.data(), 40);
    std::memcpy(bytes.data() + 40, &head_sum, 8);
  }
  // Replaced through a rename, as pacer writes it: a new inode each time, so that no table
  // cached from the previous input is taken for this one.
  fuzz::write_bytes(file + ".new", bytes.data(), bytes.size());
  std::filesystem::rename(file + ".new", file);
  // A reader that found the file unusable writes shard.tar.pidx, which would win from then on.
  std::error_code ec;
  std::filesystem::remove(data::index_path(shard), ec);

  (void)data::has_index(shard);
  (void)data::read_index(shard, true);
  fuzz::check_index_reads(shard, shard_bytes);
  std::filesystem::remove(data::index_path(shard), ec);
  return 0;
}
