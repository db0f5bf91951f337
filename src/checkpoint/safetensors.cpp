// Export of a checkpoint's tensors in the safetensors format (Hugging Face's layout).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "pacer/checkpoint.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"

namespace pacer::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

std::string safetensors_dtype(const std::string& dtype) {
  static const std::map<std::string, std::string> kNames = {
      {"float64", "F64"},      {"float32", "F32"},      {"float16", "F16"},         {"bfloat16", "BF16"},
      {"int64", "I64"},        {"int32", "I32"},        {"int16", "I16"},           {"int8", "I8"},
      {"uint8", "U8"},         {"bool", "BOOL"},        {"uint16", "U16"},          {"uint32", "U32"},
      {"uint64", "U64"},       {"float8_e4m3fn", "F8_E4M3"}, {"float8_e5m2", "F8_E5M2"}};
  auto it = kNames.find(dtype);
  return it == kNames.end() ? "" : it->second;
}

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr std::uint64_t kCopyBytes = 16ull << 20;  // bounded memory whatever the model's size

struct Tensor {
  std::string blob;  // name in the checkpoint
  std::string name;  // name in the safetensors file
  std::string dtype;  // safetensors name
  std::vector<std::int64_t> shape;
  std::uint64_t size = 0;
  XXH128_hash_t hash{};  // of the bytes read from the checkpoint
};

// Errors while reading the checkpoint (damage) are told apart from errors
// while writing the output, so that only the first make the caller fall back
// to an older step.
struct Failure {
  Error error;
  bool source_damaged = false;
};

Expected<std::vector<Tensor>> select(Reader& r, const ExportOptions& o) {
  const std::string pre = o.prefix.empty() ? "" : o.prefix + "/";
  std::vector<Tensor> out;
  std::vector<std::string> names;
  for (const auto& l : r.logical_blobs()) {
    names.push_back(l.name);
    if (!pre.empty() && l.name.rfind(pre, 0) != 0) continue;
    if (pre.empty() && l.dtype == "bytes") continue;  // every numeric blob: opaque bytes are not a tensor
    Tensor t;
    t.blob = l.name;
    t.name = l.name.substr(pre.size());
    if (t.name.empty()) return Error{ErrorKind::kUsage, fmt::format("{}: blob '{}' has no name after the prefix '{}'", r.dir(), l.name, pre)};
    t.dtype = safetensors_dtype(l.dtype);
    if (t.dtype.empty())
      return Error{ErrorKind::kUsage, fmt::format("{}: blob '{}' has dtype {}, which safetensors cannot hold", r.dir(), l.name, l.dtype)};
    const std::uint64_t elem = dtype_size(l.dtype);
    t.size = l.size;
    t.shape = l.shape;
    // A blob saved without a shape is a scalar or a flat array.
    if (t.shape.empty() && t.size != elem) t.shape = {static_cast<std::int64_t>(t.size / elem)};
    std::uint64_t elems = 1;
    for (auto d : t.shape) {
      if (d < 0) return Error{ErrorKind::kConfig, fmt::format("{}: blob '{}' has a negative dimension", r.dir(), l.name)};
      elems *= static_cast<std::uint64_t>(d);
    }
    if (elems * elem != t.size)
      return Error{ErrorKind::kConfig, fmt::format("{}: blob '{}': shape and dtype make {} bytes, the blob has {}", r.dir(), l.name,
                                                   elems * elem, t.size)};
    out.push_back(std::move(t));
  }
  if (out.empty()) {
    std::string some;
    for (std::size_t i = 0; i < names.size() && i < 5; ++i) some += (i ? ", " : "") + names[i];
    if (names.size() > 5) some += ", ...";
    return Error{ErrorKind::kUsage, fmt::format("{}: no {} (blobs: {})", r.dir(),
                                                pre.empty() ? "numeric blobs" : fmt::format("numeric blobs named '{}...'", pre),
                                                some.empty() ? "none" : some)};
  }
  std::sort(out.begin(), out.end(), [](const Tensor& a, const Tensor& b) { return a.name < b.name; });
  return out;
}

json header_of(const std::vector<Tensor*>& ts) {
  json h = json::object();
  std::uint64_t off = 0;
  for (const Tensor* t : ts) {
    h[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {off, off + t->size}}};
    off += t->size;
  }
  h["__metadata__"] = {{"format", "pt"}};
  return h;
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// Reads the file back: the header must parse and equal what was meant, and
// every tensor's bytes must hash as the checkpoint's did.
Status check_file(const std::string& path, const std::vector<Tensor*>& ts, const json& want, std::vector<unsigned char>& buf) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot read back: {}", path, std::strerror(errno))};
  auto bad = [&](const std::string& why) {
    ::close(fd);
    return Error{ErrorKind::kIo, fmt::format("{}: read back: {}", path, why)};
  };
  auto read_at = [&](unsigned char* dst, std::uint64_t n, std::uint64_t off) {
    auto got = pread_full(fd, dst, n, off, path);
    return got && *got == n;
  };
  unsigned char len8[8];
  if (!read_at(len8, 8, 0)) return bad("shorter than 8 bytes");
  std::uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | len8[i];
  std::uint64_t data_bytes = 0;
  for (const Tensor* t : ts) data_bytes += t->size;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) != 8 + hlen + data_bytes)
    return bad(fmt::format("{} bytes, want {}", st.st_size, 8 + hlen + data_bytes));
  std::string text(hlen, '\0');
  if (!read_at(reinterpret_cast<unsigned char*>(text.data()), hlen, 8)) return bad("short header");
  json got = json::parse(text, nullptr, false);
  if (got.is_discarded() || got != want) return bad("header differs from the one written");
  std::uint64_t off = 8 + hlen;
  for (const Tensor* t : ts) {
    XXH3_state_t* h = XXH3_createState();
    XXH3_128bits_reset(h);
    bool ok = true;
    for (std::uint64_t done = 0; done < t->size && ok; done += kCopyBytes) {
      const std::uint64_t n = std::min(kCopyBytes, t->size - done);
      ok = read_at(buf.data(), n, off + done);
      if (ok) XXH3_128bits_update(h, buf.data(), n);
    }
    const XXH128_hash_t d = XXH3_128bits_digest(h);
    XXH3_freeState(h);
    if (!ok) return bad(fmt::format("short read in tensor '{}'", t->name));
    if (!XXH128_isEqual(d, t->hash)) return bad(fmt::format("tensor '{}' differs from blob '{}'", t->name, t->blob));
    off += t->size;
  }
  ::close(fd);
  return {};
}

std::optional<Failure> write_file(Reader& r, const std::string& path, const std::vector<Tensor*>& ts, std::vector<unsigned char>& buf) {
  const json header = header_of(ts);
  std::string text = header.dump();
  // Spaces pad the header so that the data starts 8-byte aligned.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  auto w = AtomicFileWriter::create(path);
  if (!w) return Failure{w.error()};
  const std::string len = le64(text.size());
  if (Status st = w->write(len.data(), len.size()); !st) return Failure{st.error()};
  if (Status st = w->write(text.data(), text.size()); !st) return Failure{st.error()};
  for (Tensor* t : ts) {
    XXH3_state_t* h = XXH3_createState();
    XXH3_128bits_reset(h);
    for (std::uint64_t done = 0; done < t->size; done += kCopyBytes) {
      const std::uint64_t n = std::min(kCopyBytes, t->size - done);
      if (Status st = r.read(t->blob, buf.data(), n, done); !st) {
        XXH3_freeState(h);
        return Failure{st.error(), true};
      }
      XXH3_128bits_update(h, buf.data(), n);
      if (Status st = w->write(buf.data(), n); !st) {
        XXH3_freeState(h);
        return Failure{st.error()};
      }
    }
    t->hash = XXH3_128bits_digest(h);
    XXH3_freeState(h);
  }
  if (Status st = w->commit(); !st) return Failure{st.error()};
  if (Status st = check_file(path, ts, header, buf); !st) return Failure{st.error()};
  return std::nullopt;
}

// An earlier export with another shard count must not be mixed with this one:
// loaders take model.safetensors before an index.
void remove_stale(const std::string& out_dir, const std::set<std::string>& keep) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (keep.count(name)) continue;
    if (name == kSingleFile || name == kIndexFile || std::regex_match(name, kShard)) fs::remove(e.path(), ec);
  }
}

Expected<ExportResult> export_one(Reader& r, const std::string& out_dir, const ExportOptions& o, bool* source_damaged) {
  if (o.max_shard_bytes == 0) return Error{ErrorKind::kUsage, "the maximum shard size must be positive"};
  auto selected = select(r, o);
  if (!selected) return selected.error();
  std::vector<Tensor>& ts = *selected;
  // Greedy, in name order: a new shard when the next tensor would overflow
  // this one; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<Tensor*>> shards(1);
  std::uint64_t in_shard = 0, total = 0;
  for (auto& t : ts) {
    if (!shards.back().empty() && in_shard + t.size > o.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += t.size;
    total += t.size;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (!fs::is_directory(out_dir)) return Error{ErrorKind::kIo, fmt::format("{}: cannot create: {}", out_dir, ec ? ec.message() : "not a directory")};
  std::vector<unsigned char> buf(static_cast<std::size_t>(std::min(kCopyBytes, std::max<std::uint64_t>(total, 1))));
  ExportResult out;
  out.step = r.manifest().step;
  out.tensors = ts.size();
  out.bytes = total;
  json weight_map = json::object();
  std::set<std::string> written;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string name =
        shards.size() == 1 ? std::string(kSingleFile) : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    const std::string path = (fs::path(out_dir) / name).string();
    if (auto f = write_file(r, path, shards[i], buf)) {
      *source_damaged = f->source_damaged;
      return f->error;
    }
    for (const Tensor* t : shards[i]) weight_map[t->name] = name;
    out.files.push_back(path);
    written.insert(name);
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string path = (fs::path(out_dir) / kIndexFile).string();
    if (Status st = write_file_atomic(path, index.dump(2) + "\n"); !st) return st.error();
    out.files.push_back(path);
    written.insert(kIndexFile);
  }
  remove_stale(out_dir, written);
  return out;
}

}  // namespace

Expected<ExportResult> export_safetensors(Reader& reader, const std::string& out_dir, const ExportOptions& options) {
  bool damaged = false;
  return export_one(reader, out_dir, options, &damaged);
}

Expected<ExportResult> export_safetensors(const std::string& root, std::optional<std::uint64_t> step, const std::string& out_dir,
                                          const ExportOptions& options) {
  if (!fs::is_directory(root)) return Error{ErrorKind::kUsage, fmt::format("{}: not a directory", root)};
  if (step) {
    auto r = Reader::open((fs::path(root) / step_dir_name(*step)).string());
    if (!r) return r.error();
    return export_safetensors(*r, out_dir, options);
  }
  std::vector<std::string> skipped;
  for (const auto& e : list(root, false)) {
    if (e.partial || e.damaged) continue;
    if (!e.committed) {
      skipped.push_back(fmt::format("step {}: {}", e.step, e.problem));
      continue;
    }
    auto r = Reader::open(e.path);
    if (!r) {
      skipped.push_back(fmt::format("step {}: {}", e.step, r.error().message));
      continue;
    }
    bool damaged = false;
    auto out = export_one(*r, out_dir, options, &damaged);
    if (!out && damaged) {
      skipped.push_back(fmt::format("step {}: {}", e.step, out.error().message));
      continue;
    }
    if (out) out->skipped = std::move(skipped);
    return out;
  }
  std::string why;
  for (const auto& s : skipped) why += "; " + s;
  return Error{ErrorKind::kUsage, fmt::format("{}: no checkpoint to export{}", root, why)};
}

}  // namespace pacer::ckpt
