// Fuzzes the tar reader: scan_tar on arbitrary bytes, then what a dataset does with the members it
// found (grouping, the index written and read back, every sample read).
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "fuzz.hpp"
#include "pacer/data.hpp"
#include "shard_reads.hpp"

using namespace pacer;

namespace pacer::fuzz {
constexpr std::uint64_t kGzipLimit = 16 << 20;
}

namespace {

// A header's checksum breaks under almost any mutation of the header, and the scan would stop at
// that block: every block with the ustar magic gets its checksum made right, so that mutated sizes,
// types and names reach the parser.
std::string with_checksums(const std::uint8_t* data, std::size_t size) {
  std::string t(reinterpret_cast<const char*>(data), size);
  for (std::size_t off = 0; off + 512 <= t.size(); off += 512) {
    auto* h = reinterpret_cast<unsigned char*>(t.data() + off);
    if (std::memcmp(h + 257, "ustar", 5) != 0) continue;
    unsigned sum = 0;
    for (std::size_t i = 0; i < 512; ++i) sum += (i >= 148 && i < 156) ? ' ' : h[i];
    std::snprintf(reinterpret_cast<char*>(h) + 148, 8, "%06o", sum);  // six digits, NUL, then a space
    h[155] = ' ';
  }
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // A mutated gzip stream can expand a thousandfold: keep the decompressed tar small.
  ::setenv("PACER_GZIP_MAX_BYTES", std::to_string(fuzz::kGzipLimit).c_str(), 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* raw, std::size_t size) {
  static const std::string shard = fuzz::scratch() + "/shard.tar";
  std::error_code ec;
  std::filesystem::remove(data::index_path(shard), ec);
  const std::string fixed = with_checksums(raw, size);
  if (size && std::memcmp(fixed.data(), raw, size) != 0) {
    fuzz::write_bytes(shard, raw, size);
    (void)data::scan_tar(shard);
  }
  const auto* data = reinterpret_cast<const std::uint8_t*>(fixed.data());
  fuzz::write_bytes(shard, data, size);

  auto members = data::scan_tar(shard);
  if (!members) return 0;
  // A gzip input (its magic first) is scanned decompressed: offsets are into that, whose size
  // PACER_GZIP_MAX_BYTES (set in main) bounds.
  const bool gzip = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  const std::uint64_t bound = gzip ? fuzz::kGzipLimit : size;
  for (const auto& m : *members)
    PACER_FUZZ_CHECK(m.offset <= bound && m.size <= bound - m.offset, "member '%s' [%llu, +%llu) outside the %llu-byte tar",
                     m.name.c_str(), (unsigned long long)m.offset, (unsigned long long)m.size, (unsigned long long)bound);
  auto grouped = data::group_samples(shard, *members);
  if (!grouped) return 0;
  const auto& samples = *grouped;

  auto built = data::build_index(shard);
  if (!built) return 0;
  auto index = data::read_index(shard, false);
  PACER_FUZZ_CHECK(index.has_value(), "the index just built does not read back: %s", index.error().message.c_str());
  PACER_FUZZ_CHECK(index->entries.size() == samples.size(), "index holds %zu samples, the scan %zu", index->entries.size(),
                   samples.size());

  auto read = fuzz::read_samples(shard);
  if (!read) return 0;
  for (std::size_t i = 0; i < read->size(); ++i)
    if (const auto& s = (*read)[i])
      PACER_FUZZ_CHECK(s->key == samples[i].key, "sample %zu: key '%s', the scan says '%s'", i, s->key.c_str(),
                       samples[i].key.c_str());
  return 0;
}
