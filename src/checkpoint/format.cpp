// The on-disk format: manifests, step directories, checksummed reads, listing and retention.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <ctime>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <set>

#include "ckpt_internal.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/host_buffer.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/time.hpp"
#include "pacer/hw/system.hpp"

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

// A name in the step directory itself (what the writer makes: rank-NNNNN.bin),
// never a path: an untrusted manifest must not read /etc/passwd or ../x.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

Expected<std::uint64_t> unhex(const std::string& s) {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || p != s.data() + s.size() || s.size() != 16) return Error{ErrorKind::kConfig, "bad checksum '" + s + "'"};
  return v;
}

// Where in a manifest (a JSON pointer) the first number that is not a non-negative integer is,
// meta left out: get<std::uint64_t>() and get<int>() of a float cast it, undefined beyond the
// type's range, and every number pacer writes there is a count, a size or an offset. Iterative:
// the nesting is the input's.
std::optional<std::string> non_count_number(const json& manifest) {
  std::vector<std::pair<const json*, std::string>> todo{{&manifest, ""}};
  while (!todo.empty()) {
    auto [j, where] = todo.back();
    todo.pop_back();
    if (j->is_number() && !j->is_number_unsigned()) return where.empty() ? "/" : where;
    if (j->is_object()) {
      for (auto it = j->begin(); it != j->end(); ++it)
        if (j != &manifest || it.key() != "meta") todo.emplace_back(&*it, where + "/" + it.key());
    } else if (j->is_array()) {
      for (std::size_t i = 0; i < j->size(); ++i) todo.emplace_back(&(*j)[i], where + "/" + std::to_string(i));
    }
  }
  return std::nullopt;
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
  json j = {{"schema", kManifestSchema}, {"step", m.step},       {"created_at", m.created_at},
            {"world_size", m.world_size}, {"chunk_bytes", m.chunk_bytes}, {"hash", "xxh3-64"},
            {"files", files},             {"blobs", blobs},      {"meta", m.meta}};
  if (!m.ranks.empty()) j["ranks"] = m.ranks;
  return j;
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
  if (auto where = non_count_number(j)) return bad(fmt::format("{} is not a non-negative integer", *where));
  try {
    Manifest m;
    m.step = j.at("step").get<std::uint64_t>();
    m.created_at = j.at("created_at").get<std::string>();
    m.world_size = j.at("world_size").get<int>();
    m.chunk_bytes = j.at("chunk_bytes").get<std::uint64_t>();
    m.meta = j.at("meta");
    if (j.contains("ranks")) {
      m.ranks = j.at("ranks").get<std::vector<int>>();
      for (int r : m.ranks)
        if (r < 0 || r >= m.world_size) return bad(fmt::format("rank {} outside world_size {}", r, m.world_size));
      if (m.ranks.empty() || static_cast<int>(m.ranks.size()) > m.world_size) return bad("bad list of ranks held");
    }
    std::set<std::string> file_names;
    for (const auto& f : j.at("files")) {
      std::string name = f.at("name").get<std::string>();
      if (!plain_file_name(name)) return bad(fmt::format("data file '{}' is not a plain name inside the step directory", name));
      if (!file_names.insert(name).second) return bad(fmt::format("data file '{}' listed twice", name));
      m.files.emplace_back(std::move(name), f.at("size").get<std::uint64_t>());
    }
    for (const auto& bj : j.at("blobs")) {
      BlobInfo b;
      b.name = bj.at("name").get<std::string>();
      b.rank = bj.at("rank").get<int>();
      b.file = bj.at("file").get<std::string>();
      // A blob names one of the step's own files, never a path elsewhere.
      if (!file_names.count(b.file))
        return bad(fmt::format("blob '{}': file '{}' is not one of the step's data files", b.name, b.file));
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
      // Rounded up without size + chunk_bytes - 1, which wraps near 2^64.
      const std::uint64_t want_chunks = m.chunk_bytes ? b.size / m.chunk_bytes + (b.size % m.chunk_bytes != 0) : 0;
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

namespace {

// What readers and deleters lock: the step's manifest, which every committed
// step has (a directory without one is locked by its own descriptor). A file,
// not the directory: on NFS flock() is emulated with fcntl() locks, and an
// exclusive one needs a descriptor open for writing, which a directory
// cannot have. The path locked is returned in `locked_path`.
// O_NONBLOCK: a FIFO under the manifest's name must not hang the open (a
// reader's lock needs only a read-only descriptor, so a read-only mount works).
int open_lock_target(const std::string& step_dir, bool for_removal, std::string& locked_path) {
  locked_path = (fs::path(step_dir) / kManifestName).string();
  int fd = -1;
  if (for_removal) fd = ::open(locked_path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0 && (!for_removal || errno == EACCES || errno == EROFS))
    fd = ::open(locked_path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd >= 0 || errno != ENOENT) return fd;
  locked_path = step_dir;
  return ::open(step_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

std::shared_ptr<const int> own_fd(int fd) {
  return std::shared_ptr<const int>(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
}

// The shared lock a Reader holds on its step, so that nobody deletes the step
// under it (deleters take it exclusively, without waiting, and skip a step
// that is being read). Where the filesystem has no locks (some Lustre
// mounts) deletion is not held off; out of descriptors (candidates() of a
// root that keeps thousands of steps) the step is opened unlocked rather than
// not at all (a null lock).
Expected<std::shared_ptr<const int>> lock_step_dir(const std::string& step_dir) {
  std::string locked_path;
  const int fd = open_lock_target(step_dir, false, locked_path);
  if (fd < 0 && errno != EMFILE && errno != ENFILE)
    return Error{ErrorKind::kConfig, fmt::format("{}: cannot open: {} (no manifest: not a committed checkpoint)", step_dir, std::strerror(errno))};
  std::shared_ptr<const int> lock;
  if (fd < 0) return lock;
  lock = own_fd(fd);
  (void)retry_eintr([&] { return ::flock(fd, LOCK_SH); });
  // A deleter that won the lock has renamed the directory away by now, and
  // a new save may have put another directory under the name: read only
  // the step that is locked.
  struct stat locked {}, named {};
  if (::fstat(fd, &locked) != 0 || ::stat(locked_path.c_str(), &named) != 0 || locked.st_ino != named.st_ino ||
      locked.st_dev != named.st_dev)
    return Error{ErrorKind::kConfig, fmt::format("{}: removed while being opened (no manifest: not a committed checkpoint)", step_dir)};
  return lock;
}

// The manifest, read through the descriptor that holds the step's lock: a
// regular file only (a FIFO would block, /dev/zero never end), no more than
// its size when opened and never more than kMaxManifestBytes.
Expected<std::string> read_manifest(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", path, std::strerror(errno))};
  if (S_ISDIR(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: missing", path)};  // the directory's own lock
  if (!S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", path)};
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > kMaxManifestBytes)
    return Error{ErrorKind::kConfig, fmt::format("{}: {} bytes, more than a manifest may have ({})", path, size, kMaxManifestBytes)};
  std::string text(size, '\0');
  auto done = pread_full(fd, text.data(), size, 0, path);
  if (!done) return done.error();
  text.resize(*done);  // shrunk meanwhile: what is there (a torn manifest fails its checksum)
  return text;
}

}  // namespace

Expected<Reader> Reader::open(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / kManifestName).string();
  // The lock comes before the manifest is read.
  auto lock = lock_step_dir(step_dir);
  if (!lock) return lock.error();
  // Out of descriptors the step is opened unlocked (see lock_step_dir).
  std::shared_ptr<const int> unlocked;
  if (!*lock)
    if (const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); fd >= 0) unlocked = own_fd(fd);
  const int fd = *lock ? **lock : unlocked ? *unlocked : -1;
  auto text = fd >= 0 ? read_manifest(fd, path)
                      : Expected<std::string>(Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))});
  if (!text) return Error{ErrorKind::kConfig, text.error().message + " (no manifest: not a committed checkpoint)"};
  auto m = manifest_from_json(*text, path);
  if (!m) return m.error();
  // A checkpoint copied or renamed under another step's name must not pass
  // for that step.
  if (auto named = parse_step_dir_name(fs::path(step_dir).filename().string()); named && *named != m->step)
    return Error{ErrorKind::kConfig, fmt::format("{}: manifest is for step {}, but the directory is step {}", path, m->step, *named)};
  return open_locked(step_dir, std::move(*m), std::move(*lock));
}

namespace {

// elements(shape) * itemsize, or nothing on a negative dimension or overflow.
std::optional<std::uint64_t> shape_bytes(const std::vector<std::int64_t>& shape, std::size_t itemsize) {
  std::uint64_t n = itemsize;
  for (auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

}  // namespace

Status check_layout(const Manifest& m, bool complete, const std::string& source) {
  auto bad = [&](const std::string& name, const std::string& why) {
    return Error{ErrorKind::kConfig, fmt::format("{}: blob '{}': {}", source, name, why)};
  };
  std::map<std::string, std::vector<const BlobInfo*>> by_name;
  for (const auto& b : m.blobs) by_name[b.name].push_back(&b);
  for (const auto& [name, entries] : by_name) {
    const BlobInfo& first = *entries.front();
    const std::size_t item = std::max<std::size_t>(1, dtype_size(first.dtype));
    if (!valid_dtype(first.dtype)) return bad(name, fmt::format("unknown dtype '{}'", first.dtype));
    for (const BlobInfo* e : entries) {
      if (e->layout != first.layout) return bad(name, "stored both whole and as shards");
      if (e->dtype != first.dtype) return bad(name, fmt::format("pieces of dtypes {} and {}", first.dtype, e->dtype));
      if (!e->shape.empty()) {
        auto want = shape_bytes(e->shape, item);
        if (!want || *want != e->size) return bad(name, fmt::format("shape {} does not make its {} bytes", json(e->shape).dump(), e->size));
      }
    }
    if (first.layout == Layout::kReplicated) {
      if (entries.size() > 1) return bad(name, fmt::format("stored {} times", entries.size()));
      continue;
    }
    const std::uint64_t global = first.global_size;
    if (!first.global_shape.empty()) {
      auto want = shape_bytes(first.global_shape, item);
      if (!want || *want != global)
        return bad(name, fmt::format("global shape {} does not make its {} bytes", json(first.global_shape).dump(), global));
    }
    std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
    for (const BlobInfo* e : entries) {
      if (e->global_size != global || e->global_shape != first.global_shape) return bad(name, "shards disagree on the global size or shape");
      if (e->size > global || e->shard_offset > global - e->size)
        return bad(name, fmt::format("shard [{}, +{}) lies outside its {} bytes", e->shard_offset, e->size, global));
      spans.emplace_back(e->shard_offset, e->size);
    }
    std::sort(spans.begin(), spans.end());
    std::uint64_t end = 0;
    for (const auto& [off, size] : spans) {
      if (off < end) return bad(name, fmt::format("shards overlap at byte {}", off));
      if (complete && off != end) return bad(name, fmt::format("no shard holds bytes {}..{}", end, off));
      end = off + size;
    }
    if (complete && end != global) return bad(name, fmt::format("no shard holds bytes {}..{}", end, global));
  }
  return {};
}

Expected<Reader> Reader::open(const std::string& step_dir, Manifest manifest) {
  auto lock = lock_step_dir(step_dir);
  if (!lock) return lock.error();
  return open_locked(step_dir, std::move(manifest), std::move(*lock));
}

Expected<Reader> Reader::open_locked(const std::string& step_dir, Manifest manifest, std::shared_ptr<const int> lock) {
  if (Status st = check_layout(manifest, manifest.ranks.empty(), (fs::path(step_dir) / kManifestName).string()); !st) return st.error();
  std::map<std::string, std::uint64_t> sizes;
  for (const auto& [name, size] : manifest.files) {
    // Names are plain (manifest_from_json); a part manifest built in memory is checked here too.
    if (!plain_file_name(name))
      return Error{ErrorKind::kConfig, fmt::format("{}: data file '{}' is not a plain name inside the step directory", step_dir, name)};
    const std::string path = (fs::path(step_dir) / name).string();
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return Error{ErrorKind::kConfig, fmt::format("{}: missing ({})", path, std::strerror(errno))};
    if (!S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", path)};
    const auto actual = static_cast<std::uint64_t>(st.st_size);
    if (actual != size)
      return Error{ErrorKind::kConfig, fmt::format("{}: {} bytes, manifest says {} (truncated?)", path, actual, size)};
    sizes[name] = size;
  }
  // Every blob lies inside its file, checked before any size decides how
  // much memory a loader allocates: a crafted size or offset of 2^62 makes
  // the step invalid (the next candidate is read), not an allocation.
  for (const auto& b : manifest.blobs) {
    const auto f = sizes.find(b.file);
    if (f == sizes.end() || b.offset > f->second || b.size > f->second - b.offset)
      return Error{ErrorKind::kConfig, fmt::format("{}: blob '{}' (rank {}): bytes [{}, +{}) lie outside its file {}", step_dir, b.name,
                                                   b.rank, b.offset, b.size, b.file)};
  }
  Reader r;
  r.dir_ = step_dir;
  r.manifest_ = std::move(manifest);
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

namespace {

constexpr std::uint64_t kPage = 4096;

bool aligned(const void* p, std::uint64_t off) { return reinterpret_cast<std::uintptr_t>(p) % kPage == 0 && off % kPage == 0; }

// True when every page of [off, off+len) of the file is in the page cache: a
// buffered read then copies from memory, where O_DIRECT would go to the disk.
bool cached(int fd, std::uint64_t off, std::uint64_t len) {
  const std::uint64_t lo = off / kPage * kPage;
  const std::uint64_t n = off + len - lo;
  void* map = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(lo));
  if (map == MAP_FAILED) return false;
  std::vector<unsigned char> pages((n + kPage - 1) / kPage);
  const bool ok = ::mincore(map, n, pages.data()) == 0 &&
                  std::all_of(pages.begin(), pages.end(), [](unsigned char v) { return (v & 1) != 0; });
  ::munmap(map, n);
  return ok;
}

// Chunks this large are read on a helper thread while the previous one is
// checksummed; smaller ones are not worth a thread.
constexpr std::uint64_t kPipelineBytes = 1u << 20;

}  // namespace

// One stored file opened for reading: buffered, and O_DIRECT when the
// filesystem takes it.
struct Reader::File {
  std::string path;
  int fd = -1;
  int direct_fd = -1;
  ~File() {
    if (fd >= 0) ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
  }

  Status pread_all(int f, unsigned char* buf, std::uint64_t n, std::uint64_t off, std::uint64_t* got) const {
    auto r = pread_full(f, buf, n, off, path);
    if (!r) return r.error();
    *got = *r;
    return {};
  }

  // Reads n bytes at off into buf. Uncached data goes straight from the disk
  // into buf (O_DIRECT: no page-cache copy, no page-cache pages to allocate,
  // and one large request the kernel splits into a deep queue) when buf and
  // off are 4 KiB aligned; the sub-page tail goes through a page-sized bounce
  // buffer so nothing is written past buf + n.
  Status read(unsigned char* buf, std::uint64_t n, std::uint64_t off) {
    std::uint64_t got = 0;
    if (direct_fd >= 0 && n >= kPage && aligned(buf, off) && !cached(fd, off, n)) {
      const std::uint64_t body = n / kPage * kPage;
      Status st = pread_all(direct_fd, buf, body, off, &got);
      if (!st && st.error().message.find(std::strerror(EINVAL)) != std::string::npos) {
        // Accepted at open, refused on read (some network filesystems).
        ::close(direct_fd);
        direct_fd = -1;
        got = 0;
      } else if (!st) {
        return st;
      } else if (got == body && body < n) {
        alignas(kPage) unsigned char tail[kPage];
        std::uint64_t t = 0;
        if (Status s2 = pread_all(direct_fd, tail, kPage, off + body, &t); !s2) return s2;
        const std::uint64_t want = n - body;
        std::memcpy(buf + body, tail, std::min(t, want));
        got += std::min(t, want);
      }
    }
    if (got < n) {
      std::uint64_t more = 0;
      if (Status st = pread_all(fd, buf + got, n - got, off + got, &more); !st) return st;
      got += more;
    }
    if (got < n) return Error{ErrorKind::kIo, fmt::format("{}: short read at offset {} (file ends early)", path, off + got)};
    return {};
  }
};

Expected<std::shared_ptr<Reader::File>> Reader::open_file(const std::string& name) const {
  auto f = std::make_shared<File>();
  f->path = (fs::path(dir_) / name).string();
  // O_NONBLOCK: replaced by a FIFO since open() checked it, it must not hang.
  f->fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f->fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", f->path, std::strerror(errno))};
  struct stat st {};
  if (::fstat(f->fd, &st) != 0 || !S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", f->path)};
  f->direct_fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  return f;
}

// Reads [from, from+len) of one stored blob, whole chunks at a time so each is
// checked against its checksum as it arrives; the next chunk is read while
// this one is checked. dst == nullptr: read and check only.
Status Reader::read_piece(const BlobInfo& b, std::uint64_t from, std::uint64_t len, unsigned char* dst, HostBuffer* kept) {
  if (len == 0) return {};
  std::uint64_t file_size = 0;
  bool listed = false;
  for (const auto& [f, size] : manifest_.files)
    if (f == b.file) listed = true, file_size = size;
  // The manifest is untrusted: a blob must lie inside its (size-checked) file
  // before its sizes decide how much memory to use.
  if (!listed || b.offset > file_size || b.size > file_size - b.offset)
    return Error{ErrorKind::kConfig, fmt::format("{}: blob '{}' (rank {}) lies outside its file {}", dir_, b.name, b.rank, b.file)};
  auto file = open_file(b.file);
  if (!file) return file.error();
  File& io = **file;
  const std::uint64_t cb = manifest_.chunk_bytes;
  const std::uint64_t first = from / cb;
  const std::uint64_t last = (from + len - 1) / cb;
  // Chunks reaching outside [from, from+len) (and every chunk when only
  // checking) land in scratch; two, so the next can be read meanwhile.
  HostBuffer own[2];
  HostBuffer* scratch = kept ? kept : own;
  auto target = [&](std::uint64_t c) -> unsigned char* {
    const std::uint64_t c_begin = c * cb;
    const std::uint64_t c_len = std::min(cb, b.size - c_begin);
    if (dst && c_begin >= from && c_begin + c_len <= from + len) return dst + (c_begin - from);
    HostBuffer& s = scratch[c % 2];
    if (s.size() < c_len) s = HostBuffer(c_len);
    return s.data();
  };
  auto fetch = [&](std::uint64_t c, unsigned char* buf) {
    const std::uint64_t c_begin = c * cb;
    Status st = io.read(buf, std::min(cb, b.size - c_begin), b.offset + c_begin);
    if (!st) return Status(Error{st.error().kind, fmt::format("blob '{}' (rank {}): {}", b.name, b.rank, st.error().message)});
    return st;
  };
  std::future<Status> next;
  unsigned char* next_buf = target(first);
  if (!next_buf) return Error{ErrorKind::kIo, "out of memory for a read buffer"};
  Status st;
  if (std::min(cb, b.size - first * cb) >= kPipelineBytes) next = std::async(std::launch::async, fetch, first, next_buf);
  else st = fetch(first, next_buf);
  for (std::uint64_t c = first; c <= last; ++c) {
    unsigned char* buf = next_buf;
    if (next.valid()) st = next.get();
    if (!st) break;
    const std::uint64_t c_begin = c * cb;
    const std::uint64_t c_len = std::min(cb, b.size - c_begin);
    if (c < last) {
      next_buf = target(c + 1);
      if (!next_buf) return Error{ErrorKind::kIo, "out of memory for a read buffer"};
      if (std::min(cb, b.size - (c + 1) * cb) >= kPipelineBytes) next = std::async(std::launch::async, fetch, c + 1, next_buf);
    }
    if (XXH3_64bits(buf, c_len) != b.chunk_hashes[c]) {
      st = Error{ErrorKind::kConfig, fmt::format("blob '{}' (rank {}): checksum mismatch in bytes {}..{} of the blob, in {}",
                                                 b.name, b.rank, c_begin, c_begin + c_len, io.path)};
      break;
    }
    if (dst && !(c_begin >= from && c_begin + c_len <= from + len)) {  // read into scratch: copy out the part asked for
      const std::uint64_t lo = std::max(from, c_begin);
      const std::uint64_t hi = std::min(from + len, c_begin + c_len);
      std::memcpy(dst + (lo - from), buf + (lo - c_begin), hi - lo);
    }
    if (c < last && !next.valid()) st = fetch(c + 1, next_buf);
  }
  if (next.valid()) (void)next.get();  // never leave a read writing into memory we return
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
      if (size > b.size || offset > b.size - size)
        return Error{ErrorKind::kUsage, fmt::format("blob '{}': asked for {} bytes from byte {} of {}", name, size, offset, b.size)};
      return read_piece(b, offset, size, out);
    }
    if (size > UINT64_MAX - offset)
      return Error{ErrorKind::kUsage, fmt::format("blob '{}': asked for {} bytes from byte {}", name, size, offset)};
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

bool Reader::covers(const std::string& name, std::uint64_t size, std::uint64_t offset) const {
  std::uint64_t covered = 0;
  for (const auto& b : manifest_.blobs) {
    if (b.name != name) continue;
    if (b.layout == Layout::kReplicated) return size <= b.size && offset <= b.size - size;
    if (size > UINT64_MAX - offset) return false;
    const std::uint64_t lo = std::max(offset, b.shard_offset);
    const std::uint64_t hi = std::min(offset + size, b.shard_offset + b.size);
    if (lo < hi) covered += hi - lo;
  }
  return covered == size && (size > 0 || std::any_of(manifest_.blobs.begin(), manifest_.blobs.end(), [&](const BlobInfo& b) { return b.name == name; }));
}

Status Reader::verify_all() { return verify_share(0, 1); }

Status Reader::verify_share(int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) return Error{ErrorKind::kUsage, fmt::format("verify_share: rank {} of {}", rank, ranks)};
  HostBuffer scratch[2];  // faulted in once, not once per blob
  for (std::size_t i = static_cast<std::size_t>(rank); i < manifest_.blobs.size(); i += static_cast<std::size_t>(ranks))
    if (Status st = read_piece(manifest_.blobs[i], 0, manifest_.blobs[i].size, nullptr, scratch); !st) return st;
  return {};
}

std::string damaged_dir_name(std::uint64_t step, int pid) {
  return fmt::format("{}{}-{}-{}", kDamagedPrefix, step_dir_name(step), utc_compact(wall_now()), pid);
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

// Takes the step's lock exclusively without waiting: a null lock when a
// Reader holds it. Filesystems without locks count as unlocked.
Expected<std::shared_ptr<const int>> lock_for_removal(const std::string& path) {
  std::string locked_path;
  const int fd = open_lock_target(path, true, locked_path);
  if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", locked_path, std::strerror(errno))};
  auto lock = own_fd(fd);
  const int rc = retry_eintr([&] { return ::flock(fd, LOCK_EX | LOCK_NB); });
  // Held by a reader: busy. Any other failure means no locks here (ENOLCK,
  // a filesystem without them): deletion is not held off.
  if (rc != 0 && errno == EWOULDBLOCK) return std::shared_ptr<const int>();
  return lock;
}

}  // namespace

Expected<bool> remove_checkpoint_dir(const std::string& path) {
  auto lock = lock_for_removal(path);
  if (!lock) return Error{ErrorKind::kIo, fmt::format("{}: cannot remove: {}", path, lock.error().message)};
  if (!*lock) return false;  // being read: the next retention tries again
  // Renamed away first: a directory that is half deleted must not keep a
  // name that looks like a checkpoint. The lock stays held until the rename,
  // so a reader that opened the name just before it finds it moved.
  const fs::path p(path);
  const fs::path doomed = p.parent_path() / fmt::format(".deleting-{}-{}", p.filename().string(), ::getpid());
  if (::rename(path.c_str(), doomed.c_str()) != 0)
    return Error{ErrorKind::kIo, fmt::format("{}: cannot remove: {}", path, std::strerror(errno))};
  (void)fsync_dir(p.parent_path().string());
  // Renamed: a reader still waiting for the lock finds the name gone. Let it
  // go before removing, or NFS keeps the open manifest as a silly-renamed
  // file and the directory cannot be removed.
  (*lock).reset();
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
  (void)fsync_dir(p.parent_path().string());
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

namespace {

// The newest modification time of a directory and of what it holds (a saver
// writes its files, creates parts and markers), in seconds since the epoch;
// nullopt when it cannot be read (gone meanwhile).
std::optional<double> newest_mtime(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return std::nullopt;
  auto secs = [](const struct stat& s) { return static_cast<double>(s.st_mtim.tv_sec) + s.st_mtim.tv_nsec * 1e-9; };
  double newest = secs(st);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    struct stat f {};
    if (::lstat(e.path().c_str(), &f) == 0) newest = std::max(newest, secs(f));
  }
  return newest;
}

bool pid_alive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno != ESRCH); }

}  // namespace

std::vector<StalePartial> stale_partials(const std::string& tier, const std::string& this_host, double stale_after_s) {
  std::vector<StalePartial> out;
  std::vector<std::pair<std::string, TempName>> others;  // not provably dead: decided by the committed steps
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(tier, ec)) {
    const std::string name = e.path().filename().string();
    auto tn = parse_temp_dir_name(name);
    if (!tn) continue;
    if (tn->host == this_host) {
      // Its saver may be alive: then it may still be filling it, whatever its age.
      if (pid_alive(tn->pid)) continue;
      if (tn->pid > 0) {
        out.push_back({e.path().string(), tn->step, fmt::format("its saver, pid {} on this host, is gone", tn->pid), true});
        continue;
      }
    }
    others.emplace_back(e.path().string(), *tn);
  }
  if (others.empty()) return out;
  std::optional<std::uint64_t> newest_committed;
  for (const auto& en : list(tier, false))
    if (en.committed && (!newest_committed || en.step > *newest_committed)) newest_committed = en.step;
  if (!newest_committed) return out;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const auto& [path, tn] : others) {
    if (tn.step > *newest_committed) continue;  // maybe the next step, still being written
    const auto touched = newest_mtime(path);
    if (!touched || now - *touched < stale_after_s) continue;  // a future time (clock skew) counts as fresh
    out.push_back({path, tn.step,
                   fmt::format("step {} is committed and nothing in it changed for {:.0f} s (saver: host {}, pid {})",
                               *newest_committed, now - *touched, tn.host, tn.pid)});
  }
  return out;
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
  for (auto& p : stale_partials(root, hw::hostname(), o.stale_partial_s)) {
    Entry e;
    e.step = p.step;
    e.path = p.path;
    e.partial = true;
    e.problem = p.why;
    if (!o.dry_run) {
      auto gone = remove_checkpoint_dir(p.path);
      std::error_code ec;
      if (!gone && fs::exists(p.path, ec)) return failed(gone.error());
      if (!gone || !*gone) continue;  // removed meanwhile by another cleanup, or being read
    }
    out.removed_partial.push_back(std::move(e));
  }
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
