// `pacer shard`: pack, index, inspect and verify data shards.
//
// pack writes WebDataset tar shards (ustar headers written here, pax 'x'
// headers for names that ustar cannot hold) plus a .pidx index beside each
// shard and a manifest (schema pacer.shards/1). Every shard is a pure function
// of its content plan (member names, sizes, source mtimes, bytes), so a rerun
// recognises finished shards by their header blocks and writes only what is
// missing, and --jobs N gives the same bytes as --jobs 1.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "commands.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/progress.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/data.hpp"

namespace pacer::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::size_t kBlock = 512;
constexpr std::size_t kIoChunk = 4u << 20;

[[noreturn]] void usage(const std::string& msg) { throw Exception(Error{ErrorKind::kUsage, msg}); }
[[noreturn]] void io_fail(const std::string& msg) { throw Exception(Error{ErrorKind::kIo, msg}); }

void print(const json& j, bool as_json, const std::string& text) {
  // Keys come from file names: replace invalid UTF-8 rather than fail.
  if (as_json) std::puts(j.dump(2, ' ', false, json::error_handler_t::replace).c_str());
  else std::fputs(text.c_str(), stdout);
}

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

// A name may not leave the archive root: no absolute paths, no ".." component.
bool safe_name(std::string_view name) {
  if (name.empty() || name.front() == '/') return false;
  std::size_t pos = 0;
  while (pos <= name.size()) {
    std::size_t end = name.find('/', pos);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(pos, end - pos);
    if (part == "..") return false;
    pos = end + 1;
  }
  return true;
}

// RAII file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// pread until n bytes or end of file; returns the bytes read, -1 on error.
ssize_t pread_full(int fd, char* p, std::size_t n, std::uint64_t off) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return static_cast<ssize_t>(done);
}

bool write_full(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// Streams a whole file through XXH3-64.
Expected<std::uint64_t> hash_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(st.get());
  std::string buf(kIoChunk, '\0');
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Error{ErrorKind::kIo, fmt::format("{}: read failed: {}", path, std::strerror(errno))};
    if (n == 0) break;
    XXH3_64bits_update(st.get(), buf.data(), static_cast<std::size_t>(n));
  }
  return static_cast<std::uint64_t>(XXH3_64bits_digest(st.get()));
}

// ---------------------------------------------------------------------------
// Tar headers (ustar, pax 'x' for long names).

// n-1 zero-padded octal digits and a NUL.
void put_octal(char* p, std::size_t n, std::uint64_t v) {
  p[n - 1] = '\0';
  for (std::size_t i = n - 1; i-- > 0;) {
    p[i] = static_cast<char>('0' + (v & 7));
    v >>= 3;
  }
}

void put_size(char* p, std::uint64_t size) {
  if (size < (1ULL << 33)) {  // 11 octal digits
    put_octal(p, 12, size);
    return;
  }
  // GNU base-256 for 8 GiB and more: 0x80, then big-endian.
  p[0] = static_cast<char>(0x80);
  for (int i = 11; i >= 1; --i) {
    p[i] = static_cast<char>(size & 0xff);
    size >>= 8;
  }
}

void put_str(char* p, std::size_t n, std::string_view s) { std::memcpy(p, s.data(), std::min(n, s.size())); }

// One ustar header block.
std::string ustar_block(std::string_view name, std::string_view prefix, std::uint64_t size, std::int64_t mtime, char type) {
  std::string h(kBlock, '\0');
  char* b = h.data();
  put_str(b, 100, name);
  put_octal(b + 100, 8, 0644);
  put_octal(b + 108, 8, 0);
  put_octal(b + 116, 8, 0);
  put_size(b + 124, size);
  put_octal(b + 136, 12, static_cast<std::uint64_t>(std::max<std::int64_t>(mtime, 0)) & ((1ULL << 33) - 1));
  b[156] = type;
  std::memcpy(b + 257, "ustar", 6);  // magic with its NUL
  std::memcpy(b + 263, "00", 2);
  put_octal(b + 329, 8, 0);
  put_octal(b + 337, 8, 0);
  put_str(b + 345, 155, prefix);
  std::memset(b + 148, ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(b + 148, 8, "%06o", sum & 0777777);  // six digits, NUL
  b[155] = ' ';
  return h;
}

// "LEN key=value\n" where LEN counts the whole record, itself included.
std::string pax_record(std::string_view key, std::string_view value) {
  const std::size_t base = 1 + key.size() + 1 + value.size() + 1;
  std::size_t len = base + 1;
  while (std::to_string(len).size() + base != len) len = std::to_string(len).size() + base;
  return fmt::format("{} {}={}\n", len, key, value);
}

// Every header block of one member: the ustar header, preceded by a pax
// header when the name fits neither the name field nor prefix + name.
std::string member_headers(const std::string& name, std::uint64_t size, std::int64_t mtime) {
  if (name.size() <= 100) return ustar_block(name, "", size, mtime, '0');
  // Split at a '/' so that the prefix holds at most 155 bytes and the rest at most 100.
  for (std::size_t slash = name.find('/'); slash != std::string::npos; slash = name.find('/', slash + 1)) {
    if (slash > 155) break;
    const std::size_t rest = name.size() - slash - 1;
    if (rest == 0) break;
    if (rest <= 100) return ustar_block(std::string_view(name).substr(slash + 1), std::string_view(name).substr(0, slash), size, mtime, '0');
  }
  const std::string records = pax_record("path", name);
  const std::size_t slash = name.rfind('/');
  std::string base = slash == std::string::npos ? name : name.substr(slash + 1);
  if (base.size() > 89) base.resize(89);
  std::string out = ustar_block("PaxHeaders/" + base, "", records.size(), mtime, 'x');
  out += records;
  out.append((kBlock - records.size() % kBlock) % kBlock, '\0');
  // The ustar name is only a fallback for readers without pax support.
  out += ustar_block(std::string_view(name).substr(0, 100), "", size, mtime, '0');
  return out;
}

std::uint64_t padded(std::uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// ---------------------------------------------------------------------------
// The pack plan.

struct Member {
  std::string name;          // in the archive
  std::uint32_t key_len = 0; // name[0, key_len) is the sample key
  std::uint64_t size = 0;
  std::int64_t mtime = 0;
  std::uint64_t src_offset = 0;  // in the source file (line mode)
  std::uint64_t header_bytes = 0;
  std::string_view key() const { return std::string_view(name).substr(0, key_len); }
  std::string_view ext() const { return key_len < name.size() ? std::string_view(name).substr(key_len + 1) : std::string_view(); }
};

struct Source {
  std::string path;
  bool is_dir = false;
  std::vector<Member> members;   // in archive order
  std::vector<std::size_t> sample_starts;  // first member of each sample
  std::string source_of(const Member& m) const { return is_dir ? (fs::path(path) / m.name).string() : path; }
};

struct ShardPlan {
  std::size_t index = 0;
  std::string name;  // file name in OUT
  std::size_t first_member = 0, end_member = 0;
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;  // whole file, end blocks included
  std::uint64_t plan_hash = 0;  // of every header block, in order, and the size
  // Results.
  std::string status;  // "written" or "up to date"
  std::uint64_t xxh3 = 0;
};

std::uint32_t key_length(const std::string& name) {
  const std::size_t slash = name.rfind('/');
  const std::size_t base = slash == std::string::npos ? 0 : slash + 1;
  const std::size_t dot = name.find('.', base);
  return static_cast<std::uint32_t>(dot == std::string::npos ? name.size() : dot);
}

void scan_directory(Source& src, const std::optional<fs::path>& skip) {
  std::error_code ec;
  fs::recursive_directory_iterator it(src.path, fs::directory_options::none, ec), end;
  if (ec) usage(fmt::format("{}: {}", src.path, ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) io_fail(fmt::format("{}: {}", src.path, ec.message()));
    const fs::path& p = it->path();
    const std::string base = p.filename().string();
    // Hidden files and directories (.git, editor droppings, our own temporaries) are not samples.
    if (base.empty() || base[0] == '.') {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (skip && it->is_directory(ec) && fs::equivalent(p, *skip, ec)) {
      it.disable_recursion_pending();  // the output directory inside the source
      continue;
    }
    if (!it->is_regular_file(ec)) continue;
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) io_fail(fmt::format("{}: cannot stat: {}", p.string(), std::strerror(errno)));
    Member m;
    m.name = p.lexically_relative(src.path).generic_string();
    if (!safe_name(m.name)) usage(fmt::format("{}: member name '{}' is absolute or contains '..'", src.path, m.name));
    m.key_len = key_length(m.name);
    m.size = static_cast<std::uint64_t>(st.st_size);
    m.mtime = st.st_mtime;
    src.members.push_back(std::move(m));
  }
  std::sort(src.members.begin(), src.members.end(), [](const Member& a, const Member& b) {
    if (a.key() != b.key()) return a.key() < b.key();
    return a.ext() < b.ext();
  });
}

// One sample per non-empty line: key = zero-padded line number (from 1),
// field "json" (validated) for .jsonl/.ndjson files, "txt" otherwise.
void scan_lines(Source& src) {
  const std::string ext = (src.path.ends_with(".jsonl") || src.path.ends_with(".ndjson")) ? "json" : "txt";
  Fd fd(::open(src.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) usage(fmt::format("{}: cannot open: {}", src.path, std::strerror(errno)));
  struct stat st {};
  ::fstat(fd.get(), &st);
  struct Line {
    std::uint64_t number, offset, size;
  };
  std::vector<Line> lines;
  std::string buf(kIoChunk, '\0');
  std::string line;  // the current line, for JSON validation
  std::uint64_t off = 0, line_start = 0, number = 1;
  auto finish = [&](std::uint64_t line_end) {
    std::uint64_t size = line_end - line_start;
    if (!line.empty() && line.back() == '\r') {
      line.pop_back();
      --size;
    }
    const bool blank = line.find_first_not_of(" \t") == std::string::npos;
    if (!(blank && (ext == "json" || line.empty()))) {
      if (ext == "json" && !json::accept(line))
        throw Exception(Error{ErrorKind::kConfig, fmt::format("{}:{}: not a JSON value", src.path, number)});
      lines.push_back({number, line_start, size});
    }
    line.clear();
    ++number;
  };
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_fail(fmt::format("{}: read failed: {}", src.path, std::strerror(errno)));
    if (n == 0) break;
    std::size_t pos = 0;
    while (pos < static_cast<std::size_t>(n)) {
      const void* nl = std::memchr(buf.data() + pos, '\n', static_cast<std::size_t>(n) - pos);
      const std::size_t stop = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - buf.data()) : static_cast<std::size_t>(n);
      line.append(buf.data() + pos, stop - pos);
      if (nl) {
        finish(off + stop);
        line_start = off + stop + 1;
        pos = stop + 1;
      } else {
        pos = stop;
      }
    }
    off += static_cast<std::uint64_t>(n);
  }
  if (off > line_start) finish(off);
  const std::size_t width = std::max<std::size_t>(9, std::to_string(number).size());
  src.members.reserve(lines.size());
  for (const auto& l : lines) {
    Member m;
    m.name = fmt::format("{:0{}d}.{}", l.number, width, ext);
    m.key_len = static_cast<std::uint32_t>(width);
    m.size = l.size;
    m.mtime = st.st_mtime;
    m.src_offset = l.offset;
    src.members.push_back(std::move(m));
  }
}

std::string shard_name(const std::string& prefix, std::size_t i) { return fmt::format("{}-{:06d}.tar", prefix, i); }
std::string temp_name(const std::string& name) { return "." + name + ".partial"; }

std::vector<ShardPlan> plan_shards(Source& src, const std::string& prefix, std::uint64_t target) {
  for (auto& m : src.members) m.header_bytes = member_headers(m.name, m.size, m.mtime).size();
  for (std::size_t i = 0; i < src.members.size(); ++i)
    if (i == 0 || src.members[i].key() != src.members[i - 1].key()) src.sample_starts.push_back(i);
  std::vector<ShardPlan> shards;
  ShardPlan cur;
  auto close = [&] {
    cur.index = shards.size();
    cur.name = shard_name(prefix, cur.index);
    cur.bytes += 2 * kBlock;
    shards.push_back(cur);
  };
  for (std::size_t s = 0; s < src.sample_starts.size(); ++s) {
    const std::size_t lo = src.sample_starts[s];
    const std::size_t hi = s + 1 < src.sample_starts.size() ? src.sample_starts[s + 1] : src.members.size();
    std::uint64_t bytes = 0;
    for (std::size_t i = lo; i < hi; ++i) bytes += src.members[i].header_bytes + padded(src.members[i].size);
    if (cur.samples > 0 && cur.bytes + bytes + 2 * kBlock > target) {
      close();
      cur = ShardPlan{};
      cur.first_member = lo;
    }
    cur.end_member = hi;
    cur.bytes += bytes;
    ++cur.samples;
  }
  if (cur.samples > 0) close();
  for (auto& sh : shards) {
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
      const auto& m = src.members[i];
      const std::string h = member_headers(m.name, m.size, m.mtime);
      XXH3_64bits_update(st, h.data(), h.size());
    }
    XXH3_64bits_update(st, &sh.bytes, sizeof(sh.bytes));
    sh.plan_hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
  }
  return shards;
}

// A shard on disk is complete for this plan when it has the planned size, the
// planned header blocks at the planned offsets and the two zero end blocks.
bool shard_matches(const Source& src, const ShardPlan& sh, const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return false;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != sh.bytes) return false;
  std::uint64_t off = 0;
  std::string got;
  for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
    const auto& m = src.members[i];
    const std::string want = member_headers(m.name, m.size, m.mtime);
    got.resize(want.size());
    if (pread_full(fd.get(), got.data(), got.size(), off) != static_cast<ssize_t>(got.size()) || got != want) return false;
    off += want.size() + padded(m.size);
  }
  got.resize(2 * kBlock);
  if (pread_full(fd.get(), got.data(), got.size(), off) != static_cast<ssize_t>(got.size())) return false;
  return std::all_of(got.begin(), got.end(), [](char c) { return c == 0; });
}

// Writes one shard to its temporary name, fsyncs it and renames it into place.
// `progress` counts bytes written, for the display.
void write_shard(const Source& src, ShardPlan& sh, const fs::path& out, std::atomic<std::uint64_t>& progress,
                 const std::atomic<bool>& cancel) {
  const std::string tmp = (out / temp_name(sh.name)).string();
  const std::string final_path = (out / sh.name).string();
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) io_fail(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hs(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(hs.get());
  std::string buf;
  buf.reserve(kIoChunk + kBlock);
  std::uint64_t written = 0;
  auto flush = [&] {
    if (buf.empty()) return;
    if (!write_full(fd.get(), buf.data(), buf.size())) {
      const int err = errno;
      ::unlink(tmp.c_str());
      io_fail(fmt::format("{}: write failed: {}", tmp, std::strerror(err)));
    }
    XXH3_64bits_update(hs.get(), buf.data(), buf.size());
    written += buf.size();
    progress += buf.size();
    buf.clear();
  };
  Fd line_src;  // the source file, in line mode
  if (!src.is_dir) {
    line_src = Fd(::open(src.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!line_src) io_fail(fmt::format("{}: cannot open: {}", src.path, std::strerror(errno)));
  }
  for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
    if (cancel) {
      ::unlink(tmp.c_str());
      return;
    }
    const Member& m = src.members[i];
    buf += member_headers(m.name, m.size, m.mtime);
    Fd own;
    int in = line_src.get();
    const std::string from = src.source_of(m);
    if (src.is_dir) {
      own = Fd(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
      if (!own) io_fail(fmt::format("{}: cannot open: {}", from, std::strerror(errno)));
      in = own.get();
    }
    std::uint64_t left = m.size, at = m.src_offset;
    while (left > 0) {
      if (buf.size() >= kIoChunk) flush();
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(left, kIoChunk + kBlock - buf.size()));
      const std::size_t old = buf.size();
      buf.resize(old + want);
      const ssize_t n = pread_full(in, buf.data() + old, want, at);
      if (n != static_cast<ssize_t>(want)) {
        ::unlink(tmp.c_str());
        io_fail(fmt::format("{}: {} while packing (planned {} bytes)", from, n < 0 ? std::string("read failed: ") + std::strerror(errno) : "changed size",
                            m.size));
      }
      left -= want;
      at += want;
    }
    if (src.is_dir) {
      // A file that grew since planning would be cut silently: refuse it.
      struct stat st {};
      if (::fstat(in, &st) == 0 && static_cast<std::uint64_t>(st.st_size) != m.size) {
        ::unlink(tmp.c_str());
        io_fail(fmt::format("{}: changed size while packing ({} bytes planned, {} now)", from, m.size, st.st_size));
      }
    }
    buf.append((kBlock - m.size % kBlock) % kBlock, '\0');
  }
  buf.append(2 * kBlock, '\0');
  flush();
  if (written != sh.bytes) {
    ::unlink(tmp.c_str());
    throw Exception(Error{ErrorKind::kRuntime, fmt::format("{}: wrote {} bytes, planned {}", tmp, written, sh.bytes)});
  }
  if (::fsync(fd.get()) != 0 || ::close(fd.release()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    io_fail(fmt::format("{}: fsync failed: {}", tmp, std::strerror(err)));
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    io_fail(fmt::format("{}: rename failed: {}", final_path, std::strerror(err)));
  }
  sh.xxh3 = XXH3_64bits_digest(hs.get());
  sh.status = "written";
}

void fsync_dir(const fs::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd) ::fsync(fd.get());
}

// ---------------------------------------------------------------------------

struct ShardArgs {
  std::string src, out, target_size = "256MB", prefix = "train";
  int jobs = 1;
  std::vector<std::string> shards;
  std::string spec;
  bool json = false;
};

int pack(const ShardArgs& a) {
  if (a.jobs < 1) usage("--jobs must be at least 1");
  auto target = parse_size(a.target_size);
  if (!target || *target == 0) usage(fmt::format("--target-size '{}': expected a positive size such as 256MB", a.target_size));
  if (a.prefix.empty() || a.prefix.find('/') != std::string::npos || a.prefix.find('\0') != std::string::npos || a.prefix[0] == '.')
    usage(fmt::format("--prefix '{}': expected a plain file name prefix (no '/', not starting with '.')", a.prefix));
  std::error_code ec;
  if (!fs::exists(a.src, ec)) usage(fmt::format("{}: no such file or directory", a.src));
  if (fs::exists(a.out, ec) && !fs::is_directory(a.out, ec)) usage(fmt::format("{}: not a directory", a.out));

  Source src;
  src.path = a.src;
  src.is_dir = fs::is_directory(a.src, ec);
  if (src.is_dir) {
    std::optional<fs::path> skip;
    if (fs::exists(a.out, ec)) skip = fs::path(a.out);
    scan_directory(src, skip);
  } else {
    scan_lines(src);
  }
  if (src.members.empty()) usage(fmt::format("{}: no samples to pack", a.src));
  std::vector<ShardPlan> shards = plan_shards(src, a.prefix, *target);

  const fs::path out(a.out);
  fs::create_directories(out, ec);
  if (ec) io_fail(fmt::format("{}: cannot create: {}", a.out, ec.message()));
  // One pack at a time per output directory.
  Fd lock(::open(out.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!lock || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0)
    throw Exception(Error{ErrorKind::kIo, fmt::format("{}: another pacer shard pack is writing here", a.out)});

  // Leftovers of this prefix: temporaries of an interrupted run and shards
  // beyond this plan (from a run that planned more).
  std::vector<std::string> removed;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    const bool tmp = n.starts_with("." + a.prefix + "-") && n.ends_with(".tar.partial");
    bool extra = false;
    if (n.starts_with(a.prefix + "-") && (n.ends_with(".tar") || n.ends_with(".tar.pidx"))) {
      const std::string num = n.substr(a.prefix.size() + 1, n.find(".tar", a.prefix.size() + 1) - a.prefix.size() - 1);
      extra = num.size() >= 6 && std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
              std::stoull(num) >= shards.size();
    }
    if (tmp || extra) {
      fs::remove(e.path(), ec);
      if (extra) removed.push_back(n);
    }
  }

  // The previous manifest: its checksums are reused for shards whose plan is unchanged.
  const fs::path manifest_path = out / "manifest.json";
  std::map<std::string, std::pair<std::uint64_t, std::string>> old;  // path -> (plan, xxh3)
  std::string old_text;
  if (auto text = read_file(manifest_path.string())) {
    old_text = *text;
    json j = json::parse(*text, nullptr, false);
    if (!j.is_discarded() && j.value("schema", "") == "pacer.shards/1" && j.contains("shards") && j["shards"].is_array())
      for (const auto& s : j["shards"])
        if (s.is_object() && s.contains("path") && s.contains("plan") && s.contains("xxh3") && s["plan"].is_string())
          old[s.value("path", "")] = {std::strtoull(s["plan"].get<std::string>().c_str(), nullptr, 16), s.value("xxh3", "")};
  }

  std::vector<std::size_t> todo;
  for (auto& sh : shards) {
    const std::string path = (out / sh.name).string();
    if (!shard_matches(src, sh, path)) {
      todo.push_back(sh.index);
      continue;
    }
    sh.status = "up to date";
    auto it = old.find(sh.name);
    if (it != old.end() && it->second.first == sh.plan_hash && it->second.second.size() == 16)
      sh.xxh3 = std::strtoull(it->second.second.c_str(), nullptr, 16);
    else
      sh.xxh3 = unwrap(hash_file(path));
    // The index: kept when it is there and fits, rebuilt otherwise.
    auto idx = data::read_index(path, true);
    if (!idx || idx->samples != sh.samples) unwrap(data::build_index(path));
  }

  std::uint64_t todo_bytes = 0;
  for (auto i : todo) todo_bytes += shards[i].bytes;
  std::atomic<std::uint64_t> progress_bytes{0};
  std::atomic<std::size_t> next{0}, done{0};
  std::atomic<bool> cancel{false};
  std::mutex err_mu;
  std::optional<Error> first_error;
  auto worker = [&] {
    for (;;) {
      const std::size_t k = next++;
      if (k >= todo.size() || cancel) return;
      ShardPlan& sh = shards[todo[k]];
      try {
        write_shard(src, sh, out, progress_bytes, cancel);
        if (cancel) return;
        auto idx = data::build_index((out / sh.name).string());
        if (!idx) throw Exception(idx.error());
        if (idx->samples != sh.samples)
          throw Exception(Error{ErrorKind::kRuntime, fmt::format("{}: indexed {} samples, planned {}", sh.name, idx->samples, sh.samples)});
      } catch (const Exception& e) {
        ::unlink((out / temp_name(sh.name)).c_str());
        std::lock_guard g(err_mu);
        if (!first_error) first_error = e.error();
        cancel = true;
        return;
      } catch (const std::exception& e) {
        ::unlink((out / temp_name(sh.name)).c_str());
        std::lock_guard g(err_mu);
        if (!first_error) first_error = Error{ErrorKind::kRuntime, e.what()};
        cancel = true;
        return;
      }
      ++done;
    }
  };
  {
    Progress progress;
    std::vector<std::thread> threads;
    const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(a.jobs), std::max<std::size_t>(todo.size(), 1)));
    for (int i = 0; i < n; ++i) threads.emplace_back(worker);
    const auto t0 = std::chrono::steady_clock::now();
    // Shown from the start (and cleared at the end) whenever there is something to write.
    while (!todo.empty()) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double b = static_cast<double>(progress_bytes.load());
      progress.update(fmt::format("[{}/{} shards] {} of {}  {}/s", done.load(), todo.size(), format_bytes(b), format_bytes(double(todo_bytes)),
                                  format_bytes(s > 0.05 ? b / s : 0)));
      if (done >= todo.size() || cancel) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (auto& t : threads) t.join();
  }
  if (first_error) throw Exception(*first_error);
  fsync_dir(out);

  // The manifest: rewritten only when something changed, so a no-op rerun leaves it alone.
  json m = {{"schema", "pacer.shards/1"}, {"prefix", a.prefix}, {"target_size", *target}, {"shards", json::array()}};
  std::string sums;
  std::uint64_t total = 0, bytes = 0;
  std::map<std::string, std::uint64_t> fields;
  for (const auto& mem : src.members) ++fields[std::string(mem.ext())];
  for (const auto& sh : shards) {
    m["shards"].push_back({{"path", sh.name}, {"samples", sh.samples}, {"bytes", sh.bytes}, {"xxh3", hex64(sh.xxh3)}, {"plan", hex64(sh.plan_hash)}});
    sums += hex64(sh.xxh3);
    total += sh.samples;
    bytes += sh.bytes;
  }
  m["samples"] = total;
  m["bytes"] = bytes;
  m["fields"] = fields;
  m["version"] = hex64(XXH3_64bits(sums.data(), sums.size()));
  const std::string text = m.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  const bool manifest_changed = text != old_text;
  if (manifest_changed) unwrap(write_file_atomic(manifest_path.string(), text));

  json j = {{"schema", "pacer.shard.pack/1"}, {"src", a.src}, {"out", a.out}, {"manifest", manifest_path.string()},
            {"version", m["version"]}, {"samples", total}, {"bytes", bytes}, {"written", todo.size()},
            {"up_to_date", shards.size() - todo.size()}, {"removed", removed}, {"manifest_changed", manifest_changed},
            {"shards", json::array()}};
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"XXH3"}, {"STATUS"}});
  for (const auto& sh : shards) {
    j["shards"].push_back({{"path", sh.name}, {"samples", sh.samples}, {"bytes", sh.bytes}, {"xxh3", hex64(sh.xxh3)}, {"status", sh.status}});
    t.add_row({sh.name, std::to_string(sh.samples), format_bytes(double(sh.bytes)), hex64(sh.xxh3), sh.status});
  }
  std::string text_out = t.render();
  for (const auto& r : removed) text_out += fmt::format("removed {} (beyond this plan)\n", r);
  text_out += fmt::format("OK: {} shard(s), {} samples, {} in {} ({} written, {} up to date)\n", shards.size(), total,
                          format_bytes(double(bytes)), a.out, todo.size(), shards.size() - todo.size());
  print(j, a.json, text_out);
  return 0;
}

// ---------------------------------------------------------------------------

std::vector<std::string> expand(const std::string& spec) {
  auto shards = data::expand_shard_spec(spec);
  if (!shards) {
    const Error& e = shards.error();
    throw Exception(Error{e.kind == ErrorKind::kIo ? ErrorKind::kUsage : e.kind, e.message});
  }
  for (const auto& s : *shards) {
    std::error_code ec;
    if (!fs::is_regular_file(s, ec)) usage(fmt::format("{}: no such shard", s));
  }
  return *shards;
}

int index(const ShardArgs& a) {
  json j = {{"schema", "pacer.shard.index/1"}, {"shards", json::array()}};
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"INDEX"}});
  for (const auto& s : a.shards) {
    std::error_code ec;
    if (!fs::is_regular_file(s, ec)) usage(fmt::format("{}: no such shard", s));
  }
  Progress progress;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < a.shards.size(); ++i) {
    const auto& s = a.shards[i];
    progress.update(fmt::format("[{}/{}] {}", i + 1, a.shards.size(), s));
    const auto idx = unwrap(data::build_index(s));
    total += idx.samples;
    j["shards"].push_back({{"path", s}, {"samples", idx.samples}, {"bytes", idx.shard_bytes}, {"index", data::index_path(s)}});
    t.add_row({s, std::to_string(idx.samples), format_bytes(double(idx.shard_bytes)), data::index_path(s)});
  }
  progress.clear();
  j["samples"] = total;
  print(j, a.json, t.render() + fmt::format("OK: {} shard(s) indexed, {} samples\n", a.shards.size(), total));
  return 0;
}

// The entries of a shard without writing anything: its index when that is
// present and fits, else a scan.
Expected<std::vector<data::SampleEntry>> entries_of(const std::string& shard) {
  if (fs::exists(data::index_path(shard)))
    if (auto idx = data::read_index(shard, false)) return std::move(idx->entries);
  auto members = data::scan_tar(shard);
  if (!members) return members.error();
  return data::group_samples(*members);
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

int inspect(const ShardArgs& a) {
  const auto shards = expand(a.spec);
  json j = {{"schema", "pacer.shard.inspect/1"}, {"spec", a.spec}, {"shards", json::array()}};
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"FIELDS"}, {"FIRST KEY", false, 40}, {"LAST KEY", false, 40}});
  std::map<std::string, std::uint64_t> all_fields;
  std::vector<std::string> first_keys;
  std::uint64_t total = 0, bytes = 0;
  Progress progress;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    progress.update(fmt::format("[{}/{}] {}", i + 1, shards.size(), s));
    auto entries = entries_of(s);
    if (!entries) throw Exception(entries.error());
    std::map<std::string, std::uint64_t> fields;
    for (const auto& e : *entries) {
      for (const auto& f : e.fields) ++fields[f.ext];
      if (first_keys.size() < 5) first_keys.push_back(e.key);
    }
    for (const auto& [k, v] : fields) all_fields[k] += v;
    const std::uint64_t size = fs::file_size(s);
    total += entries->size();
    bytes += size;
    std::vector<std::string> names;
    for (const auto& [k, v] : fields) names.push_back(k);
    const std::string first = entries->empty() ? "" : entries->front().key;
    const std::string last = entries->empty() ? "" : entries->back().key;
    j["shards"].push_back({{"path", s}, {"samples", entries->size()}, {"bytes", size}, {"fields", fields}, {"first_key", first}, {"last_key", last}});
    t.add_row({s, std::to_string(entries->size()), format_bytes(double(size)), join(names, ","), first, last});
  }
  progress.clear();
  j["samples"] = total;
  j["bytes"] = bytes;
  j["fields"] = all_fields;
  j["first_keys"] = first_keys;
  std::vector<std::string> fs_text;
  for (const auto& [k, v] : all_fields) fs_text.push_back(fmt::format("{} ({})", k.empty() ? "(none)" : k, v));
  std::string text = t.render();
  text += fmt::format("{} shard(s), {} samples, {}\n", shards.size(), total, format_bytes(double(bytes)));
  text += "fields: " + join(fs_text, ", ") + "\n";
  text += "first keys: " + join(first_keys, ", ") + "\n";
  print(j, a.json, text);
  return 0;
}

// Where a shard's index and a fresh scan disagree, or "".
std::string compare_index(const std::string& shard, const std::vector<data::SampleEntry>& scanned) {
  if (!fs::exists(data::index_path(shard))) return fmt::format("no index {} (build it with pacer shard index)", data::index_path(shard));
  auto idx = data::read_index(shard, false);
  if (!idx) return "index: " + idx.error().message;
  const auto& got = idx->entries;
  if (idx->samples != scanned.size() || got.size() != scanned.size())
    return fmt::format("index lists {} samples, the shard holds {}", idx->samples, scanned.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const auto& x = got[i];
    const auto& y = scanned[i];
    if (x.key != y.key) return fmt::format("index differs at sample {}: key '{}' in the index, '{}' in the shard", i, x.key, y.key);
    if (x.fields.size() != y.fields.size())
      return fmt::format("index differs at sample {} ('{}'): {} fields in the index, {} in the shard", i, y.key, x.fields.size(), y.fields.size());
    for (std::size_t k = 0; k < x.fields.size(); ++k) {
      const auto& f = x.fields[k];
      const auto& g = y.fields[k];
      if (f.ext != g.ext || f.offset != g.offset || f.size != g.size)
        return fmt::format("index differs at sample {} ('{}'): field '{}' at {}+{} in the index, '{}' at {}+{} in the shard", i, y.key, f.ext,
                           f.offset, f.size, g.ext, g.offset, g.size);
    }
  }
  return "";
}

int verify(const ShardArgs& a) {
  const bool is_manifest = a.spec.size() > 5 && a.spec.ends_with(".json");
  std::error_code ec;
  if (!fs::exists(a.spec, ec) && (is_manifest || a.spec.find_first_of("{*?[") == std::string::npos))
    usage(fmt::format("{}: no such file", a.spec));
  struct Expect {
    std::string path;
    std::optional<std::uint64_t> samples, bytes;
    std::string xxh3;
  };
  std::vector<Expect> shards;
  std::vector<std::string> manifest_problems;
  if (is_manifest) {
    const auto text = read_file(a.spec);
    if (!text) usage(text.error().message);
    const json m = json::parse(*text, nullptr, false);
    if (m.is_discarded() || m.value("schema", "") != "pacer.shards/1" || !m.contains("shards") || !m["shards"].is_array())
      usage(fmt::format("{}: not a pacer shard manifest (schema pacer.shards/1)", a.spec));
    const fs::path dir = fs::path(a.spec).parent_path();
    std::string sums;
    std::uint64_t total = 0;
    for (const auto& s : m["shards"]) {
      if (!s.is_object() || !s.contains("path") || !s["path"].is_string()) usage(fmt::format("{}: a shard entry without a path", a.spec));
      Expect e;
      const std::string rel = s["path"].get<std::string>();
      if (!safe_name(rel)) usage(fmt::format("{}: shard path '{}' is absolute or contains '..'", a.spec, rel));
      e.path = (dir / rel).string();
      if (s.contains("samples") && s["samples"].is_number_unsigned()) e.samples = s["samples"].get<std::uint64_t>();
      if (s.contains("bytes") && s["bytes"].is_number_unsigned()) e.bytes = s["bytes"].get<std::uint64_t>();
      e.xxh3 = s.value("xxh3", "");
      sums += e.xxh3;
      total += e.samples.value_or(0);
      shards.push_back(std::move(e));
    }
    const std::string version = hex64(XXH3_64bits(sums.data(), sums.size()));
    if (m.value("version", "") != version)
      manifest_problems.push_back(fmt::format("manifest version {} does not match its shard checksums ({})", m.value("version", ""), version));
    if (m.contains("samples") && m["samples"].is_number() && m["samples"].get<std::uint64_t>() != total)
      manifest_problems.push_back(fmt::format("manifest says {} samples, its shards {}", m["samples"].get<std::uint64_t>(), total));
  } else {
    for (auto& s : expand(a.spec)) shards.push_back({s, {}, {}, ""});
  }

  json j = {{"schema", "pacer.shard.verify/1"}, {"spec", a.spec}, {"manifest", is_manifest}, {"shards", json::array()}};
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"STATUS"}});
  std::vector<std::string> failures;
  std::uint64_t total = 0;
  Progress progress;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& e = shards[i];
    progress.update(fmt::format("[{}/{}] {}", i + 1, shards.size(), e.path));
    std::string problem;
    std::uint64_t size = 0, samples = 0;
    std::string hash;
    if (!fs::is_regular_file(e.path, ec)) {
      problem = "missing";
    } else {
      size = fs::file_size(e.path, ec);
      if (e.bytes && *e.bytes != size) problem = fmt::format("size {} bytes, the manifest says {}", size, *e.bytes);
      if (problem.empty() && !e.xxh3.empty()) {
        auto h = hash_file(e.path);
        if (!h) problem = h.error().message;
        else if ((hash = hex64(*h)) != e.xxh3) problem = fmt::format("xxh3 {} does not match the manifest's {} (the shard's bytes changed)", hash, e.xxh3);
      }
      if (problem.empty()) {
        auto members = data::scan_tar(e.path);
        if (!members) problem = members.error().message;
        else {
          const auto scanned = data::group_samples(*members);
          samples = scanned.size();
          if (e.samples && *e.samples != samples) problem = fmt::format("{} samples, the manifest says {}", samples, *e.samples);
          else problem = compare_index(e.path, scanned);
        }
      }
    }
    total += samples;
    const bool ok = problem.empty();
    json row = {{"path", e.path}, {"samples", samples}, {"bytes", size}, {"ok", ok}, {"problem", problem}};
    if (!hash.empty()) row["xxh3"] = hash;
    j["shards"].push_back(row);
    t.add_row({e.path, std::to_string(samples), format_bytes(double(size)), ok ? "ok" : "BAD"});
    if (!ok) failures.push_back(fmt::format("{}: {}", e.path, problem));
  }
  progress.clear();
  for (const auto& p : manifest_problems) failures.push_back(fmt::format("{}: {}", a.spec, p));
  const bool bad = !failures.empty();
  j["manifest_problems"] = manifest_problems;
  j["samples"] = total;
  j["verdict"] = bad ? "fail" : "pass";
  std::string text = t.render();
  for (const auto& f : failures) text += "FAILED: " + f + "\n";
  if (bad) text += fmt::format("FAILED: {} problem(s) in {} shard(s) of {}\n", failures.size(), shards.size(), a.spec);
  else text += fmt::format("OK: {} shard(s), {} samples verified in {}\n", shards.size(), total, a.spec);
  print(j, a.json, text);
  if (bad && !a.json)
    for (const auto& f : failures) std::fprintf(stderr, "pacer: %s\n", f.c_str());
  return bad ? 1 : 0;
}

}  // namespace

Handler register_shard(CLI::App& app) {
  auto args = std::make_shared<ShardArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("shard", "Pack, index, inspect and verify data shards");
  cmd->require_subcommand(1);
  cmd->footer(
      "SPEC: a shard, a brace range (train-{000000..000099}.tar), a glob or a manifest.json.\n"
      "Exit codes: 0 ok, 1 a shard failed verification, 2 usage error or malformed input, 3 runtime error. See docs/data.md.");
  auto bind = [&](CLI::App* sub, int (*fn)(const ShardArgs&)) {
    sub->add_flag("--json", args->json, "Machine-readable output");
    sub->callback([args, handler, fn] { *handler = [args, fn] { return fn(*args); }; });
  };

  CLI::App* p = cmd->add_subcommand("pack", "Pack a directory of files (grouped by key) or a JSONL/text file into tar shards");
  p->add_option("src", args->src, "Directory of samples (files sharing a name before the first '.') or a .jsonl/text file")->required();
  p->add_option("out", args->out, "Output directory for the shards, their indexes and manifest.json")->required();
  p->add_option("--target-size", args->target_size, "Approximate shard size, e.g. 256MB (a sample is never split)")->capture_default_str();
  p->add_option("--prefix", args->prefix, "Shard file name prefix: PREFIX-000000.tar")->capture_default_str();
  p->add_option("--jobs", args->jobs, "Shards written in parallel")->capture_default_str();
  bind(p, pack);

  CLI::App* ix = cmd->add_subcommand("index", "(Re)build the .pidx index of each shard");
  ix->add_option("shards", args->shards, "Shard files")->required();
  bind(ix, index);

  CLI::App* in = cmd->add_subcommand("inspect", "Shards, samples, sizes, fields and first keys");
  in->add_option("spec", args->spec, "Shards: a path, brace range, glob or manifest.json")->required();
  bind(in, inspect);

  CLI::App* v = cmd->add_subcommand("verify", "Check checksums (manifest) and that each index matches a fresh scan; exit 1 naming the bad shard");
  v->add_option("spec", args->spec, "A manifest.json, or shards: a path, brace range or glob")->required();
  bind(v, verify);

  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
