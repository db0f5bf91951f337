#include "pacer/core/atomic_file.hpp"

#include "pacer/core/posix_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

namespace pacer {

namespace {

// Six random letters and digits for a temporary name, as mkstemp makes them.
std::string random_suffix() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 gen{std::random_device{}() ^ (static_cast<std::uint64_t>(::getpid()) << 32)};
  std::string out(6, ' ');
  for (auto& c : out) c = kChars[gen() % (sizeof(kChars) - 1)];
  return out;
}

}  // namespace

Expected<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string stem = (dir / ("." + target.filename().string() + ".tmp.")).string();
  // Not mkstemp: its 0600 would need an fchmod to the umask's permissions, and
  // reading the umask means setting it, which races with other threads.
  for (int attempt = 0;; ++attempt) {
    std::string tmp = stem + random_suffix();
    const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      AtomicFileWriter w;
      w.fd_ = fd;
      w.path_ = path;
      w.tmp_ = std::move(tmp);
      return w;
    }
    if (errno != EEXIST || attempt >= 100) return io_error("cannot create temporary file", path, errno);
  }
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
  Status st = write_full(fd_, data, size, path_);
  if (!st) discard();
  return st;
}

Status AtomicFileWriter::commit(Durability durability) {
  namespace fs = std::filesystem;
  if (fd_ < 0) return Error{ErrorKind::kUsage, path_ + ": commit after commit or failure"};
  auto fail = [&](std::string_view what) {
    const int err = errno;
    discard();
    return io_error(what, path_, err);
  };
  const bool durable = durability == Durability::kDurable;
  if (durable && retry_eintr([&] { return ::fsync(fd_); }) != 0) return fail("fsync failed");
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
  if (durable) (void)fsync_dir(target.has_parent_path() ? target.parent_path().string() : ".");
  return {};
}

Status write_file_atomic(const std::string& path, std::string_view contents, Durability durability) {
  auto w = AtomicFileWriter::create(path);
  if (!w) return w.error();
  if (Status st = w->write(contents.data(), contents.size()); !st) return st;
  return w->commit(durability);
}

Expected<std::string> read_file(const std::string& path) {
  auto fd = open_fd(path, O_RDONLY);
  if (!fd) return fd.error();
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0 || S_ISDIR(st.st_mode)) return io_error("cannot read", path, S_ISDIR(st.st_mode) ? EISDIR : errno);
  std::string out;
  char buf[65536];
  for (;;) {
    auto n = read_full(fd->get(), buf, sizeof(buf), path);
    if (!n) return n.error();
    out.append(buf, *n);
    if (*n < sizeof(buf)) break;
  }
  return out;
}

}  // namespace pacer
