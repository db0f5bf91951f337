// Fuzzes the shard index reader: arbitrary bytes as the .pidx of a fixed, real shard
// (fixtures/shard.tar), then every sample read through it.
//
// The index carries checksums of itself, so random bytes stop at the first one. An input whose
// reserved word (bytes 12-15) is odd is therefore "fixed up" first: the shard size and both
// checksums are set to what the reader expects, and the entries behind them get fuzzed too.
// Only the member-headers hash is left as the input has it; with bit 1 of the reserved word set too,
// the shard's mtime, inode and change time are set to the fixture's and the hash time 3 s after, so
// that the read can skip the hash (the layout checks must hold without it).
#include <sys/stat.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "fuzz.hpp"
#include "pacer/data.hpp"
#include "shard_reads.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string shard = fuzz::place_fixture("shard.tar", "shard.tar");
  static const std::uint64_t shard_bytes = std::filesystem::file_size(shard);
  std::vector<std::uint8_t> bytes(data, data + size);
  std::uint32_t reserved = 0;
  if (bytes.size() >= 96 && (std::memcpy(&reserved, bytes.data() + 12, 4), reserved & 1)) {
    const std::uint32_t reserved_bits = reserved;
    reserved = 0;
    std::memcpy(bytes.data() + 12, &reserved, 4);
    const std::uint32_t version = 5;  // the index version the reader takes (seeds may be older)
    std::memcpy(bytes.data() + 8, &version, 4);
    std::memcpy(bytes.data() + 16, &shard_bytes, 8);
    const std::uint64_t entries = XXH3_64bits(bytes.data() + 96, bytes.size() - 96);
    std::memcpy(bytes.data() + 48, &entries, 8);
    if (reserved_bits & 2) {
      // Bound to the fixture as it is, hashed 3 s after its last change: the
      // read may skip the hash (once the index file is 2 s newer than the shard).
      struct stat st {};
      if (::stat(shard.c_str(), &st) == 0) {
        const std::int64_t mtime = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
        const std::uint64_t ino = static_cast<std::uint64_t>(st.st_ino);
        const std::int64_t ctime = static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
        const std::int64_t hashed_at = ctime + 3'000'000'000;
        std::memcpy(bytes.data() + 32, &mtime, 8);
        std::memcpy(bytes.data() + 56, &ino, 8);
        std::memcpy(bytes.data() + 64, &ctime, 8);
        std::memcpy(bytes.data() + 72, &hashed_at, 8);
      }
    }
    const std::uint64_t self = XXH3_64bits(bytes.data(), 88);
    std::memcpy(bytes.data() + 88, &self, 8);
  }
  fuzz::write_bytes(data::index_path(shard), bytes.data(), bytes.size());

  (void)data::read_index(shard, true);
  fuzz::check_index_reads(shard, shard_bytes);
  return 0;
}
