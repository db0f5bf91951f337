// Crash-safe file replacement: a reader sees the old file or the new one, never a part.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer {

// How far a replacement must reach before it returns.
enum class Durability {
  kDurable,  // fsync of the file and of its directory: the new file survives a power loss
  // Atomic (a reader sees the old or the new file) but not synced: for caches
  // that are checked when read and rebuilt when lost or torn (shard indexes),
  // where an fsync per file dominates building thousands of them.
  kCache,
};

// Writes `contents` to a temporary file beside `path`, fsyncs it, renames it
// over `path` and fsyncs the directory (kCache: no fsyncs). On any failure
// the old file is left untouched and the temporary file removed. Not safe
// against two writers of the same path at once (the last rename wins).
Status write_file_atomic(const std::string& path, std::string_view contents, Durability durability = Durability::kDurable);

// The same, for a file too large to hold in memory: written in pieces into
// the temporary file, which becomes `path` only at commit(). Destroyed
// without commit() (an error, an exception), the temporary file is removed.
class AtomicFileWriter {
 public:
  static Expected<AtomicFileWriter> create(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& o) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& o) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  Status write(const void* data, std::size_t size);
  // Starts writing what was written so far to disk, without waiting
  // (sync_file_range), so that commit's fsync waits for less: a writer of
  // many megabytes calls it every few. A hint: errors surface at commit.
  void start_writeback();
  // fsync, rename over the path, fsync of the directory (kCache: the rename only).
  Status commit(Durability durability = Durability::kDurable);
  const std::string& path() const { return path_; }
  // The temporary file's change time (its file system's clock), in
  // nanoseconds since the epoch: what a reader of `path` will see, give or
  // take the writes after it.
  Expected<std::int64_t> change_time_ns() const;

 private:
  friend Status commit_in_order(const std::vector<std::vector<AtomicFileWriter*>>& groups);
  AtomicFileWriter() = default;
  void discard();
  Status rename_into_place();
  int fd_ = -1;
  std::uint64_t written_ = 0, writeback_from_ = 0;
  std::string path_;
  std::string tmp_;
};

// Commits several writers durably, group after group: first the data of
// every file of every group (their writeback started together, then each
// fsynced, so that the disk writes them at once), then each group's renames
// followed by one fsync of each of its directories, not one per file. A group is in place only once the groups before it are
// durable, so a manifest in the last group never outlives, in a crash, the
// files it describes. A failure before the renames leaves every old file in
// place; a rename that fails leaves the files renamed before it in place
// and every later one as it was.
Status commit_in_order(const std::vector<std::vector<AtomicFileWriter*>>& groups);

// Reads a whole file; the error names the path.
Expected<std::string> read_file(const std::string& path);

}  // namespace pacer
