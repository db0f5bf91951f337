// Internal: the tar format pieces shared by the shard reader (tar.cpp) and the packer (pack.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "pacer/core/error.hpp"
#include "pacer/core/mapped_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/data.hpp"

namespace pacer::data {

constexpr std::size_t kTarBlock = 512;

// Limits on what a shard may hold, so that a crafted header cannot make the
// reader allocate beyond reason. The index stores name, key and extension
// lengths and field counts as u16.
constexpr std::size_t kMaxMemberName = 65535;      // bytes, after pax/GNU long names are resolved
constexpr std::uint64_t kMaxPaxHeader = 1u << 20;  // bytes of records in one pax 'x' header
constexpr std::size_t kMaxSampleFields = 65535;

// Data is stored in whole blocks.
inline std::uint64_t tar_padded(std::uint64_t n) { return (n + kTarBlock - 1) / kTarBlock * kTarBlock; }

// True when `name` would leave the archive root on extraction: empty,
// absolute, or with a ".." component. Both reading and packing refuse them.
bool escapes_root(std::string_view name);

// Every header block of one regular-file member, as pack writes it: one ustar
// header (mode 0644, uid/gid 0, sizes of 8 GiB and more in GNU base-256),
// preceded by a pax 'x' header carrying the path when the name fits neither
// the name field nor prefix + name. A pure function of its arguments, which is
// what lets a rerun recognise a finished shard by its headers.
std::string tar_member_headers(const std::string& name, std::uint64_t size, std::int64_t mtime);

// Gzip-compressed shards. A shard whose first bytes are the gzip magic is
// decompressed whole into an anonymous in-memory file (memfd), and everything
// else reads that as it reads a plain tar: offsets in the index are offsets
// in the decompressed tar. The decompressed bytes are capped (a gzip bomb
// stops at the cap, not at the memory's end): PACER_GZIP_MAX_BYTES, else
// kDefaultGzipShardLimit.
constexpr std::uint64_t kDefaultGzipShardLimit = 8ULL << 30;
std::uint64_t gzip_shard_limit();
// Bytes of decompressed gzip shards a dataset keeps in memory together:
// PACER_GZIP_CACHE_BYTES, else 2 GiB.
std::uint64_t gzip_cache_limit();
Expected<bool> is_gzip(int fd, const std::string& path);
// Every member of a gzip file (concatenated members are one stream), CRC
// checked; `size` gets the decompressed bytes. A truncated or corrupt stream,
// bytes after it, or more than `limit` bytes are kConfig errors naming `path`.
Expected<Fd> gunzip_to_memory(int fd, const std::string& path, std::uint64_t limit, std::uint64_t& size);

// The tar bytes of a shard: its own descriptor, or the decompressed copy of
// a gzip shard. `tar_bytes` is the size of those bytes; `gzip` says which.
struct ShardData {
  Fd fd;
  std::uint64_t tar_bytes = 0;
  bool gzip = false;
  // The file as opened, before any decompression: what an index or a scan
  // of it is bound to (ShardIndex::shard_bytes, shard_mtime_ns).
  std::uint64_t file_bytes = 0;
  std::int64_t mtime_ns = 0;
  // A plain shard of 2 MiB or more, mapped (MappedFile::map) before its first
  // bytes were read; empty for a gzip or small shard, or where mapping failed.
  // It reads through `fd`.
  std::shared_ptr<const MappedFile> map;
};
Expected<ShardData> open_shard_data(const std::string& path);

// load_or_build_index(shard, false) whose member-header check reads `map`
// (the shard as the loader will read it) instead of a pread per member.
Expected<ShardIndex> load_or_build_index(const std::string& shard, bool header_only, const MappedFile* map);

}  // namespace pacer::data
