// Internal: the tar format pieces shared by the shard reader (tar.cpp) and the packer (pack.cpp).
#pragma once

#include <bit>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pacer/core/error.hpp"
#include "pacer/core/mapped_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/data.hpp"

namespace pacer::data {

constexpr std::size_t kTarBlock = 512;

inline std::int64_t ns_of(const struct timespec& t) { return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + static_cast<std::int64_t>(t.tv_nsec); }

// Limits on what a shard may hold, so that a crafted header cannot make the
// reader allocate beyond reason. The index stores name, key and extension
// lengths and field counts as u16.
constexpr std::size_t kMaxMemberName = 65535;      // bytes, after pax/GNU long names are resolved
constexpr std::uint64_t kMaxPaxHeader = 1u << 20;  // bytes of records in one pax 'x' header
constexpr std::size_t kMaxSampleFields = 65535;

// The index files' numbers (SHARD.pidx, the directory index), in this
// host's byte order, which must be little-endian.
static_assert(std::endian::native == std::endian::little, "the index formats are little-endian");
template <class T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

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

// An index as the dataset keeps it: its header (`entries` left empty) and
// its samples in a SampleTable (empty where only the header was read).
struct TableIndex {
  ShardIndex head;
  SampleTable table;
};

// load_or_build_index(shard, false) whose member-header check reads `map`
// (the shard as the loader will read it) instead of a pread per member.
Expected<TableIndex> load_or_build_index(const std::string& shard, bool header_only, const MappedFile* map);

// An index that a shard without SHARD.pidx needs written (it was missing,
// its directory index record was stale, or that record was rebound to a
// copied or touched shard), left to the caller: a dataset open that has
// kDirIndexMin or more shards of one directory without SHARD.pidx collects
// them and writes them together into the directory's index
// (write_pending_indexes).
struct PendingIndex {
  std::string shard;
  std::string image;  // the index's bytes, as in SHARD.pidx
  // A stale record was rebuilt: when the rebuilt index cannot be written,
  // the shard cannot be used (the message says why the record was stale).
  std::optional<std::string> stale;
};
constexpr std::size_t kDirIndexMin = 16;
// load_or_build_index; with `defer`, what a shard without SHARD.pidx needs
// written is left there instead (a shard with SHARD.pidx has it rewritten
// in place either way). Without it such a shard's index is written as
// SHARD.pidx, and a rebound record only by a header-only read (an open).
// What a dataset open already looked up of where a shard's index is: so
// that 10,000 shards do not mean 10,000 more stats of the same files.
class DirIndex;
struct KnownIndex {
  bool own = false;  // SHARD.pidx exists
  const Expected<std::shared_ptr<const DirIndex>>* dir = nullptr;  // DirIndex::get of its directory
};
Expected<TableIndex> load_or_build_index(const std::string& shard, bool header_only, const MappedFile* map, std::optional<PendingIndex>* defer,
                                         const KnownIndex* known = nullptr);
// Writes the pending indexes of each directory into its directory index,
// merged with the records already there; where that file cannot be written,
// as SHARD.pidx each. A write that fails is no error (the indexes stay in
// memory) unless it was a stale one's, which is an error naming the shard.
Status write_pending_indexes(const std::vector<PendingIndex>& pending);

// The directory index, DIR/.pacer-index: the indexes of many shards of one
// directory in one file (docs/data.md, "Directory index"), written where a
// dataset open indexes kDirIndexMin or more shards of a directory, because
// creating a file per shard is what a first open of thousands of shards
// spends its time on (a metadata server round trip each on a parallel file
// system; on ext4 after a large deletion, a search past recently deleted
// inodes). SHARD.pidx, where present, wins over a record.
constexpr const char* kDirIndexName = ".pacer-index";
class DirIndex {
 public:
  struct Record {
    std::uint64_t offset = 0, bytes = 0;  // of the record's index image in the file
    // The file system's time of the record's hash, estimated when it was
    // first written (0: this file's change time): the record's hash binding
    // is trusted only when that is 2 s past the shard's change time (check_index).
    std::int64_t written_ctime_ns = 0;
  };
  // DIR/.pacer-index, opened and its table read and checked (the records
  // are read when used); null when there is none. Cached per directory
  // while the file's inode, size and times stay the same. A corrupt file is
  // kConfig naming it, a read that fails kIo.
  static Expected<std::shared_ptr<const DirIndex>> get(const std::string& dir);
  // Writes DIR/.pacer-index atomically: `fresh` (file name, index image),
  // and every record of the current file whose name is not among them and
  // whose shard still exists.
  // Fresh records are bound to the file system's time of their hash: this
  // file's change time less the time since (their hashed-at), as measured here.
  // One write at a time per process; a file of a newer version is not replaced.
  static Status write(const std::string& dir, const std::vector<std::pair<std::string, std::string_view>>& fresh);
  // Drops the cached file of `dir` (a read through its descriptor failed).
  static void forget(const std::string& dir);

  const Record* find(std::string_view name) const;
  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }
  std::int64_t ctime_ns() const { return ctime_ns_; }

 private:
  friend struct DirIndexParser;
  std::string path_;
  Fd fd_;
  std::int64_t ctime_ns_ = 0;
  std::vector<std::pair<std::string, Record>> rows_;  // sorted by name
};
// The directory of `shard` as DirIndex keys it: its parent path without "."
// components or repeated slashes, ".." kept ("." for a bare file name).
std::string shard_dir(const std::string& shard);

}  // namespace pacer::data
