// Read-only mappings of files whose reads survive the file being truncated under them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "pacer/core/error.hpp"

namespace pacer {

// A shared read-only mapping of a whole open file, read only through copy().
//
// Why not pread: a read of a few KB costs a system call and a page-cache
// lookup per page; a copy out of a mapping whose page tables are filled costs
// only the memcpy (measured in bench/README.md, loader_vs_torch).
//
// Why copy() and not data(): a page of a mapping past the file's current end
// raises SIGBUS on access, so a file truncated by another process while mapped
// would kill the process. copy() runs its memcpy under a SIGBUS guard
// (a thread-local sigsetjmp armed only for that memcpy; the process-wide
// handler jumps back only when the faulting thread is inside a guarded copy
// and otherwise passes the signal to the handler installed before it), so a
// truncated file becomes an error naming it. The handler is installed again
// by each map() where another replaced it (PyTorch's DataLoader workers
// install one that does not chain); until the next map() the guard is off.
// Python's faulthandler chains to it, after printing a stack dump; a chain
// that leads back here (faulthandler installed between two of these
// installations) ends in the default action rather than looping.
class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Maps `fd` (open for reading) at its current size, advised as huge pages
  // (what it reads from the disk is cached in 2 MiB folios where the file
  // system has them); `path` names it in errors. `fd` must stay open while
  // the mapping is read: check_size() may fstat it. An empty file maps to an
  // empty MappedFile.
  static Expected<MappedFile> map(int fd, const std::string& path);

  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Copies n bytes at `offset` into dst. Bytes past the size mapped, or pages
  // the file no longer has (truncated since it was mapped), are an I/O error
  // naming the file; dst's contents are then unspecified. A truncation inside
  // a page does not fault, the rest of that page reads as zeros: bytes copied
  // are only known to be the file's once check_size() has passed after the
  // copy. (Checking is a system call, measured at a few microseconds on a
  // KVM guest, so a caller copying many small pieces checks once for them.)
  Status copy(std::uint64_t offset, std::size_t n, void* dst) const;
  // copy() for a reader other than memcpy (widening token ids, say): runs
  // fn(bytes, n, ctx) over the mapped [offset, offset+n) under the same guard.
  // A fault leaves fn part way, so it must hold nothing that needs releasing.
  using Reader = void (*)(const unsigned char* bytes, std::size_t n, void* ctx);
  Status read(std::uint64_t offset, std::size_t n, Reader fn, void* ctx) const;
  // OK when the file still holds its first `end` bytes; else an I/O error
  // naming the file and the offset where it now ends. Below the mapping's
  // last page, on a local file system, this is one guarded read of that page
  // (a cut below a page unmaps it), else an fstat.
  Status check_size(std::uint64_t end) const;
  // A hint that [offset, offset+n) is read soon: prefetches the start of it
  // in each page (prefetches never fault, so no guard is needed and a
  // truncated file only makes it useless). Out of range: nothing.
  void prefetch(std::uint64_t offset, std::size_t n) const;
  // When the page cache holds the file (cachestat, Linux 6.5; all but 2 MiB
  // of it at most) and it is 1 GiB at most, fills the mapping's page tables
  // now, in one system call, instead of a fault per 2 MiB (or per 64 KiB of
  // small folios) as reads first touch it; true then. Otherwise (a file not
  // cached, a larger one, an older kernel) nothing: populating would read
  // the missing pages from the disk at once.
  bool map_pages_if_cached() const;

 private:
  int fd_ = -1;
  const unsigned char* data_ = nullptr;
  std::uint64_t size_ = 0;
  bool local_ = false;  // a file system whose truncations unmap at once (ext4, XFS, Btrfs, tmpfs)
  std::string path_;
};

}  // namespace pacer
