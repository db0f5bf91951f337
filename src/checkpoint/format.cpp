// The on-disk format: manifests, step directories, checksummed reads, listing and retention.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
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
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kConfig, text.error().message + " (no manifest: not a committed checkpoint)"};
  auto m = manifest_from_json(*text, path);
  if (!m) return m.error();
  // A checkpoint copied or renamed under another step's name must not pass
  // for that step.
  if (auto named = parse_step_dir_name(fs::path(step_dir).filename().string()); named && *named != m->step)
    return Error{ErrorKind::kConfig, fmt::format("{}: manifest is for step {}, but the directory is step {}", path, m->step, *named)};
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
    } else {
      continue;
    }
    out.push_back(std::move(en));
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) {
    return a.step != b.step ? a.step > b.step : a.committed > b.committed;
  });
  return out;
}

Status remove_checkpoint_dir(const std::string& path) {
  // Renamed away first: a directory that is half deleted must not keep a
  // name that looks like a checkpoint.
  const fs::path p(path);
  const fs::path doomed = p.parent_path() / fmt::format(".deleting-{}-{}", p.filename().string(), ::getpid());
  if (::rename(path.c_str(), doomed.c_str()) != 0)
    return Error{ErrorKind::kIo, fmt::format("{}: cannot remove: {}", path, std::strerror(errno))};
  sync_dir(p.parent_path().string());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  return {};
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

Expected<std::vector<std::uint64_t>> prune(const std::string& root, int keep_last, int keep_every) {
  if (!fs::is_directory(root)) return Error{ErrorKind::kUsage, fmt::format("{}: not a directory", root)};
  std::vector<std::uint64_t> committed;
  std::map<std::uint64_t, std::string> paths;
  for (const auto& e : list(root, false)) {
    if (!e.committed) continue;
    committed.push_back(e.step);
    paths[e.step] = e.path;
  }
  std::vector<std::uint64_t> removed;
  for (auto s : retention_victims(committed, keep_last, keep_every)) {
    if (Status st = remove_checkpoint_dir(paths[s]); !st) return st.error();
    removed.push_back(s);
  }
  return removed;
}

}  // namespace pacer::ckpt
