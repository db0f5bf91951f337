// POSIX file I/O for the whole library: descriptors that close themselves, whole reads and writes.
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "pacer/core/error.hpp"

namespace pacer {

// An owned file descriptor, closed on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() noexcept;
  void reset(int fd = -1) noexcept;
  // close(2) with its error: on NFS a failed close can be the first sign of a lost write.
  Status close(const std::string& path);

 private:
  int fd_ = -1;
};

// "PATH: WHAT: strerror(err)", an I/O error.
Error io_error(std::string_view what, const std::string& path, int err);

// Calls f() until it does not fail with EINTR; f returns a POSIX result (< 0: errno is set).
template <class F>
auto retry_eintr(F f) {
  for (;;) {
    auto r = f();
    if (!(r < 0 && errno == EINTR)) return r;
  }
}

// A path that holds a NUL byte (possible from Python, JSON or a state dict)
// names another file to the kernel, which stops at the NUL: "s.tar\0x.pidx"
// would be s.tar itself. Such a path is a kUsage error naming it (the NUL
// shown as \0), checked by open_fd, the atomic writer and every API that
// takes shard or dataset paths.
Status check_path(const std::string& path);

// open(2) with O_CLOEXEC; the error names the path.
Expected<Fd> open_fd(const std::string& path, int flags, mode_t mode = 0644);

// Reads up to n bytes at `offset`, fewer only at the end of the file; returns
// the bytes read. Retries EINTR and short reads.
Expected<std::size_t> pread_full(int fd, void* buf, std::size_t n, std::uint64_t offset, const std::string& path);
// Exactly n bytes at `offset`: the end of the file first is an error naming the offset.
Status pread_exact(int fd, void* buf, std::size_t n, std::uint64_t offset, const std::string& path);
// Up to n bytes from the file position, fewer only at the end of the file (or a pipe's end).
Expected<std::size_t> read_full(int fd, void* buf, std::size_t n, const std::string& path);
// Every byte, at the file position or at `offset`. A write that makes no
// progress (0 bytes) is ENOSPC.
Status write_full(int fd, const void* buf, std::size_t n, const std::string& path);
Status pwrite_full(int fd, const void* buf, std::size_t n, std::uint64_t offset, const std::string& path);
// Allocates the blocks of [offset, offset+len) without changing the file's
// size (fallocate FALLOC_FL_KEEP_SIZE), so that later writes land in few,
// contiguous extents and a full disk shows before any byte is written. Only
// a lack of space (ENOSPC, EDQUOT, EFBIG) is an error: a filesystem that
// cannot preallocate is left to allocate as it writes.
Status reserve_space(int fd, std::uint64_t offset, std::uint64_t len, const std::string& path);
// fsync(2) of an open file.
Status fsync_fd(int fd, const std::string& path);
// fsync of a directory: what makes a rename, a creation or a removal in it
// durable. "" is the current directory.
Status fsync_dir(const std::string& dir);

}  // namespace pacer
