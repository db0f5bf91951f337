// pacer bcast: rank 0 reads, chunks go over MPI with their checksums, one rank per node writes.
#include "pacer/comm/bcast.hpp"

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

struct FileEntry {
  std::string path;  // relative to the source directory; empty for a single file
  std::uint64_t size = 0;
  unsigned mode = 0644;
};

struct Plan {
  bool ok = true;
  std::string error;
  bool directory = false;
  std::vector<FileEntry> files;
  std::uint64_t chunk_bytes = 0;
};

json plan_json(const Plan& p) {
  json files = json::array();
  for (const auto& f : p.files) files.push_back({{"path", f.path}, {"size", f.size}, {"mode", f.mode}});
  return {{"ok", p.ok}, {"error", p.error}, {"directory", p.directory}, {"files", files}, {"chunk_bytes", p.chunk_bytes}};
}

Plan plan_from_json(const std::string& text) {
  const json j = json::parse(text);
  Plan p;
  p.ok = j.at("ok").get<bool>();
  p.error = j.at("error").get<std::string>();
  p.directory = j.at("directory").get<bool>();
  p.chunk_bytes = j.at("chunk_bytes").get<std::uint64_t>();
  for (const auto& f : j.at("files"))
    p.files.push_back({f.at("path").get<std::string>(), f.at("size").get<std::uint64_t>(), f.at("mode").get<unsigned>()});
  return p;
}

Plan make_plan(const std::string& src, std::uint64_t chunk_bytes) {
  Plan p;
  p.chunk_bytes = chunk_bytes;
  std::error_code ec;
  const auto st = fs::status(src, ec);
  if (ec || !fs::exists(st)) {
    p.ok = false;
    p.error = fmt::format("{}: no such file or directory", src);
    return p;
  }
  auto mode_of = [](const fs::path& f) {
    struct stat s {};
    return ::stat(f.c_str(), &s) == 0 ? static_cast<unsigned>(s.st_mode & 07777) : 0644u;
  };
  if (fs::is_regular_file(st)) {
    p.files.push_back({"", fs::file_size(src, ec), mode_of(src)});
    return p;
  }
  if (!fs::is_directory(st)) {
    p.ok = false;
    p.error = fmt::format("{}: not a regular file or directory", src);
    return p;
  }
  p.directory = true;
  for (auto it = fs::recursive_directory_iterator(src, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec) && !it->is_symlink(ec))
      p.files.push_back({fs::relative(it->path(), src).string(), it->file_size(ec), mode_of(it->path())});
  }
  if (ec) {
    p.ok = false;
    p.error = fmt::format("{}: {}", src, ec.message());
  }
  std::sort(p.files.begin(), p.files.end(), [](const FileEntry& a, const FileEntry& b) { return a.path < b.path; });
  return p;
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
    const fs::path path = plan.directory ? fs::path(src) / plan.files[p.file].path : fs::path(src);
    if (fd_file != p.file) {
      if (fd >= 0) close(fd);
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      fd_file = p.file;
    }
    std::size_t got = 0;
    while (fd >= 0 && got < p.len) {
      const ssize_t n = pread(fd, buf.data() + got, p.len - got, static_cast<off_t>(p.offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    if (fd < 0 || got < p.len) {
      flag = 1;
      why = fmt::format("{}: {} at byte {}", path.string(), fd < 0 ? std::strerror(errno) : "short read (file changed?)",
                        p.offset + got);
    }
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

std::string host_pid() {
  char h[256] = {};
  gethostname(h, sizeof h - 1);
  return fmt::format("{}-{}", h, getpid());
}

Status fsync_path(const fs::path& p, int flags) {
  const int fd = ::open(p.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", p.string(), std::strerror(errno))};
  const int r = fsync(fd);
  const int e = errno;
  close(fd);
  if (r != 0) return Error{ErrorKind::kIo, fmt::format("{}: fsync: {}", p.string(), std::strerror(e))};
  return {};
}

// Writes the received files under a temporary name and puts them in place
// only when every byte arrived and checked.
class Writer {
 public:
  Writer(const Plan& plan, const std::string& dst) : plan_(plan), dst_(dst) {
    tmp_ = plan.directory ? fs::path(dst + ".partial-" + host_pid()) : fs::path(dst + ".tmp-" + host_pid());
  }
  ~Writer() {
    for (int fd : fds_)
      if (fd >= 0) close(fd);
    if (!committed_) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
    }
  }
  Status open() {
    std::error_code ec;
    if (plan_.directory) {
      if (fs::exists(dst_, ec)) return Error{ErrorKind::kUsage, fmt::format("{}: exists (a directory is never replaced)", dst_)};
      fs::create_directories(tmp_, ec);
      if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", tmp_.string(), ec.message())};
    }
    for (const auto& f : plan_.files) {
      const fs::path p = plan_.directory ? tmp_ / f.path : tmp_;
      if (plan_.directory) fs::create_directories(p.parent_path(), ec);
      const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, f.mode ? f.mode : 0644);
      if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", p.string(), std::strerror(errno))};
      fds_.push_back(fd);
    }
    return {};
  }
  Status write(std::size_t file, std::uint64_t offset, const char* data, std::size_t len) {
    std::size_t done = 0;
    while (done < len) {
      const ssize_t n = pwrite(fds_[file], data + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const auto& f = plan_.files[file];
        return Error{ErrorKind::kIo, fmt::format("{}: write at byte {}: {}", (plan_.directory ? tmp_ / f.path : tmp_).string(),
                                                 offset + done, std::strerror(errno))};
      }
      done += static_cast<std::size_t>(n);
    }
    written_ += len;
    return {};
  }
  Status commit() {
    for (std::size_t i = 0; i < fds_.size(); ++i) {
      if (fsync(fds_[i]) != 0) return Error{ErrorKind::kIo, fmt::format("{}: fsync: {}", dst_, std::strerror(errno))};
      close(fds_[i]);
      fds_[i] = -1;
    }
    if (plan_.directory) {
      if (auto s = fsync_path(tmp_, O_RDONLY | O_DIRECTORY); !s) return s;
      if (renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dst_.c_str(), RENAME_NOREPLACE) != 0)
        return Error{ErrorKind::kIo, fmt::format("{}: rename from {}: {}", dst_, tmp_.string(), std::strerror(errno))};
    } else if (std::rename(tmp_.c_str(), dst_.c_str()) != 0) {
      return Error{ErrorKind::kIo, fmt::format("{}: rename: {}", dst_, std::strerror(errno))};
    }
    committed_ = true;
    fs::path parent = fs::path(dst_).parent_path();
    return fsync_path(parent.empty() ? fs::path(".") : parent, O_RDONLY | O_DIRECTORY);
  }
  std::uint64_t written() const { return written_; }

 private:
  const Plan& plan_;
  std::string dst_;
  fs::path tmp_;
  std::vector<int> fds_;
  std::uint64_t written_ = 0;
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
    // All or nothing: no node puts its copy in place unless every node's
    // copy arrived whole, so a failed bcast is simply run again.
    const bool every_writer = writers->all_ok(static_cast<bool>(local));
    if (local && !every_writer)
      local = Error{ErrorKind::kIo, fmt::format("bcast of {} to {} failed on another node; no copy put in place", src, dst)};
    if (local) local = w.commit();
    stats.bytes_written = w.written();
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
  const bool all = world.all_ok(static_cast<bool>(local));
  if (!local) return local.error();
  if (!all) return Error{ErrorKind::kIo, fmt::format("bcast of {} failed on another rank (see its error)", src)};
  return out;
}

}  // namespace pacer::comm
