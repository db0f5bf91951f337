// Shard sets: packing sources into tar shards (plan, resume, write, manifest), inspecting and verifying them.
//
// Every shard is a pure function of its content plan (member names, sizes,
// source mtimes, bytes): that is what lets a rerun keep the shards whose
// header blocks match the plan, and --jobs N give the bytes of --jobs 1.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/data.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::size_t kIoChunk = 4u << 20;
constexpr const char* kManifestSchema = "pacer.shards/1";

Error usage_error(std::string message) { return Error{ErrorKind::kUsage, std::move(message)}; }

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

// The manifest's version: two shard sets with the same bytes have the same one.
std::string version_of(const std::string& concatenated_sums) {
  return hex64(XXH3_64bits(concatenated_sums.data(), concatenated_sums.size()));
}

Expected<std::uint64_t> hash_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return io_error("cannot open", path, errno);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(st.get());
  std::string buf(kIoChunk, '\0');
  for (;;) {
    auto n = read_full(fd.get(), buf.data(), buf.size(), path);
    if (!n) return n.error();
    XXH3_64bits_update(st.get(), buf.data(), *n);
    if (*n < buf.size()) break;
  }
  return static_cast<std::uint64_t>(XXH3_64bits_digest(st.get()));
}

// ---------------------------------------------------------------------------
// The pack plan

struct Member {
  std::string name;           // in the archive
  std::uint32_t key_len = 0;  // name[0, key_len) is the sample key
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
  std::vector<Member> members;             // in archive order
  std::vector<std::size_t> sample_starts;  // first member of each sample
  std::string source_of(const Member& m) const { return is_dir ? (fs::path(path) / m.name).string() : path; }
};

struct ShardPlan {
  std::size_t index = 0;
  std::string name;  // file name in OUT
  std::size_t first_member = 0, end_member = 0;
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;      // whole file, end blocks included
  std::uint64_t plan_hash = 0;  // of every header block, in order, and the size
  // Results.
  bool written = false;
  std::uint64_t xxh3 = 0;
};

std::uint32_t key_length(const std::string& name) {
  const std::size_t slash = name.rfind('/');
  const std::size_t base = slash == std::string::npos ? 0 : slash + 1;
  const std::size_t dot = name.find('.', base);
  return static_cast<std::uint32_t>(dot == std::string::npos ? name.size() : dot);
}

Status scan_directory(Source& src, const std::optional<fs::path>& skip) {
  std::error_code ec;
  fs::recursive_directory_iterator it(src.path, fs::directory_options::none, ec), end;
  if (ec) return usage_error(fmt::format("{}: {}", src.path, ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", src.path, ec.message())};
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
    if (::stat(p.c_str(), &st) != 0) return io_error("cannot stat", p.string(), errno);
    Member m;
    m.name = p.lexically_relative(src.path).generic_string();
    if (escapes_root(m.name)) return usage_error(fmt::format("{}: member name '{}' is absolute or contains '..'", src.path, m.name));
    m.key_len = key_length(m.name);
    m.size = static_cast<std::uint64_t>(st.st_size);
    m.mtime = st.st_mtime;
    src.members.push_back(std::move(m));
  }
  std::sort(src.members.begin(), src.members.end(), [](const Member& a, const Member& b) {
    if (a.key() != b.key()) return a.key() < b.key();
    return a.ext() < b.ext();
  });
  return {};
}

// Line mode. Blank lines are not samples but keep their numbers, so a key
// still points at its line in the source.
Status scan_lines(Source& src) {
  const std::string ext = (src.path.ends_with(".jsonl") || src.path.ends_with(".ndjson")) ? "json" : "txt";
  Fd fd(::open(src.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return usage_error(fmt::format("{}: cannot open: {}", src.path, std::strerror(errno)));
  struct stat st {};
  ::fstat(fd.get(), &st);
  struct Line {
    std::uint64_t number, offset, size;
  };
  std::vector<Line> lines;
  std::string buf(kIoChunk, '\0');
  std::string line;  // the current line, for JSON validation
  std::uint64_t off = 0, line_start = 0, number = 1;
  auto finish = [&](std::uint64_t line_end) -> Status {
    std::uint64_t size = line_end - line_start;
    if (!line.empty() && line.back() == '\r') {
      line.pop_back();
      --size;
    }
    const bool blank = line.find_first_not_of(" \t") == std::string::npos;
    if (!(blank && (ext == "json" || line.empty()))) {
      if (ext == "json" && !json::accept(line)) return Error{ErrorKind::kConfig, fmt::format("{}:{}: not a JSON value", src.path, number)};
      lines.push_back({number, line_start, size});
    }
    line.clear();
    ++number;
    return {};
  };
  for (;;) {
    const ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf.data(), buf.size()); });
    if (n < 0) return io_error("read failed", src.path, errno);
    if (n == 0) break;
    std::size_t pos = 0;
    while (pos < static_cast<std::size_t>(n)) {
      const void* nl = std::memchr(buf.data() + pos, '\n', static_cast<std::size_t>(n) - pos);
      const std::size_t stop = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - buf.data()) : static_cast<std::size_t>(n);
      line.append(buf.data() + pos, stop - pos);
      if (nl) {
        if (Status s = finish(off + stop); !s) return s;
        line_start = off + stop + 1;
        pos = stop + 1;
      } else {
        pos = stop;
      }
    }
    off += static_cast<std::uint64_t>(n);
  }
  if (off > line_start)
    if (Status s = finish(off); !s) return s;
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
  return {};
}

std::string shard_name(const std::string& prefix, std::size_t i) { return fmt::format("{}-{:06d}.tar", prefix, i); }
std::string temp_name(const std::string& name) { return "." + name + ".partial"; }

// Greedy: a shard takes whole samples until the next would push it past the target.
std::vector<ShardPlan> plan_shards(Source& src, const std::string& prefix, std::uint64_t target) {
  for (auto& m : src.members) m.header_bytes = tar_member_headers(m.name, m.size, m.mtime).size();
  for (std::size_t i = 0; i < src.members.size(); ++i)
    if (i == 0 || src.members[i].key() != src.members[i - 1].key()) src.sample_starts.push_back(i);
  std::vector<ShardPlan> shards;
  ShardPlan cur;
  auto close = [&] {
    cur.index = shards.size();
    cur.name = shard_name(prefix, cur.index);
    cur.bytes += 2 * kTarBlock;
    shards.push_back(cur);
  };
  for (std::size_t s = 0; s < src.sample_starts.size(); ++s) {
    const std::size_t lo = src.sample_starts[s];
    const std::size_t hi = s + 1 < src.sample_starts.size() ? src.sample_starts[s + 1] : src.members.size();
    std::uint64_t bytes = 0;
    for (std::size_t i = lo; i < hi; ++i) bytes += src.members[i].header_bytes + tar_padded(src.members[i].size);
    if (cur.samples > 0 && cur.bytes + bytes + 2 * kTarBlock > target) {
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
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
    XXH3_64bits_reset(st.get());
    for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
      const auto& m = src.members[i];
      const std::string h = tar_member_headers(m.name, m.size, m.mtime);
      XXH3_64bits_update(st.get(), h.data(), h.size());
    }
    XXH3_64bits_update(st.get(), &sh.bytes, sizeof(sh.bytes));
    sh.plan_hash = XXH3_64bits_digest(st.get());
  }
  return shards;
}

// A shard on disk is complete for this plan when it has the planned size, the
// planned header blocks at the planned offsets and the two zero end blocks.
// Data bytes are not compared: reading them would cost as much as rewriting.
bool shard_matches(const Source& src, const ShardPlan& sh, const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return false;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != sh.bytes) return false;
  std::uint64_t off = 0;
  std::string got;
  for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
    const auto& m = src.members[i];
    const std::string want = tar_member_headers(m.name, m.size, m.mtime);
    got.resize(want.size());
    if (!pread_exact(fd.get(), got.data(), got.size(), off, path) || got != want) return false;
    off += want.size() + tar_padded(m.size);
  }
  got.resize(2 * kTarBlock);
  if (!pread_exact(fd.get(), got.data(), got.size(), off, path)) return false;
  return std::all_of(got.begin(), got.end(), [](char c) { return c == 0; });
}

// Writes one shard to its temporary name, fsyncs it and renames it into place,
// so a reader (or a rerun) never takes a partial shard for a finished one.
// `progress` counts bytes written. On `cancel` it stops, leaving no temporary.
Status write_shard(const Source& src, ShardPlan& sh, const fs::path& out, std::atomic<std::uint64_t>& progress,
                   const std::atomic<bool>& cancel) {
  const std::string tmp = (out / temp_name(sh.name)).string();
  const std::string final_path = (out / sh.name).string();
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) return io_error("cannot create", tmp, errno);
  auto fail = [&](Error e) {
    ::unlink(tmp.c_str());
    return e;
  };
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hs(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(hs.get());
  std::string buf;
  buf.reserve(kIoChunk + kTarBlock);
  std::uint64_t written = 0;
  auto flush = [&]() -> Status {
    if (buf.empty()) return {};
    if (Status w = write_full(fd.get(), buf.data(), buf.size(), tmp); !w) return fail(w.error());
    XXH3_64bits_update(hs.get(), buf.data(), buf.size());
    written += buf.size();
    progress += buf.size();
    buf.clear();
    return {};
  };
  Fd line_src;  // the source file, in line mode
  if (!src.is_dir) {
    line_src = Fd(::open(src.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!line_src) return io_error("cannot open", src.path, errno);
  }
  for (std::size_t i = sh.first_member; i < sh.end_member; ++i) {
    if (cancel) {
      ::unlink(tmp.c_str());
      return {};
    }
    const Member& m = src.members[i];
    buf += tar_member_headers(m.name, m.size, m.mtime);
    Fd own;
    int in = line_src.get();
    const std::string from = src.source_of(m);
    if (src.is_dir) {
      own = Fd(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
      if (!own) return io_error("cannot open", from, errno);
      in = own.get();
    }
    std::uint64_t left = m.size, at = m.src_offset;
    while (left > 0) {
      if (buf.size() >= kIoChunk)
        if (Status s = flush(); !s) return s;
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(left, kIoChunk + kTarBlock - buf.size()));
      const std::size_t old = buf.size();
      buf.resize(old + want);
      auto n = pread_full(in, buf.data() + old, want, at, from);
      if (!n) return fail(n.error());
      if (*n != want) return fail(Error{ErrorKind::kIo, fmt::format("{}: changed size while packing (planned {} bytes)", from, m.size)});
      left -= want;
      at += want;
    }
    if (src.is_dir) {
      // A file that grew since planning would be cut silently: refuse it.
      struct stat st {};
      if (::fstat(in, &st) == 0 && static_cast<std::uint64_t>(st.st_size) != m.size)
        return fail(Error{ErrorKind::kIo, fmt::format("{}: changed size while packing ({} bytes planned, {} now)", from, m.size, st.st_size)});
    }
    buf.append(tar_padded(m.size) - m.size, '\0');
  }
  buf.append(2 * kTarBlock, '\0');
  if (Status s = flush(); !s) return s;
  if (written != sh.bytes) return fail(Error{ErrorKind::kRuntime, fmt::format("{}: wrote {} bytes, planned {}", tmp, written, sh.bytes)});
  if (Status f = fsync_fd(fd.get(), tmp); !f) return fail(f.error());
  if (Status c = fd.close(tmp); !c) return fail(c.error());
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) return fail(io_error("rename failed", final_path, errno));
  sh.xxh3 = XXH3_64bits_digest(hs.get());
  sh.written = true;
  return {};
}

// Writes the shard and its index, and checks the index against the plan.
Status write_and_index(const Source& src, ShardPlan& sh, const fs::path& out, std::atomic<std::uint64_t>& progress,
                       const std::atomic<bool>& cancel) {
  if (Status s = write_shard(src, sh, out, progress, cancel); !s || cancel) return s;
  auto idx = build_index((out / sh.name).string());
  if (!idx) return idx.error();
  if (idx->samples != sh.samples)
    return Error{ErrorKind::kRuntime, fmt::format("{}: indexed {} samples, planned {}", sh.name, idx->samples, sh.samples)};
  return {};
}


// Shard numbers are at least six digits; a run that planned more shards
// leaves higher numbers behind.
bool beyond_plan(const std::string& file, const std::string& prefix, std::size_t planned) {
  if (!file.starts_with(prefix + "-") || !(file.ends_with(".tar") || file.ends_with(".tar.pidx"))) return false;
  const std::string num = file.substr(prefix.size() + 1, file.find(".tar", prefix.size() + 1) - prefix.size() - 1);
  if (num.size() < 6 || !std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  std::uint64_t n = 0;
  // Too many digits for 64 bits is beyond any plan too.
  return std::from_chars(num.data(), num.data() + num.size(), n).ec != std::errc() || n >= planned;
}

// Deletes this prefix's temporaries of an interrupted run and its shards
// beyond the plan; returns the names of the latter.
std::vector<std::string> remove_leftovers(const fs::path& out, const std::string& prefix, std::size_t planned) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    const bool tmp = n.starts_with("." + prefix + "-") && n.ends_with(".tar.partial");
    const bool extra = beyond_plan(n, prefix, planned);
    if (tmp || extra) {
      fs::remove(e.path(), ec);
      if (extra) removed.push_back(n);
    }
  }
  return removed;
}

// Shard name -> (plan hash, xxh3) from a previous manifest: a shard whose plan
// is unchanged keeps its checksum without being read again.
std::map<std::string, std::pair<std::uint64_t, std::string>> previous_checksums(const std::string& manifest_text) {
  std::map<std::string, std::pair<std::uint64_t, std::string>> old;
  json j = json::parse(manifest_text, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.value("schema", json()) == kManifestSchema && j.contains("shards") && j["shards"].is_array())
    for (const auto& s : j["shards"])
      if (s.is_object() && s.contains("path") && s.contains("plan") && s.contains("xxh3") && s["path"].is_string() && s["plan"].is_string() &&
          s["xxh3"].is_string())
        old[s.value("path", "")] = {std::strtoull(s["plan"].get<std::string>().c_str(), nullptr, 16), s.value("xxh3", "")};
  return old;
}

// Writes the shards in `todo` with `jobs` threads; the first error cancels the rest.
Status write_shards(const Source& src, std::vector<ShardPlan>& shards, const std::vector<std::size_t>& todo, const fs::path& out, int jobs,
                    const std::function<void(const PackProgress&)>& on_progress) {
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
      Status st;
      try {
        st = write_and_index(src, sh, out, progress_bytes, cancel);
      } catch (const std::exception& e) {  // a filesystem_error or bad_alloc must not end the process from a thread
        st = Error{ErrorKind::kRuntime, e.what()};
      }
      if (!st) {
        ::unlink((out / temp_name(sh.name)).c_str());
        std::lock_guard g(err_mu);
        if (!first_error) first_error = st.error();
        cancel = true;
        return;
      }
      if (cancel) return;
      ++done;
    }
  };
  std::vector<std::thread> threads;
  // Joined however this function is left, a throwing on_progress included.
  struct Join {
    std::vector<std::thread>& threads;
    std::atomic<bool>& cancel;
    ~Join() {
      for (auto& t : threads)
        if (t.joinable()) {
          cancel = true;
          t.join();
        }
    }
  } join{threads, cancel};
  const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(jobs), std::max<std::size_t>(todo.size(), 1)));
  for (int i = 0; i < n; ++i) threads.emplace_back(worker);
  const auto t0 = std::chrono::steady_clock::now();
  while (!todo.empty()) {
    if (on_progress) {
      PackProgress p;
      p.shards_done = done.load();
      p.shards_total = todo.size();
      p.bytes_done = progress_bytes.load();
      p.bytes_total = todo_bytes;
      p.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      on_progress(p);
    }
    if (done >= todo.size() || cancel) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& t : threads) t.join();
  if (first_error) return *first_error;
  return {};
}

}  // namespace

Expected<std::uint64_t> file_xxh3(const std::string& path) { return hash_file(path); }

std::size_t PackReport::written() const {
  return static_cast<std::size_t>(std::count_if(shards.begin(), shards.end(), [](const PackedShard& s) { return s.written; }));
}

Expected<PackReport> pack_shards(const PackOptions& o, const std::function<void(const PackProgress&)>& on_progress) {
  if (o.jobs < 1) return usage_error("jobs must be at least 1");
  if (o.target_bytes == 0) return usage_error("target size must be positive");
  if (o.prefix.empty() || o.prefix.find('/') != std::string::npos || o.prefix.find('\0') != std::string::npos || o.prefix[0] == '.')
    return usage_error(fmt::format("prefix '{}': expected a plain file name prefix (no '/', not starting with '.')", o.prefix));
  std::error_code ec;
  if (!fs::exists(o.src, ec)) return usage_error(fmt::format("{}: no such file or directory", o.src));
  if (fs::exists(o.out, ec) && !fs::is_directory(o.out, ec)) return usage_error(fmt::format("{}: not a directory", o.out));

  Source src;
  src.path = o.src;
  src.is_dir = fs::is_directory(o.src, ec);
  if (src.is_dir) {
    std::optional<fs::path> skip;
    if (fs::exists(o.out, ec)) skip = fs::path(o.out);
    if (Status s = scan_directory(src, skip); !s) return s.error();
  } else if (Status s = scan_lines(src); !s) {
    return s.error();
  }
  if (src.members.empty()) return usage_error(fmt::format("{}: no samples to pack", o.src));
  std::vector<ShardPlan> shards = plan_shards(src, o.prefix, o.target_bytes);

  const fs::path out(o.out);
  fs::create_directories(out, ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: cannot create: {}", o.out, ec.message())};
  Fd lock(::open(out.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!lock || ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) return Error{ErrorKind::kIo, fmt::format("{}: another pacer shard pack is writing here", o.out)};

  PackReport r;
  r.src = o.src;
  r.out = o.out;
  r.removed = remove_leftovers(out, o.prefix, shards.size());

  const fs::path manifest_path = out / "manifest.json";
  std::string old_text;
  if (auto text = read_file(manifest_path.string())) old_text = *text;
  const auto old = previous_checksums(old_text);

  std::vector<std::size_t> todo;
  for (auto& sh : shards) {
    const std::string path = (out / sh.name).string();
    if (!shard_matches(src, sh, path)) {
      todo.push_back(sh.index);
      continue;
    }
    auto it = old.find(sh.name);
    if (it != old.end() && it->second.first == sh.plan_hash && it->second.second.size() == 16) {
      sh.xxh3 = std::strtoull(it->second.second.c_str(), nullptr, 16);
    } else {
      auto h = hash_file(path);
      if (!h) return h.error();
      sh.xxh3 = *h;
    }
    // The index, SHARD.pidx: kept when it is there and fits, rebuilt otherwise.
    std::error_code iec;
    auto idx = fs::exists(index_path(path), iec) ? read_index(path, true) : Expected<ShardIndex>(Error{ErrorKind::kIo, "no index"});
    if (!idx || idx->samples != sh.samples)
      if (auto built = build_index(path); !built) return built.error();
  }
  if (Status s = write_shards(src, shards, todo, out, o.jobs, on_progress); !s) return s.error();
  (void)fsync_dir(out.string());

  // Rewritten only when something changed, so that a no-op rerun leaves it (and its mtime) alone.
  json m = {{"schema", kManifestSchema}, {"prefix", o.prefix}, {"target_size", o.target_bytes}, {"shards", json::array()}};
  std::string sums;
  std::map<std::string, std::uint64_t> fields;
  for (const auto& mem : src.members) ++fields[std::string(mem.ext())];
  for (const auto& sh : shards) {
    m["shards"].push_back({{"path", sh.name}, {"samples", sh.samples}, {"bytes", sh.bytes}, {"xxh3", hex64(sh.xxh3)}, {"plan", hex64(sh.plan_hash)}});
    sums += hex64(sh.xxh3);
    r.samples += sh.samples;
    r.bytes += sh.bytes;
    r.shards.push_back({sh.name, sh.samples, sh.bytes, sh.xxh3, sh.written});
  }
  r.version = version_of(sums);
  m["samples"] = r.samples;
  m["bytes"] = r.bytes;
  m["fields"] = fields;
  m["version"] = r.version;
  const std::string text = m.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  r.manifest = manifest_path.string();
  r.manifest_changed = text != old_text;
  if (r.manifest_changed)
    if (Status s = write_file_atomic(r.manifest, text); !s) return s.error();
  return r;
}

json to_json(const PackReport& r) {
  json j = {{"schema", "pacer.shard.pack/1"}, {"src", r.src}, {"out", r.out}, {"manifest", r.manifest}, {"version", r.version},
            {"samples", r.samples}, {"bytes", r.bytes}, {"written", r.written()}, {"up_to_date", r.up_to_date()},
            {"removed", r.removed}, {"manifest_changed", r.manifest_changed}, {"shards", json::array()}};
  for (const auto& sh : r.shards)
    j["shards"].push_back({{"path", sh.path}, {"samples", sh.samples}, {"bytes", sh.bytes}, {"xxh3", hex64(sh.xxh3)},
                           {"status", sh.written ? "written" : "up to date"}});
  return j;
}

// ---------------------------------------------------------------------------
// Inspect and verify

namespace {

// A spec's shards, each an existing file. A spec that names nothing is the
// caller's mistake (kUsage), not the environment's.
Expected<std::vector<std::string>> existing_shards(const std::string& spec) {
  auto shards = expand_shard_spec(spec);
  if (!shards) {
    const Error& e = shards.error();
    return Error{e.kind == ErrorKind::kIo ? ErrorKind::kUsage : e.kind, e.message};
  }
  for (const auto& s : *shards) {
    std::error_code ec;
    if (!fs::is_regular_file(s, ec)) return usage_error(fmt::format("{}: no such shard", s));
  }
  return shards;
}

// The entries of a shard without writing anything: its index when that is
// present and fits, else a scan.
Expected<std::vector<SampleEntry>> entries_of(const std::string& shard) {
  if (auto has = has_index(shard); has && *has)
    if (auto idx = read_index(shard, false)) return std::move(idx->entries);
  auto members = scan_tar(shard);
  if (!members) return members.error();
  return group_samples(shard, *members);
}

// Where a shard's index and a fresh scan disagree, or "". A missing index is
// no finding: readers build one (in memory when the dataset is read-only).
std::string compare_index(const std::string& shard, const std::vector<SampleEntry>& scanned) {
  auto idx = read_index(shard, false);
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

// What the manifest promises about one shard; nothing for a bare spec.
struct Expect {
  std::string path;
  std::optional<std::uint64_t> samples, bytes;
  std::string xxh3;
};

// Reads a manifest's shard list (paths resolved against its directory) and
// checks its totals against that list.
Status read_manifest(const std::string& path, std::vector<Expect>& shards, std::vector<std::string>& problems) {
  const auto text = read_file(path);
  if (!text) return usage_error(text.error().message);
  const json m = json::parse(*text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("schema", json()) != kManifestSchema || !m.contains("shards") || !m["shards"].is_array())
    return usage_error(fmt::format("{}: not a pacer shard manifest (schema {})", path, kManifestSchema));
  const fs::path dir = fs::path(path).parent_path();
  std::string sums;
  std::uint64_t total = 0;
  std::unordered_set<std::string> listed;  // each shard once: one listed twice would be read twice per epoch
  for (const auto& s : m["shards"]) {
    if (!s.is_object() || !s.contains("path") || !s["path"].is_string()) return usage_error(fmt::format("{}: a shard entry without a path", path));
    Expect e;
    const std::string rel = s["path"].get<std::string>();
    if (escapes_root(rel)) return usage_error(fmt::format("{}: shard path '{}' is absolute or contains '..'", path, rel));
    if (!listed.insert(fs::path(rel).lexically_normal().string()).second) return usage_error(fmt::format("{}: shard '{}' is listed twice", path, rel));
    e.path = (dir / rel).string();
    if (s.contains("samples") && s["samples"].is_number_unsigned()) e.samples = s["samples"].get<std::uint64_t>();
    if (s.contains("bytes") && s["bytes"].is_number_unsigned()) e.bytes = s["bytes"].get<std::uint64_t>();
    if (s.contains("xxh3") && !s["xxh3"].is_string()) return usage_error(fmt::format("{}: shard '{}': xxh3 is not a string", path, rel));
    e.xxh3 = s.value("xxh3", "");
    sums += e.xxh3;
    total += e.samples.value_or(0);
    shards.push_back(std::move(e));
  }
  const std::string version = version_of(sums);
  if (m.contains("version") && !m["version"].is_string()) return usage_error(fmt::format("{}: version is not a string", path));
  if (m.value("version", "") != version)
    problems.push_back(fmt::format("manifest version {} does not match its shard checksums ({})", m.value("version", ""), version));
  if (m.contains("samples") && !m["samples"].is_number_unsigned()) return usage_error(fmt::format("{}: samples is not a non-negative integer", path));
  if (m.contains("samples") && m["samples"].get<std::uint64_t>() != total)
    problems.push_back(fmt::format("manifest says {} samples, its shards {}", m["samples"].get<std::uint64_t>(), total));
  return {};
}

// Checks one shard: cheap checks first (presence, size), then the checksum,
// then the scan and its index.
VerifiedShard verify_one(const Expect& e) {
  VerifiedShard v;
  v.path = e.path;
  std::error_code ec;
  if (!fs::is_regular_file(e.path, ec)) {
    v.problem = "missing";
    return v;
  }
  v.bytes = fs::file_size(e.path, ec);
  if (e.bytes && *e.bytes != v.bytes) v.problem = fmt::format("size {} bytes, the manifest says {}", v.bytes, *e.bytes);
  if (v.problem.empty() && !e.xxh3.empty()) {
    auto h = hash_file(e.path);
    if (!h) v.problem = h.error().message;
    else if ((v.xxh3 = hex64(*h)) != e.xxh3) v.problem = fmt::format("xxh3 {} does not match the manifest's {} (the shard's bytes changed)", v.xxh3, e.xxh3);
  }
  if (v.problem.empty()) {
    auto members = scan_tar(e.path);
    if (!members) {
      v.problem = members.error().message;
    } else {
      auto scanned = group_samples(e.path, *members);
      if (!scanned) {
        v.problem = scanned.error().message;
      } else {
        v.samples = scanned->size();
        auto has = has_index(e.path);
        v.indexed = has && *has;
        if (e.samples && *e.samples != v.samples) v.problem = fmt::format("{} samples, the manifest says {}", v.samples, *e.samples);
        else if (!has) v.problem = "index: " + has.error().message;  // a directory index readers would refuse
        else if (v.indexed) v.problem = compare_index(e.path, *scanned);
      }
    }
  }
  return v;
}

}  // namespace

Expected<InspectReport> inspect_shards(const std::string& spec, const std::function<void(const ShardStep&)>& on_shard) {
  auto shards = existing_shards(spec);
  if (!shards) return shards.error();
  InspectReport r;
  r.spec = spec;
  for (std::size_t i = 0; i < shards->size(); ++i) {
    const auto& s = (*shards)[i];
    if (on_shard) on_shard({i, shards->size(), s});
    auto entries = entries_of(s);
    if (!entries) return entries.error();
    InspectedShard sh;
    sh.path = s;
    for (const auto& e : *entries) {
      for (const auto& f : e.fields) ++sh.fields[f.ext];
      if (r.first_keys.size() < 5) r.first_keys.push_back(e.key);
    }
    for (const auto& [k, v] : sh.fields) r.fields[k] += v;
    sh.samples = entries->size();
    std::error_code ec;
    sh.bytes = fs::file_size(s, ec);
    if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", s, ec.message())};
    if (!entries->empty()) {
      sh.first_key = entries->front().key;
      sh.last_key = entries->back().key;
    }
    r.samples += sh.samples;
    r.bytes += sh.bytes;
    r.shards.push_back(std::move(sh));
  }
  return r;
}

json to_json(const InspectReport& r) {
  json j = {{"schema", "pacer.shard.inspect/1"}, {"spec", r.spec}, {"shards", json::array()}};
  for (const auto& s : r.shards)
    j["shards"].push_back(
        {{"path", s.path}, {"samples", s.samples}, {"bytes", s.bytes}, {"fields", s.fields}, {"first_key", s.first_key}, {"last_key", s.last_key}});
  j["samples"] = r.samples;
  j["bytes"] = r.bytes;
  j["fields"] = r.fields;
  j["first_keys"] = r.first_keys;
  return j;
}

Expected<VerifyReport> verify_shards(const std::string& spec, const std::function<void(const ShardStep&)>& on_shard) {
  VerifyReport r;
  r.spec = spec;
  r.manifest = spec.size() > 5 && spec.ends_with(".json");
  std::error_code ec;
  if (!fs::exists(spec, ec) && (r.manifest || spec.find_first_of("{*?[") == std::string::npos))
    return usage_error(fmt::format("{}: no such file", spec));
  std::vector<Expect> expected;
  if (r.manifest) {
    if (Status s = read_manifest(spec, expected, r.manifest_problems); !s) return s.error();
  } else {
    auto shards = existing_shards(spec);
    if (!shards) return shards.error();
    for (auto& s : *shards) expected.push_back({s, {}, {}, ""});
  }
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (on_shard) on_shard({i, expected.size(), expected[i].path});
    VerifiedShard v = verify_one(expected[i]);
    r.samples += v.samples;
    if (!v.ok()) r.failures.push_back(fmt::format("{}: {}", v.path, v.problem));
    r.shards.push_back(std::move(v));
  }
  for (const auto& p : r.manifest_problems) r.failures.push_back(fmt::format("{}: {}", spec, p));
  return r;
}

json to_json(const VerifyReport& r) {
  json j = {{"schema", "pacer.shard.verify/1"}, {"spec", r.spec}, {"manifest", r.manifest}, {"shards", json::array()}};
  for (const auto& s : r.shards) {
    json row = {{"path", s.path}, {"samples", s.samples}, {"bytes", s.bytes}, {"ok", s.ok()}, {"problem", s.problem}, {"indexed", s.indexed}};
    if (!s.xxh3.empty()) row["xxh3"] = s.xxh3;
    j["shards"].push_back(row);
  }
  j["manifest_problems"] = r.manifest_problems;
  j["samples"] = r.samples;
  j["verdict"] = r.ok() ? "pass" : "fail";
  return j;
}

}  // namespace pacer::data
