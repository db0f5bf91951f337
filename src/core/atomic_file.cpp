#include "pacer/core/atomic_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

namespace pacer {
namespace {

Error io_error(std::string_view what, const std::string& path, int err) {
  return Error{ErrorKind::kIo, fmt::format("{}: {}: {}", path, what, std::strerror(err))};
}

}  // namespace

Expected<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmpl = (dir / ("." + target.filename().string() + ".tmp.XXXXXX")).string();
  const int fd = mkstemp(tmpl.data());
  if (fd < 0) return io_error("cannot create temporary file", path, errno);
  AtomicFileWriter w;
  w.fd_ = fd;
  w.path_ = path;
  w.tmp_ = std::move(tmpl);
  return w;
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)), tmp_(std::move(o.tmp_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& o) noexcept {
  if (this != &o) {
    discard();
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    tmp_ = std::move(o.tmp_);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { discard(); }

void AtomicFileWriter::discard() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
  fd_ = -1;
}

Status AtomicFileWriter::write(const void* data, std::size_t size) {
  if (fd_ < 0) return Error{ErrorKind::kUsage, path_ + ": write after commit or failure"};
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      discard();
      return io_error("write failed", path_, err);
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return {};
}

Status AtomicFileWriter::commit() {
  namespace fs = std::filesystem;
  if (fd_ < 0) return Error{ErrorKind::kUsage, path_ + ": commit after commit or failure"};
  auto fail = [&](std::string_view what) {
    const int err = errno;
    discard();
    return io_error(what, path_, err);
  };
  // mkstemp creates 0600; give the file the usual permissions.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd_, 0666 & ~mask);
  if (::fsync(fd_) != 0) return fail("fsync failed");
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    return io_error("close failed", path_, err);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    return io_error("rename failed", path_, err);
  }
  // The rename is durable only once the directory entry is on disk.
  const fs::path target(path_);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return {};
}

Status write_file_atomic(const std::string& path, std::string_view contents) {
  auto w = AtomicFileWriter::create(path);
  if (!w) return w.error();
  if (Status st = w->write(contents.data(), contents.size()); !st) return st;
  return w->commit();
}

Expected<std::string> read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    const int err = S_ISDIR(st.st_mode) ? EISDIR : errno;
    ::close(fd);
    return io_error("cannot read", path, err);
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return io_error("read failed", path, err);
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace pacer
