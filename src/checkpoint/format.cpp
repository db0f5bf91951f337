// The on-disk format: manifests, step directories, checksummed reads, listing and retention.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <ctime>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "ckpt_internal.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/core/atomic_file.hpp"

namespace pacer::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::map<std::string, std::size_t>& dtypes() {
  static const std::map<std::string, std::size_t> kTypes = {
      {"bytes", 1},   {"bool", 1},    {"int8", 1},    {"uint8", 1},   {"int16", 2},   {"uint16", 2},
      {"int32", 4},   {"uint32", 4},  {"int64", 8},   {"uint64", 8},  {"float16", 2}, {"bfloat16", 2},
      {"float32", 4}, {"float64", 8}, {"complex64", 8}, {"complex128", 16},
      {"complex32", 4}, {"float8_e4m3fn", 1}, {"float8_e5m2", 1}, {"float8_e4m3fnuz", 1}, {"float8_e5m2fnuz", 1},
      {"float8_e8m0fnu", 1}};
  return kTypes;
}

std::string hex(std::uint64_t v) { return fmt::format("{:016x}", v); }

Expected<std::uint64_t> unhex(const std::string& s) {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || p != s.data() + s.size() || s.size() != 16) return Error{ErrorKind::kConfig, "bad checksum '" + s + "'"};
  return v;
}

json blob_to_json(const BlobInfo& b) {
  json chunks = json::array();
  for (auto h : b.chunk_hashes) chunks.push_back(hex(h));
  json j = {{"name", b.name},   {"rank", b.rank},   {"file", b.file},   {"offset", b.offset},
            {"size", b.size},   {"dtype", b.dtype}, {"shape", b.shape}, {"layout", b.layout == Layout::kShard ? "shard" : "replicated"},
            {"chunks", chunks}};
  if (b.layout == Layout::kShard) {
    j["shard_offset"] = b.shard_offset;
    j["global_size"] = b.global_size;
    j["global_shape"] = b.global_shape;
  }
  return j;
}

}  // namespace

std::size_t dtype_size(const std::string& dtype) {
  auto it = dtypes().find(dtype);
  return it == dtypes().end() ? 0 : it->second;
}
bool valid_dtype(const std::string& dtype) { return dtype_size(dtype) != 0; }

std::string step_dir_name(std::uint64_t step) { return fmt::format("step-{:012d}", step); }

std::optional<std::uint64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() < 6 || name.rfind("step-", 0) != 0) return std::nullopt;
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), v);
  if (ec != std::errc() || p != name.data() + name.size()) return std::nullopt;
  return v;
}

json manifest_body(const Manifest& m) {
  json blobs = json::array();
  for (const auto& b : m.blobs) blobs.push_back(blob_to_json(b));
  json files = json::array();
  for (const auto& [name, size] : m.files) files.push_back({{"name", name}, {"size", size}});
  return {{"schema", kManifestSchema}, {"step", m.step},       {"created_at", m.created_at},
          {"world_size", m.world_size}, {"chunk_bytes", m.chunk_bytes}, {"hash", "xxh3-64"},
          {"files", files},             {"blobs", blobs},      {"meta", m.meta}};
}

json to_json(const Manifest& m) {
  json j = manifest_body(m);
  // The manifest checks itself: a torn or edited manifest is not a commit.
  const std::string body = j.dump();
  j["manifest_xxh3"] = hex(XXH3_64bits(body.data(), body.size()));
  return j;
}

Expected<Manifest> manifest_from_json(const std::string& text, const std::string& source) {
  auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {}", source, why)}; };
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("not valid JSON (torn or partial manifest)");
  if (j.value("schema", "") != kManifestSchema) return bad(fmt::format("not a pacer checkpoint manifest (schema is not {})", kManifestSchema));
  if (!j.contains("manifest_xxh3") || !j["manifest_xxh3"].is_string()) return bad("manifest has no checksum");
  const std::string want = j["manifest_xxh3"].get<std::string>();
  j.erase("manifest_xxh3");
  const std::string body = j.dump();
  if (hex(XXH3_64bits(body.data(), body.size())) != want) return bad("manifest checksum mismatch (edited or corrupt)");
  try {
    Manifest m;
    m.step = j.at("step").get<std::uint64_t>();
    m.created_at = j.at("created_at").get<std::string>();
    m.world_size = j.at("world_size").get<int>();
    m.chunk_bytes = j.at("chunk_bytes").get<std::uint64_t>();
    m.meta = j.at("meta");
    for (const auto& f : j.at("files")) m.files.emplace_back(f.at("name").get<std::string>(), f.at("size").get<std::uint64_t>());
    for (const auto& bj : j.at("blobs")) {
      BlobInfo b;
      b.name = bj.at("name").get<std::string>();
      b.rank = bj.at("rank").get<int>();
      b.file = bj.at("file").get<std::string>();
      b.offset = bj.at("offset").get<std::uint64_t>();
      b.size = bj.at("size").get<std::uint64_t>();
      b.dtype = bj.at("dtype").get<std::string>();
      b.shape = bj.at("shape").get<std::vector<std::int64_t>>();
      b.layout = bj.at("layout").get<std::string>() == "shard" ? Layout::kShard : Layout::kReplicated;
      if (b.layout == Layout::kShard) {
        b.shard_offset = bj.at("shard_offset").get<std::uint64_t>();
        b.global_size = bj.at("global_size").get<std::uint64_t>();
        b.global_shape = bj.at("global_shape").get<std::vector<std::int64_t>>();
      }
      for (const auto& h : bj.at("chunks")) {
        auto v = unhex(h.get<std::string>());
        if (!v) return bad(fmt::format("blob '{}': {}", b.name, v.error().message));
        b.chunk_hashes.push_back(*v);
      }
      const std::uint64_t want_chunks = m.chunk_bytes ? (b.size + m.chunk_bytes - 1) / m.chunk_bytes : 0;
      if (b.chunk_hashes.size() != want_chunks)
        return bad(fmt::format("blob '{}': {} checksums for {} chunks", b.name, b.chunk_hashes.size(), want_chunks));
      m.blobs.push_back(std::move(b));
    }
    if (m.chunk_bytes == 0) return bad("chunk_bytes is 0");
    return m;
  } catch (const json::exception& e) {
    return bad(fmt::format("malformed manifest: {}", e.what()));
  }
}

Expected<Reader> Reader::open(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / kManifestName).string();
  // The shared lock comes first, so that once the manifest is read nobody
  // deletes the step under this reader (deleters take it exclusively, without
  // waiting, and skip a step that is being read). Where the filesystem has no
  // flock (some network filesystems) deletion is not held off.
  const int dfd = ::open(step_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // Out of descriptors (candidates() of a root that keeps thousands of
  // steps): open it unlocked rather than not at all.
  if (dfd < 0 && errno != EMFILE && errno != ENFILE)
    return Error{ErrorKind::kConfig, fmt::format("{}: cannot open: {} (no manifest: not a committed checkpoint)", step_dir, std::strerror(errno))};
  std::shared_ptr<const int> lock;
  if (dfd >= 0) {
    lock.reset(new int(dfd), [](const int* fd) {
      ::close(*fd);
      delete fd;
    });
    while (::flock(dfd, LOCK_SH) != 0 && errno == EINTR) {
    }
    // A deleter that won the lock has renamed the directory away by now, and
    // a new save may have put another directory under the name: read only
    // the directory that is locked.
    struct stat locked {}, named {};
    if (::fstat(dfd, &locked) != 0 || ::stat(step_dir.c_str(), &named) != 0 || locked.st_ino != named.st_ino ||
        locked.st_dev != named.st_dev)
      return Error{ErrorKind::kConfig, fmt::format("{}: removed while being opened (no manifest: not a committed checkpoint)", step_dir)};
  }
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kConfig, text.error().message + " (no manifest: not a committed checkpoint)"};
  auto m = manifest_from_json(*text, path);
  if (!m) return m.error();
  // A checkpoint copied or renamed under another step's name must not pass
  // for that step.
  if (auto named_step = parse_step_dir_name(fs::path(step_dir).filename().string()); named_step && *named_step != m->step)
    return Error{ErrorKind::kConfig, fmt::format("{}: manifest is for step {}, but the directory is step {}", path, m->step, *named_step)};
  for (const auto& [name, size] : m->files) {
    std::error_code ec;
    const auto actual = fs::file_size(fs::path(step_dir) / name, ec);
    if (ec) return Error{ErrorKind::kConfig, fmt::format("{}/{}: missing ({})", step_dir, name, ec.message())};
    if (actual != size)
      return Error{ErrorKind::kConfig, fmt::format("{}/{}: {} bytes, manifest says {} (truncated?)", step_dir, name, actual, size)};
  }
  Reader r;
  r.dir_ = step_dir;
  r.manifest_ = std::move(*m);
  r.dir_lock_ = std::move(lock);
  return r;
}

std::vector<Reader::Logical> Reader::logical_blobs() const {
  std::vector<Logical> out;
  std::set<std::string> seen;
  for (const auto& b : manifest_.blobs) {
    if (!seen.insert(b.name).second) continue;
    if (b.layout == Layout::kShard) out.push_back({b.name, b.dtype, b.global_shape, b.global_size});
    else out.push_back({b.name, b.dtype, b.shape, b.size});
  }
  return out;
}

// Reads [from, from+len) of one stored blob, reading whole chunks so each can
// be checked against its checksum.
Status Reader::read_piece(const BlobInfo& b, std::uint64_t from, std::uint64_t len, unsigned char* dst) {
  if (len == 0) return {};
  const std::string path = (fs::path(dir_) / b.file).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", path, std::strerror(errno))};
  const std::uint64_t cb = manifest_.chunk_bytes;
  const std::uint64_t first = from / cb;
  const std::uint64_t last = (from + len - 1) / cb;
  std::vector<unsigned char> scratch;
  Status st;
  for (std::uint64_t c = first; c <= last && st; ++c) {
    const std::uint64_t c_begin = c * cb;
    const std::uint64_t c_len = std::min(cb, b.size - c_begin);
    // Read straight into the destination when the chunk lies wholly inside it.
    const bool direct = c_begin >= from && c_begin + c_len <= from + len;
    unsigned char* buf = direct ? dst + (c_begin - from) : nullptr;
    if (!direct) {
      scratch.resize(c_len);
      buf = scratch.data();
    }
    // Ask for the next chunk now, so the disk reads it while this one is
    // copied out and checksummed.
    if (c < last) {
      const std::uint64_t next_len = std::min(cb, b.size - (c + 1) * cb);
      ::posix_fadvise(fd, static_cast<off_t>(b.offset + (c + 1) * cb), static_cast<off_t>(next_len), POSIX_FADV_WILLNEED);
    }
    std::uint64_t done = 0;
    while (done < c_len) {
      const ssize_t n = ::pread(fd, buf + done, c_len - done, static_cast<off_t>(b.offset + c_begin + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        st = Error{ErrorKind::kIo, fmt::format("blob '{}': short read at offset {} of {}", b.name, b.offset + c_begin + done, path)};
        break;
      }
      done += static_cast<std::uint64_t>(n);
    }
    if (!st) break;
    if (XXH3_64bits(buf, c_len) != b.chunk_hashes[c]) {
      st = Error{ErrorKind::kConfig, fmt::format("blob '{}' (rank {}): checksum mismatch in bytes {}..{} of the blob, in {}",
                                                 b.name, b.rank, c_begin, c_begin + c_len, path)};
      break;
    }
    if (!direct) {
      const std::uint64_t lo = std::max(from, c_begin);
      const std::uint64_t hi = std::min(from + len, c_begin + c_len);
      std::memcpy(dst + (lo - from), buf + (lo - c_begin), hi - lo);
    }
  }
  ::close(fd);
  return st;
}

Status Reader::read(const std::string& name, void* dst, std::uint64_t size, std::uint64_t offset) {
  auto* out = static_cast<unsigned char*>(dst);
  bool found = false;
  std::uint64_t covered = 0;
  for (const auto& b : manifest_.blobs) {
    if (b.name != name) continue;
    found = true;
    if (b.layout == Layout::kReplicated) {
      if (offset + size > b.size)
        return Error{ErrorKind::kUsage, fmt::format("blob '{}': asked for bytes {}..{} of {}", name, offset, offset + size, b.size)};
      return read_piece(b, offset, size, out);
    }
    // A shard covers [shard_offset, shard_offset + size) of the logical blob.
    const std::uint64_t lo = std::max(offset, b.shard_offset);
    const std::uint64_t hi = std::min(offset + size, b.shard_offset + b.size);
    if (lo >= hi) continue;
    if (Status st = read_piece(b, lo - b.shard_offset, hi - lo, out + (lo - offset)); !st) return st;
    covered += hi - lo;
  }
  if (!found) return Error{ErrorKind::kUsage, fmt::format("{}: no blob named '{}'", dir_, name)};
  if (covered != size)
    return Error{ErrorKind::kConfig, fmt::format("blob '{}': shards cover {} of the {} bytes asked for", name, covered, size)};
  return {};
}

Status Reader::verify_all() {
  std::vector<unsigned char> buf;
  for (const auto& b : manifest_.blobs) {
    for (std::uint64_t off = 0; off < b.size; off += manifest_.chunk_bytes) {
      const std::uint64_t len = std::min(manifest_.chunk_bytes, b.size - off);
      buf.resize(len);
      if (Status st = read_piece(b, off, len, buf.data()); !st) return st;
    }
  }
  return {};
}

std::string damaged_dir_name(std::uint64_t step, int pid) {
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", &tm);
  return fmt::format("{}{}-{}-{}", kDamagedPrefix, step_dir_name(step), when, pid);
}

std::optional<std::uint64_t> parse_damaged_dir_name(const std::string& name) {
  const std::string prefix = std::string(kDamagedPrefix) + "step-";
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  std::uint64_t v = 0;
  const char* end = name.data() + name.size();
  auto [p, ec] = std::from_chars(name.data() + prefix.size(), end, v);
  if (ec != std::errc() || p == end || *p != '-') return std::nullopt;
  return v;
}

std::vector<Entry> list(const std::string& root, bool verify) {
  std::vector<Entry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    Entry en;
    en.path = e.path().string();
    if (auto step = parse_step_dir_name(name)) {
      en.step = *step;
      auto r = Reader::open(en.path);
      if (!r) {
        en.problem = r.error().message;
      } else {
        en.committed = true;
        for (const auto& [f, size] : r->manifest().files) en.bytes += size;
        if (verify) {
          Status st = r->verify_all();
          en.verified = st.ok();
          if (!st) en.problem = st.error().message;
        }
      }
    } else if (auto tmp = parse_temp_dir_name(name)) {
      en.step = tmp->step;
      en.partial = true;
      en.problem = "partial: a save that never committed";
    } else if (auto moved = parse_damaged_dir_name(name)) {
      en.step = *moved;
      en.damaged = true;
      en.problem = "damaged: moved aside by a new save of this step (pacer ckpt prune --remove-damaged removes it)";
      std::error_code fec;
      for (const auto& f : fs::directory_iterator(e.path(), fec))
        if (f.is_regular_file(fec)) en.bytes += f.file_size(fec);
    } else {
      continue;
    }
    out.push_back(std::move(en));
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) {
    if (a.step != b.step) return a.step > b.step;
    if (a.committed != b.committed) return a.committed > b.committed;
    return a.path < b.path;
  });
  return out;
}

namespace {

// Opens the directory and takes its lock exclusively without waiting: false
// when a Reader holds it. Filesystems without flock count as unlocked.
Expected<std::shared_ptr<const int>> lock_for_removal(const std::string& path) {
  const int dfd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
  std::shared_ptr<const int> fd(new int(dfd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  int rc;
  while ((rc = ::flock(dfd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (rc != 0 && errno == EWOULDBLOCK) return std::shared_ptr<const int>();
  return fd;
}

}  // namespace

Expected<bool> remove_checkpoint_dir(const std::string& path) {
  auto lock = lock_for_removal(path);
  if (!lock) return Error{ErrorKind::kIo, fmt::format("{}: cannot remove: {}", path, lock.error().message)};
  if (!*lock) return false;  // being read: the next retention tries again
  // Renamed away first: a directory that is half deleted must not keep a
  // name that looks like a checkpoint. The lock stays held until it is gone,
  // so a reader that opened the name just before the rename finds it moved.
  const fs::path p(path);
  const fs::path doomed = p.parent_path() / fmt::format(".deleting-{}-{}", p.filename().string(), ::getpid());
  if (::rename(path.c_str(), doomed.c_str()) != 0)
    return Error{ErrorKind::kIo, fmt::format("{}: cannot remove: {}", path, std::strerror(errno))};
  sync_dir(p.parent_path().string());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  return true;
}

Expected<std::string> move_aside_damaged(const std::string& step_dir, std::uint64_t step) {
  auto lock = lock_for_removal(step_dir);
  if (!lock) return lock.error();
  if (!*lock) return Error{ErrorKind::kIo, fmt::format("{}: damaged, but being read: not moved aside", step_dir)};
  const fs::path p(step_dir);
  const std::string to = (p.parent_path() / damaged_dir_name(step, ::getpid())).string();
  if (Status st = rename_no_replace(step_dir, to); !st) return st.error();
  sync_dir(p.parent_path().string());
  return to;
}

namespace {

// Verification results of this process, keyed by what identifies the bytes:
// the directory, its manifest's checksum and its files' sizes and
// modification times.
struct VerifyCache {
  std::mutex mu;
  std::map<std::string, std::string> results;  // key -> "" (valid) or the problem
};
VerifyCache& verify_cache() {
  static VerifyCache c;
  return c;
}

std::string verify_key(const std::string& step_dir, const Manifest& m) {
  std::error_code ec;
  const fs::path dir = fs::absolute(step_dir, ec).lexically_normal();
  const std::string body = manifest_body(m).dump();
  std::string key = fmt::format("{}|{}", dir.string(), hex(XXH3_64bits(body.data(), body.size())));
  for (const auto& [name, size] : m.files) {
    struct stat st {};
    if (::stat((dir / name).c_str(), &st) != 0) return "";  // missing: never cached
    key += fmt::format("|{}:{}:{}.{}", name, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  }
  return key;
}

void remember(const std::string& key, const std::string& problem) {
  if (key.empty()) return;
  auto& c = verify_cache();
  std::lock_guard g(c.mu);
  if (c.results.size() >= 4096) c.results.clear();  // bounded: a long run saves many steps
  c.results[key] = problem;
}

}  // namespace

void note_verified(const std::string& step_dir, const Manifest& m) { remember(verify_key(step_dir, m), ""); }

Status verify_step(const std::string& step_dir) {
  auto r = Reader::open(step_dir);
  if (!r) return r.error();
  const std::string key = verify_key(step_dir, r->manifest());
  if (!key.empty()) {
    auto& c = verify_cache();
    std::lock_guard g(c.mu);
    if (auto it = c.results.find(key); it != c.results.end()) {
      if (it->second.empty()) return {};
      return Error{ErrorKind::kConfig, it->second};
    }
  }
  Status st = r->verify_all();
  remember(key, st ? "" : st.error().message);
  return st;
}

std::vector<std::uint64_t> retention_victims(const std::vector<std::uint64_t>& committed_desc, int keep_last, int keep_every) {
  std::vector<std::uint64_t> victims;
  if (keep_last <= 0) return victims;
  for (std::size_t i = 0; i < committed_desc.size(); ++i) {
    const std::uint64_t s = committed_desc[i];
    if (i == 0 || static_cast<int>(i) < keep_last) continue;  // the newest always stays
    if (keep_every > 0 && s % static_cast<std::uint64_t>(keep_every) == 0) continue;
    victims.push_back(s);
  }
  return victims;
}

RetentionPlan plan_retention(const std::string& root, int keep_last, int keep_every) {
  RetentionPlan plan;
  std::vector<std::uint64_t> candidates;
  for (auto& e : list(root, false)) {
    if (e.partial) continue;  // a save in progress, or the leftover of a dead one: not retention's business
    if (e.damaged || !e.committed) {
      plan.damaged.push_back(std::move(e));
      continue;
    }
    // Newest first: the first step that verifies is the newest valid one.
    // Only newer steps are read in full, so the cost is one step's read in
    // the usual case (none when this process committed it).
    if (!plan.newest_valid) {
      if (Status st = verify_step(e.path); !st) {
        e.problem = st.error().message;
        plan.damaged.push_back(std::move(e));
        continue;
      }
      plan.newest_valid = e.step;
    }
    plan.paths[e.step] = e.path;
    candidates.push_back(e.step);
  }
  plan.victims = retention_victims(candidates, keep_last, keep_every);
  const std::set<std::uint64_t> doomed(plan.victims.begin(), plan.victims.end());
  for (auto s : candidates)
    if (!doomed.count(s)) plan.kept.push_back(s);
  return plan;
}

Expected<PruneResult> prune(const std::string& root, const PruneOptions& o) {
  if (!fs::is_directory(root)) return Error{ErrorKind::kUsage, fmt::format("{}: not a directory", root)};
  if (o.keep_last < 1) return Error{ErrorKind::kUsage, "keep_last must be at least 1"};
  if (o.keep_every < 0) return Error{ErrorKind::kUsage, "keep_every must not be negative"};
  RetentionPlan plan = plan_retention(root, o.keep_last, o.keep_every);
  PruneResult out;
  out.newest_valid = plan.newest_valid;
  out.kept = plan.kept;
  out.damaged = plan.damaged;
  auto failed = [&](const Error& e) {
    std::string done;
    for (auto s : out.removed) done += (done.empty() ? "" : ", ") + std::to_string(s);
    return Error{e.kind, done.empty() ? e.message : fmt::format("{} (after removing step(s) {})", e.message, done)};
  };
  for (auto s : plan.victims) {
    if (o.dry_run) {
      out.removed.push_back(s);
      continue;
    }
    auto gone = remove_checkpoint_dir(plan.paths[s]);
    if (!gone) return failed(gone.error());
    (*gone ? out.removed : out.busy).push_back(s);
  }
  if (o.remove_damaged) {
    for (const auto& d : plan.damaged) {
      if (o.dry_run) {
        out.removed_damaged.push_back(d.path);
        continue;
      }
      auto gone = remove_checkpoint_dir(d.path);
      if (!gone) return failed(gone.error());
      if (*gone) out.removed_damaged.push_back(d.path);
      else out.busy.push_back(d.step);
    }
  }
  return out;
}

}  // namespace pacer::ckpt
