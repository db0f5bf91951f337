// pacer bcast: rank 0 reads, chunks go over MPI with their checksums, one rank per node writes.
#include "pacer/comm/bcast.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/hw/system.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <vector>

namespace pacer::comm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::size_t kTrailer = 16;  // XXH3-64 of the chunk, then a flag: 0 data, 1 the root failed to read

// What rank 0 saw of a source file when it listed it; the same after the
// read, or the copy may mix two versions of the file.
struct Stamp {
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  std::uint64_t ino = 0, dev = 0;
  bool operator==(const Stamp&) const = default;
};

struct FileEntry {
  std::string path;  // relative to the source directory; empty for a single file
  std::uint64_t size = 0;
  unsigned mode = 0644;
  Stamp stamp;
};

Stamp stamp_of(const struct stat& s) {
  return {static_cast<std::int64_t>(s.st_mtim.tv_sec) * 1000000000 + s.st_mtim.tv_nsec,
          static_cast<std::int64_t>(s.st_ctim.tv_sec) * 1000000000 + s.st_ctim.tv_nsec, static_cast<std::uint64_t>(s.st_ino),
          static_cast<std::uint64_t>(s.st_dev)};
}

struct Plan {
  bool ok = true;
  std::string error;
  bool directory = false;
  std::vector<FileEntry> files;
  std::uint64_t chunk_bytes = 0;
};

json plan_json(const Plan& p) {
  json files = json::array();
  for (const auto& f : p.files)
    files.push_back({{"path", f.path}, {"size", f.size}, {"mode", f.mode},
                     {"stamp", {f.stamp.mtime_ns, f.stamp.ctime_ns, f.stamp.ino, f.stamp.dev}}});
  return {{"ok", p.ok}, {"error", p.error}, {"directory", p.directory}, {"files", files}, {"chunk_bytes", p.chunk_bytes}};
}

Plan plan_from_json(const std::string& text) {
  const json j = json::parse(text);
  Plan p;
  p.ok = j.at("ok").get<bool>();
  p.error = j.at("error").get<std::string>();
  p.directory = j.at("directory").get<bool>();
  p.chunk_bytes = j.at("chunk_bytes").get<std::uint64_t>();
  for (const auto& f : j.at("files")) {
    const json& t = f.at("stamp");
    p.files.push_back({f.at("path").get<std::string>(), f.at("size").get<std::uint64_t>(), f.at("mode").get<unsigned>(),
                       {t.at(0).get<std::int64_t>(), t.at(1).get<std::int64_t>(), t.at(2).get<std::uint64_t>(),
                        t.at(3).get<std::uint64_t>()}});
  }
  return p;
}

// A directory's files: regular files, and symlinks to regular files (their
// targets' content, wherever they point: a Hugging Face snapshot's files link
// into ../../blobs/). A symlink to a directory, a dangling one, a FIFO or a
// device is refused: silently leaving it out would report a copy as whole.
Plan make_plan(const std::string& src, std::uint64_t chunk_bytes) {
  Plan p;
  p.chunk_bytes = chunk_bytes;
  auto fail = [&](std::string why) {
    p.ok = false;
    p.error = std::move(why);
    p.files.clear();
    return p;
  };
  struct stat st {};
  if (::stat(src.c_str(), &st) != 0) return fail(fmt::format("{}: {}", src, errno == ENOENT ? "no such file or directory" : std::strerror(errno)));
  if (S_ISREG(st.st_mode)) {
    p.files.push_back({"", static_cast<std::uint64_t>(st.st_size), static_cast<unsigned>(st.st_mode & 07777), stamp_of(st)});
    return p;
  }
  if (!S_ISDIR(st.st_mode)) return fail(fmt::format("{}: not a regular file or directory", src));
  p.directory = true;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(src, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const fs::path& path = it->path();
    struct stat ls {};
    if (::lstat(path.c_str(), &ls) != 0) return fail(fmt::format("{}: {}", path.string(), std::strerror(errno)));
    if (S_ISDIR(ls.st_mode)) continue;
    struct stat fst = ls;
    if (S_ISLNK(ls.st_mode)) {
      std::error_code rec;
      const std::string target = fs::read_symlink(path, rec).string();
      if (::stat(path.c_str(), &fst) != 0)
        return fail(fmt::format("{}: a symlink to {} that cannot be followed: {}", path.string(), target, std::strerror(errno)));
      if (S_ISDIR(fst.st_mode))
        return fail(fmt::format("{}: a symlink to the directory {} (not followed; bcast the directory itself)", path.string(), target));
    }
    if (!S_ISREG(fst.st_mode))
      return fail(fmt::format("{}: not a regular file, directory or symlink to a regular file", path.string()));
    p.files.push_back({path.lexically_relative(src).string(), static_cast<std::uint64_t>(fst.st_size),
                       static_cast<unsigned>(fst.st_mode & 07777), stamp_of(fst)});
  }
  if (ec) return fail(fmt::format("{}: {}", src, ec.message()));
  std::sort(p.files.begin(), p.files.end(), [](const FileEntry& a, const FileEntry& b) { return a.path < b.path; });
  return p;
}

fs::path source_of(const Plan& plan, const std::string& src, std::size_t file) {
  return plan.directory ? fs::path(src) / plan.files[file].path : fs::path(src);
}

// What changed about a source file since it was listed; empty when nothing did.
std::string changed(const FileEntry& f, const struct stat& now) {
  if (static_cast<std::uint64_t>(now.st_size) != f.size) return fmt::format("size {} -> {} bytes", f.size, now.st_size);
  const Stamp s = stamp_of(now);
  if (s.ino != f.stamp.ino || s.dev != f.stamp.dev) return "replaced by another file";
  if (s.mtime_ns != f.stamp.mtime_ns || s.ctime_ns != f.stamp.ctime_ns) return "modified";
  return "";
}

// Rank 0, after the last chunk: every source file as it was listed, or the
// copy may hold bytes of two versions of a file.
Status check_unchanged(const Plan& plan, const std::string& src) {
  for (std::size_t i = 0; i < plan.files.size(); ++i) {
    const fs::path path = source_of(plan, src, i);
    struct stat now {};
    if (::stat(path.c_str(), &now) != 0)
      return Error{ErrorKind::kIo, fmt::format("{}: changed while being copied: {}", path.string(), std::strerror(errno))};
    if (const std::string why = changed(plan.files[i], now); !why.empty())
      return Error{ErrorKind::kIo, fmt::format("{}: changed while being copied ({}); no copy put in place", path.string(), why)};
  }
  return {};
}

// Reads exactly len bytes at offset of `path` (open as fd); `got` counts what
// arrived even on failure, so the bytes-read statistic stays true. The error
// names the path and the byte where the read stopped.
Status read_chunk(int fd, const std::string& path, char* buf, std::size_t len, std::uint64_t offset, std::size_t& got) {
  got = 0;
  auto r = pread_full(fd, buf, len, offset, path);
  if (!r) return r.error();
  got = *r;
  if (got < len) return Error{ErrorKind::kIo, fmt::format("{}: short read (file changed?) at byte {}", path, offset + got)};
  return {};
}

// Receives each verified chunk in order: file index, offset, bytes.
using Sink = std::function<Status(std::size_t file, std::uint64_t offset, const char* data, std::size_t len)>;

// Streams the plan's files from rank 0 of `c`. Rank 0 reads chunk i+1 while
// chunk i is on the wire; the others hand chunk i to `sink` while chunk i+1
// arrives. Every rank of `c` stays in the collective to the end whatever
// fails, so nobody hangs; the first failure is returned.
Status stream(Communicator& c, const Plan& plan, const std::string& src, const Sink& sink, BcastStats& stats) {
  const bool root = c.rank() == 0;
  const std::size_t cb = plan.chunk_bytes;
  std::vector<char> bufs[2] = {std::vector<char>(cb + kTrailer), std::vector<char>(cb + kTrailer)};
  XXH3_state_t* total = XXH3_createState();
  XXH3_64bits_reset(total);
  Status result;

  struct Piece {
    std::size_t file;
    std::uint64_t offset;
    std::size_t len;
  };
  std::vector<Piece> pieces;
  for (std::size_t f = 0; f < plan.files.size(); ++f)
    for (std::uint64_t off = 0; off < plan.files[f].size; off += cb)
      pieces.push_back({f, off, static_cast<std::size_t>(std::min<std::uint64_t>(cb, plan.files[f].size - off))});

  // Rank 0's reads: one descriptor per file, opened when its first chunk is read.
  int fd = -1;
  std::size_t fd_file = SIZE_MAX;
  auto read_piece = [&](const Piece& p, std::vector<char>& buf) {
    std::uint64_t flag = 0;
    std::string why;
    const fs::path path = source_of(plan, src, p.file);
    if (fd_file != p.file) {
      if (fd >= 0) close(fd);
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      fd_file = p.file;
      struct stat now {};
      if (fd >= 0 && ::fstat(fd, &now) == 0) {
        if (std::string c = changed(plan.files[p.file], now); !c.empty()) why = "changed since it was listed (" + c + ")";
      } else {
        why = std::strerror(errno);
      }
    }
    std::size_t got = 0;
    if (!why.empty()) {
      why = fmt::format("{}: {} at byte {}", path.string(), why, p.offset);
    } else if (Status s = read_chunk(fd, path.string(), buf.data(), p.len, p.offset, got); !s) {
      why = s.error().message;
    }
    if (!why.empty()) flag = 1;
    const std::uint64_t h = XXH3_64bits(buf.data(), p.len);
    std::memcpy(buf.data() + p.len, &h, 8);
    std::memcpy(buf.data() + p.len + 8, &flag, 8);
    stats.bytes_read += got;
    return why;
  };

  std::future<std::string> next_read;
  std::future<Status> pending_sink;
  auto finish_sink = [&] {
    if (!pending_sink.valid()) return;
    if (auto s = pending_sink.get(); !s && result) result = s;
  };
  if (root && !pieces.empty()) next_read = std::async(std::launch::async, read_piece, pieces[0], std::ref(bufs[0]));
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    auto& buf = bufs[i % 2];
    std::string read_error;
    if (root) {
      read_error = next_read.get();
      finish_sink();  // chunk i-1's buffer is the one chunk i+1 is read into
      if (i + 1 < pieces.size())
        next_read = std::async(std::launch::async, read_piece, pieces[i + 1], std::ref(bufs[(i + 1) % 2]));
    }
    c.broadcast_bytes(buf.data(), p.len + kTrailer, 0);
    ++stats.chunks;
    std::uint64_t want = 0, flag = 0;
    std::memcpy(&want, buf.data() + p.len, 8);
    std::memcpy(&flag, buf.data() + p.len + 8, 8);
    finish_sink();
    if (flag != 0) {
      // The root could not read: everyone stops after this chunk with its reason.
      const std::string why = c.broadcast(read_error, 0);
      result = Error{ErrorKind::kIo, fmt::format("reading the source on rank 0: {}", why)};
      if (root && next_read.valid()) (void)next_read.get();
      break;
    }
    if (!root && result) {
      const std::uint64_t got = XXH3_64bits(buf.data(), p.len);
      if (got != want) {
        const auto& f = plan.files[p.file];
        result = Error{ErrorKind::kIo,
                       fmt::format("chunk {} of {} (bytes {}-{}) arrived damaged: xxh3 {:016x}, sent {:016x}", i,
                                   f.path.empty() ? src : f.path, p.offset, p.offset + p.len, got, want)};
      }
    }
    XXH3_64bits_update(total, buf.data(), p.len);
    stats.bytes += p.len;
    if (result) {
      const char* data = buf.data();
      pending_sink = std::async(std::launch::async, [&sink, p, data] { return sink(p.file, p.offset, data, p.len); });
    }
  }
  finish_sink();
  if (fd >= 0) close(fd);
  stats.xxh3 = XXH3_64bits_digest(total);
  XXH3_freeState(total);
  return result;
}

std::string host_pid() { return fmt::format("{}-{}", hw::hostname(), getpid()); }

Status fsync_path(const fs::path& p, int flags) {
  auto fd = open_fd(p.string(), flags);
  if (!fd) return fd.error();
  return fsync_fd(fd->get(), p.string());
}

// Writes the received files under a temporary name and puts them in place
// only when every byte arrived and checked. A DST that exists already is
// compared with what arrives instead: while every chunk matches nothing is
// written (a requeued job's second bcast is a no-op, with no second copy on
// the node's disk); at the first difference the temporary copy starts from
// what DST holds of the bytes so far, and at commit() it replaces DST in one
// rename (a directory: an exchange of the two names).
class Writer {
 public:
  Writer(const Plan& plan, const std::string& dst) : plan_(plan), dst_(dst) {
    tmp_ = plan.directory ? fs::path(dst + ".partial-" + host_pid()) : fs::path(dst + ".tmp-" + host_pid());
  }
  ~Writer() {
    for (auto* v : {&fds_, &old_})
      for (int fd : *v)
        if (fd >= 0) close(fd);
    if (!committed_ && started_) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
    }
  }
  Status open() {
    // Every file lands inside DST, whatever the plan says.
    for (const auto& f : plan_.files) {
      const fs::path rel(f.path);
      bool inside = plan_.directory ? !rel.empty() && rel.is_relative() : rel.empty();
      for (const auto& part : rel) inside = inside && part != ".." && part != ".";
      if (!inside) return Error{ErrorKind::kIo, fmt::format("{}: '{}' is not a path inside it", dst_, f.path)};
    }
    struct stat st {};
    if (::lstat(dst_.c_str(), &st) != 0) {
      if (errno != ENOENT) return Error{ErrorKind::kIo, fmt::format("{}: {}", dst_, std::strerror(errno))};
      return start(0, 0);
    }
    exists_ = true;
    if (plan_.directory && !S_ISDIR(st.st_mode))
      return Error{ErrorKind::kUsage, fmt::format("{}: exists and is not a directory (only a directory is replaced by one)", dst_)};
    if (!plan_.directory && S_ISDIR(st.st_mode))
      return Error{ErrorKind::kUsage, fmt::format("{}: a directory (a file never replaces one)", dst_)};
    if (!same_layout()) return start(0, 0);
    for (std::size_t i = 0; i < plan_.files.size(); ++i) {
      old_.push_back(::open(dst_path(i).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
      if (old_.back() < 0) return start(0, 0);
    }
    same_ = true;
    return {};
  }
  Status write(std::size_t file, std::uint64_t offset, const char* data, std::size_t len) {
    if (same_) {
      cmp_.resize(len);
      std::size_t got = 0;
      if (read_chunk(old_[file], dst_path(file).string(), cmp_.data(), len, offset, got).ok() &&
          std::memcmp(cmp_.data(), data, len) == 0)
        return {};
      if (Status s = start(file, offset); !s) return s;
    }
    return put(file, offset, data, len);
  }
  Status commit() {
    if (same_) {
      committed_ = true;  // DST already holds every byte: nothing to replace
      return {};
    }
    for (std::size_t i = 0; i < fds_.size(); ++i) {
      if (fsync(fds_[i]) != 0) return Error{ErrorKind::kIo, fmt::format("{}: fsync: {}", dst_, std::strerror(errno))};
      close(fds_[i]);
      fds_[i] = -1;
    }
    if (plan_.directory) {
      if (auto s = fsync_path(tmp_, O_RDONLY | O_DIRECTORY); !s) return s;
      if (auto s = exists_ ? exchange() : rename_new(); !s) return s;
    } else if (std::rename(tmp_.c_str(), dst_.c_str()) != 0) {
      return Error{ErrorKind::kIo, fmt::format("{}: rename: {}", dst_, std::strerror(errno))};
    }
    committed_ = true;
    fs::path parent = fs::path(dst_).parent_path();
    return fsync_path(parent.empty() ? fs::path(".") : parent, O_RDONLY | O_DIRECTORY);
  }
  std::uint64_t written() const { return written_; }
  // After commit(): DST held the same bytes already and was left as it was.
  bool unchanged() const { return same_; }

 private:
  fs::path dst_path(std::size_t i) const { return plan_.directory ? fs::path(dst_) / plan_.files[i].path : fs::path(dst_); }
  fs::path tmp_path(std::size_t i) const { return plan_.directory ? tmp_ / plan_.files[i].path : tmp_; }

  // DST holds exactly the plan's files (regular, same sizes and modes) and nothing else.
  bool same_layout() const {
    struct stat st {};
    if (!plan_.directory)
      return ::lstat(dst_.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<std::uint64_t>(st.st_size) == plan_.files[0].size &&
             (st.st_mode & 0777) == (plan_.files[0].mode & 0777);
    std::size_t files = 0;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dst_, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (::lstat(it->path().c_str(), &st) != 0) return false;
      if (S_ISDIR(st.st_mode)) continue;
      ++files;
      const std::string rel = it->path().lexically_relative(dst_).string();
      const auto f = std::lower_bound(plan_.files.begin(), plan_.files.end(), rel,
                                      [](const FileEntry& e, const std::string& r) { return e.path < r; });
      if (f == plan_.files.end() || f->path != rel || !S_ISREG(st.st_mode) ||
          static_cast<std::uint64_t>(st.st_size) != f->size || (st.st_mode & 0777) != (f->mode & 0777))
        return false;
    }
    return !ec && files == plan_.files.size();
  }

  // Starts the temporary copy, holding what has arrived so far: all of files
  // before `file` and `file`'s first `offset` bytes, which matched DST.
  Status start(std::size_t file, std::uint64_t offset) {
    same_ = false;
    started_ = true;
    std::error_code ec;
    if (plan_.directory) {
      fs::create_directories(tmp_, ec);
      if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", tmp_.string(), ec.message())};
    }
    for (std::size_t i = 0; i < plan_.files.size(); ++i) {
      const fs::path p = tmp_path(i);
      if (plan_.directory) fs::create_directories(p.parent_path(), ec);
      const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", p.string(), std::strerror(errno))};
      fds_.push_back(fd);
      // The source's permission bits, not the umask's: a later bcast compares them.
      if (fchmod(fd, plan_.files[i].mode & 0777) != 0)
        return Error{ErrorKind::kIo, fmt::format("{}: chmod: {}", p.string(), std::strerror(errno))};
    }
    std::vector<char> buf(static_cast<std::size_t>(std::min<std::uint64_t>(plan_.chunk_bytes, 16u << 20)));
    for (std::size_t i = 0; i < old_.size() && i <= file; ++i) {
      const std::uint64_t end = i < file ? plan_.files[i].size : offset;
      for (std::uint64_t at = 0; at < end;) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), end - at));
        std::size_t got = 0;
        if (Status s = read_chunk(old_[i], dst_path(i).string(), buf.data(), n, at, got); !s) return s;
        if (Status s = put(i, at, buf.data(), n); !s) return s;
        at += n;
      }
    }
    for (int& fd : old_) {
      close(fd);
      fd = -1;
    }
    return {};
  }

  Status put(std::size_t file, std::uint64_t offset, const char* data, std::size_t len) {
    if (Status st = pwrite_full(fds_[file], data, len, offset, tmp_path(file).string()); !st) return st;
    written_ += len;
    return {};
  }

  Status rename_new() {
    if (renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dst_.c_str(), RENAME_NOREPLACE) != 0)
      return Error{ErrorKind::kIo, fmt::format("{}: rename from {}: {}", dst_, tmp_.string(), std::strerror(errno))};
    return {};
  }

  // The new directory takes DST's name and the old one the temporary name in
  // one step, then the old one is removed: a reader of DST sees the old copy
  // or the new one, never a mix. Where the file system cannot exchange, the
  // old copy is moved aside first (DST is missing for a moment, never mixed).
  Status exchange() {
    std::error_code ec;
    if (renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dst_.c_str(), RENAME_EXCHANGE) == 0) {
      fs::remove_all(tmp_, ec);
      return {};
    }
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
      return Error{ErrorKind::kIo, fmt::format("{}: exchange with {}: {}", dst_, tmp_.string(), std::strerror(errno))};
    const std::string aside = dst_ + ".old-" + host_pid();
    if (std::rename(dst_.c_str(), aside.c_str()) != 0)
      return Error{ErrorKind::kIo, fmt::format("{}: rename to {}: {}", dst_, aside, std::strerror(errno))};
    if (auto s = rename_new(); !s) {
      (void)std::rename(aside.c_str(), dst_.c_str());
      return s;
    }
    fs::remove_all(aside, ec);
    return {};
  }

  const Plan& plan_;
  std::string dst_;
  fs::path tmp_;
  std::vector<int> fds_;  // the temporary copy's files, once started
  std::vector<int> old_;  // DST's files, while every byte so far matched them
  std::vector<char> cmp_;
  std::uint64_t written_ = 0;
  bool exists_ = false;
  bool same_ = false;
  bool started_ = false;
  bool committed_ = false;
};

Expected<Plan> share_plan(Communicator& c, const std::string& src, const BcastOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes > (1ull << 30))
    return Error{ErrorKind::kUsage, fmt::format("chunk size {} bytes: must be between 1 byte and 1 GiB", o.chunk_bytes)};
  std::string text;
  if (c.rank() == 0) text = plan_json(make_plan(src, o.chunk_bytes)).dump();
  Plan p = plan_from_json(c.broadcast(text, 0));
  if (!p.ok) return Error{ErrorKind::kUsage, p.error};
  return p;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Expected<BcastStats> broadcast_path(Communicator& world, const std::string& src, const std::string& dst,
                                    const BcastOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = share_plan(world, src, options);
  if (!plan) return plan.error();
  auto node = options.ranks_per_node > 0 ? world.split(world.rank() / options.ranks_per_node) : world.split_node();
  if (!node) return Error{ErrorKind::kUsage, "this communicator cannot tell nodes apart (bcast needs MPI)"};
  // Rank 0 is the lowest rank of its node, so it is a writer and the root of the writers.
  auto writers = world.split(node->rank() == 0 ? 0 : -1);
  BcastStats stats;
  stats.files = plan->files.size();
  stats.writer = writers != nullptr;
  stats.nodes = std::stoi(world.broadcast(writers ? std::to_string(writers->size()) : "", 0));
  Status local;
  if (writers) {
    Writer w(*plan, dst);
    Status opened = w.open();
    Sink sink = [&](std::size_t f, std::uint64_t off, const char* d, std::size_t n) -> Status {
      if (!opened) return opened;
      return w.write(f, off, d, n);
    };
    local = stream(*writers, *plan, src, sink, stats);
    if (local && !opened) local = opened;
    if (local && world.rank() == 0) local = check_unchanged(*plan, src);
    // All or nothing: no node puts its copy in place unless every node's
    // copy arrived whole, so a failed bcast is simply run again.
    const bool every_writer = writers->all_ok(static_cast<bool>(local));
    if (local && !every_writer)
      local = Error{ErrorKind::kIo, fmt::format("bcast of {} to {} failed on another node; no copy put in place", src, dst)};
    if (local) local = w.commit();
    stats.bytes_written = w.written();
    stats.unchanged = writers->all_ok(local && w.unchanged());
  }
  const bool all = world.all_ok(static_cast<bool>(local));
  stats.seconds = since(t0);
  if (!local) return local.error();
  if (!all) return Error{ErrorKind::kIo, fmt::format("bcast of {} to {} failed on another rank (see its error)", src, dst)};
  return stats;
}

Expected<std::string> broadcast_file(Communicator& world, const std::string& src, const BcastOptions& options) {
  auto plan = share_plan(world, src, options);
  if (!plan) return plan.error();
  if (plan->directory) return Error{ErrorKind::kUsage, fmt::format("{}: a directory (broadcast_file takes a file)", src)};
  std::string out(plan->files.at(0).size, '\0');
  BcastStats stats;
  Sink sink = [&](std::size_t, std::uint64_t off, const char* d, std::size_t n) -> Status {
    std::memcpy(out.data() + off, d, n);
    return {};
  };
  Status local = stream(world, *plan, src, sink, stats);
  if (local && world.rank() == 0) local = check_unchanged(*plan, src);
  const bool all = world.all_ok(static_cast<bool>(local));
  if (!local) return local.error();
  if (!all) return Error{ErrorKind::kIo, fmt::format("bcast of {} failed on another rank (see its error)", src)};
  return out;
}

}  // namespace pacer::comm
