#include "pacer/core/atomic_file.hpp"

#include "pacer/core/posix_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
  if (Status st = check_path(path); !st) return st.error();
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
    : fd_(std::exchange(o.fd_, -1)),
      written_(o.written_),
      writeback_from_(o.writeback_from_),
      path_(std::move(o.path_)),
      tmp_(std::move(o.tmp_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& o) noexcept {
  if (this != &o) {
    discard();
    fd_ = std::exchange(o.fd_, -1);
    written_ = o.written_;
    writeback_from_ = o.writeback_from_;
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

Expected<std::int64_t> AtomicFileWriter::change_time_ns() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return io_error("cannot stat temporary file", path_, errno);
  return static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
}

Status AtomicFileWriter::write(const void* data, std::size_t size) {
  if (fd_ < 0) return Error{ErrorKind::kUsage, path_ + ": write after commit or failure"};
  Status st = write_full(fd_, data, size, path_);
  if (!st) discard();
  else written_ += size;
  return st;
}

void AtomicFileWriter::start_writeback() {
  if (fd_ < 0 || written_ == writeback_from_) return;
  // Only what is new since the last call: the range before it is queued already.
  (void)::sync_file_range(fd_, static_cast<off_t>(writeback_from_), static_cast<off_t>(written_ - writeback_from_), SYNC_FILE_RANGE_WRITE);
  writeback_from_ = written_;
}

Status AtomicFileWriter::rename_into_place() {
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
  return {};
}

namespace {
std::string dir_of(const std::string& path) {
  const std::filesystem::path target(path);
  return target.has_parent_path() ? target.parent_path().string() : ".";
}
}  // namespace

Status AtomicFileWriter::commit(Durability durability) {
  if (fd_ < 0) return Error{ErrorKind::kUsage, path_ + ": commit after commit or failure"};
  auto fail = [&](std::string_view what) {
    const int err = errno;
    discard();
    return io_error(what, path_, err);
  };
  const bool durable = durability == Durability::kDurable;
  if (durable && retry_eintr([&] { return ::fsync(fd_); }) != 0) return fail("fsync failed");
  const std::string path = path_;
  if (Status st = rename_into_place(); !st) return st;
  // The rename is durable only once the directory entry is on disk.
  if (durable) (void)fsync_dir(dir_of(path));
  return {};
}

Status commit_in_order(const std::vector<std::vector<AtomicFileWriter*>>& groups) {
  for (const auto& g : groups)
    for (AtomicFileWriter* w : g)
      if (w->fd_ < 0) return Error{ErrorKind::kUsage, w->path_ + ": commit after commit or failure"};
  // Writeback of every file queued at once, then the waits, so the disk
  // writes them together. (Each fsync still ends in a cache flush of its
  // own: ~4 ms on the VM's ext4, bench/results/tokenize_fsyncs-2026-12-04.md.)
  for (const auto& g : groups)
    for (AtomicFileWriter* w : g) w->start_writeback();
  for (const auto& g : groups)
    for (AtomicFileWriter* w : g)
      if (retry_eintr([&] { return ::fsync(w->fd_); }) != 0) {
        const Error e = io_error("fsync failed", w->path_, errno);
        for (const auto& g2 : groups)
          for (AtomicFileWriter* x : g2) x->discard();
        return e;
      }
  for (std::size_t k = 0; k < groups.size(); ++k) {
    std::vector<std::string> dirs;
    for (AtomicFileWriter* w : groups[k]) {
      const std::string path = w->path_;
      if (Status st = w->rename_into_place(); !st) {
        for (std::size_t j = k; j < groups.size(); ++j)
          for (AtomicFileWriter* x : groups[j]) x->discard();
        return st;
      }
      if (std::find(dirs.begin(), dirs.end(), dir_of(path)) == dirs.end()) dirs.push_back(dir_of(path));
    }
    for (const auto& d : dirs) (void)fsync_dir(d);
  }
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
