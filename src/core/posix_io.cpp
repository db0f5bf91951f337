#include "pacer/core/posix_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <utility>

namespace pacer {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

int Fd::release() noexcept { return std::exchange(fd_, -1); }

void Fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Status Fd::close(const std::string& path) {
  if (fd_ < 0) return {};
  // Not retried on EINTR: Linux has released the descriptor either way.
  if (::close(release()) != 0) return io_error("close failed", path, errno);
  return {};
}

Error io_error(std::string_view what, const std::string& path, int err) {
  return Error{ErrorKind::kIo, fmt::format("{}: {}: {}", path, what, std::strerror(err))};
}

Status check_path(const std::string& path) {
  if (path.find('\0') == std::string::npos) return {};
  std::string shown;
  for (const char c : path) shown += c ? std::string(1, c) : std::string("\\0");
  return Error{ErrorKind::kUsage, fmt::format("'{}': a path cannot contain a NUL byte", shown)};
}

Expected<Fd> open_fd(const std::string& path, int flags, mode_t mode) {
  if (Status st = check_path(path); !st) return st.error();
  const int fd = retry_eintr([&] { return ::open(path.c_str(), flags | O_CLOEXEC, mode); });
  if (fd < 0) return io_error("cannot open", path, errno);
  return Fd(fd);
}

Expected<std::size_t> pread_full(int fd, void* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<unsigned char*>(buf);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = retry_eintr([&] { return ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done)); });
    if (r < 0) return io_error(fmt::format("read failed at offset {}", offset + done), path, errno);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

Status pread_exact(int fd, void* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  auto got = pread_full(fd, buf, n, offset, path);
  if (!got) return got.error();
  if (*got < n)
    return Error{ErrorKind::kIo, fmt::format("{}: unexpected end of file at offset {} (wanted {} bytes at offset {})", path,
                                             offset + *got, n, offset)};
  return {};
}

Expected<std::size_t> read_full(int fd, void* buf, std::size_t n, const std::string& path) {
  auto* p = static_cast<unsigned char*>(buf);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = retry_eintr([&] { return ::read(fd, p + done, n - done); });
    if (r < 0) return io_error("read failed", path, errno);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

Status write_full(int fd, const void* buf, std::size_t n, const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(buf);
  while (n > 0) {
    const ssize_t w = retry_eintr([&] { return ::write(fd, p, n); });
    if (w < 0) return io_error("write failed", path, errno);
    if (w == 0) return io_error("write failed", path, ENOSPC);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return {};
}

Status pwrite_full(int fd, const void* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(buf);
  while (n > 0) {
    const ssize_t w = retry_eintr([&] { return ::pwrite(fd, p, n, static_cast<off_t>(offset)); });
    if (w < 0) return io_error(fmt::format("write failed at offset {}", offset), path, errno);
    if (w == 0) return io_error(fmt::format("write failed at offset {}", offset), path, ENOSPC);
    p += w;
    n -= static_cast<std::size_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
  return {};
}

Status reserve_space(int fd, std::uint64_t offset, std::uint64_t len, const std::string& path) {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max());
  if (len == 0) return {};
  if (offset > kMax || len > kMax - offset) return io_error(fmt::format("cannot reserve {} bytes at offset {}", len, offset), path, EFBIG);
  if (retry_eintr([&] { return ::fallocate(fd, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(len)); }) == 0)
    return {};
  if (errno == ENOSPC || errno == EDQUOT || errno == EFBIG)
    return io_error(fmt::format("cannot reserve {} bytes", len), path, errno);
  return {};
}

Status fsync_fd(int fd, const std::string& path) {
  if (retry_eintr([&] { return ::fsync(fd); }) != 0) return io_error("fsync failed", path, errno);
  return {};
}

Status fsync_dir(const std::string& dir) {
  const std::string d = dir.empty() ? "." : dir;
  auto fd = open_fd(d, O_RDONLY | O_DIRECTORY);
  if (!fd) return fd.error();
  // Some filesystems (and some FUSE mounts) refuse fsync on a directory:
  // there is nothing more to make durable, so that is not an error.
  if (retry_eintr([&] { return ::fsync(fd->get()); }) != 0 && errno != EINVAL && errno != EROFS)
    return io_error("fsync of the directory failed", d, errno);
  return {};
}

}  // namespace pacer
