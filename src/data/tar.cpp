// Tar shards: header parsing (ustar, pax, GNU) and writing (ustar, pax), WebDataset grouping and the per-shard index.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "pacer/core/atomic_file.hpp"
#include "pacer/data.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace fs = std::filesystem;

namespace {

Error shard_error(const std::string& path, std::uint64_t offset, const std::string& what) {
  return Error{ErrorKind::kConfig, fmt::format("{}: offset {}: {}", path, offset, what)};
}

// Octal, NUL/space terminated; or base-256 when the top bit is set (GNU, for
// sizes of 8 GiB and more).
bool parse_number(const unsigned char* p, std::size_t n, std::uint64_t& out) {
  out = 0;
  if (p[0] & 0x80) {
    if (p[0] != 0x80) return false;  // negative or too large
    for (std::size_t i = 1; i < n; ++i) out = (out << 8) | p[i];
    return true;
  }
  std::size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) {
    out = out * 8 + (p[i] - '0');
    any = true;
  }
  for (; i < n; ++i)
    if (p[i] != 0 && p[i] != ' ') return false;
  return any;
}

std::string field(const unsigned char* p, std::size_t n) {
  std::size_t len = 0;
  while (len < n && p[len]) ++len;
  return std::string(reinterpret_cast<const char*>(p), len);
}

bool checksum_ok(const unsigned char* h) {
  std::uint64_t stored = 0;
  if (!parse_number(h + 148, 8, stored)) return false;
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < kTarBlock; ++i) sum += (i >= 148 && i < 156) ? ' ' : h[i];
  return sum == stored;
}

// "27 path=some/long/name\n" records.
void parse_pax(const std::string& data, std::string& path, std::uint64_t& size, bool& has_size) {
  std::size_t pos = 0;
  while (pos < data.size()) {
    const std::size_t sp = data.find(' ', pos);
    if (sp == std::string::npos) break;
    const std::uint64_t len = std::strtoull(data.c_str() + pos, nullptr, 10);
    if (len == 0 || pos + len > data.size()) break;
    const std::string rec = data.substr(sp + 1, pos + len - sp - 2);  // drop the trailing newline
    const std::size_t eq = rec.find('=');
    if (eq != std::string::npos) {
      const std::string key = rec.substr(0, eq);
      if (key == "path") path = rec.substr(eq + 1);
      else if (key == "size") {
        size = std::strtoull(rec.c_str() + eq + 1, nullptr, 10);
        has_size = true;
      }
    }
    pos += len;
  }
}

class File {
 public:
  explicit File(const std::string& p) : fd_(::open(p.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

bool read_exact(int fd, void* buf, std::size_t n, std::uint64_t off) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
    off += static_cast<std::uint64_t>(r);
  }
  return true;
}

}  // namespace

bool escapes_root(std::string_view name) {
  if (name.empty() || name[0] == '/') return true;
  std::size_t pos = 0;
  while (pos <= name.size()) {
    std::size_t end = name.find('/', pos);
    if (end == std::string_view::npos) end = name.size();
    if (name.substr(pos, end - pos) == "..") return true;
    pos = end + 1;
  }
  return false;
}

Expected<std::vector<TarMember>> scan_tar(const std::string& path) {
  File f(path);
  if (f.fd() < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
  struct stat st {};
  ::fstat(f.fd(), &st);
  const std::uint64_t file_size = static_cast<std::uint64_t>(st.st_size);
  std::vector<TarMember> out;
  unsigned char h[kTarBlock];
  std::uint64_t off = 0;
  std::string long_name;
  std::string pax_path;
  std::uint64_t pax_size = 0;
  bool has_pax_size = false;
  // Offset of the first 'L'/'x' record before a member; kNone when there is none.
  constexpr std::uint64_t kNone = ~std::uint64_t{0};
  std::uint64_t first_header = kNone;
  for (;;) {
    if (off + kTarBlock > file_size) return shard_error(path, off, "truncated: the archive ends inside a header (no end-of-archive blocks)");
    if (!read_exact(f.fd(), h, kTarBlock, off)) return shard_error(path, off, "read failed");
    bool zero = true;
    for (unsigned char c : h) zero = zero && c == 0;
    if (zero) break;  // end of archive
    if (!checksum_ok(h)) return shard_error(path, off, "bad header checksum (corrupt or not a tar file)");
    std::uint64_t size = 0;
    if (!parse_number(h + 124, 12, size)) return shard_error(path, off, "bad size field");
    const char type = static_cast<char>(h[156]);
    if (has_pax_size && type != 'x' && type != 'g') size = pax_size;
    const std::uint64_t data_off = off + kTarBlock;
    if (data_off + size > file_size) return shard_error(path, off, fmt::format("truncated: member data of {} bytes runs past the end of the file", size));
    const std::uint64_t next = data_off + tar_padded(size);
    if (type == 'L' || type == 'x') {
      if (first_header == kNone) first_header = off;
      std::string data(size, '\0');
      if (!read_exact(f.fd(), data.data(), size, data_off)) return shard_error(path, off, "read failed");
      if (type == 'L') long_name = field(reinterpret_cast<const unsigned char*>(data.data()), data.size());
      else parse_pax(data, pax_path, pax_size, has_pax_size);
      off = next;
      continue;
    }
    if (type == '0' || type == '\0' || type == '7') {
      std::string name;
      if (!pax_path.empty()) name = pax_path;
      else if (!long_name.empty()) name = long_name;
      else {
        name = field(h, 100);
        // Only POSIX ustar ("ustar\0") has a name prefix there; old GNU headers
        // ("ustar  \0") keep atime and ctime in those bytes.
        const std::string prefix = std::memcmp(h + 257, "ustar", 6) == 0 ? field(h + 345, 155) : "";
        if (!prefix.empty()) name = prefix + "/" + name;
      }
      while (name.rfind("./", 0) == 0) name = name.substr(2);
      const std::uint64_t header_off = first_header == kNone ? off : first_header;
      if (escapes_root(name)) return shard_error(path, header_off, fmt::format("member '{}' escapes the archive root", name));
      out.push_back({name, header_off, data_off, size});
    }
    // Directories, links, devices, 'g' global headers: not samples.
    first_header = kNone;
    long_name.clear();
    pax_path.clear();
    has_pax_size = false;
    off = next;
  }
  return out;
}

std::vector<SampleEntry> group_samples(const std::vector<TarMember>& members) {
  std::vector<SampleEntry> out;
  for (const auto& m : members) {
    const std::size_t slash = m.name.rfind('/');
    const std::size_t base = slash == std::string::npos ? 0 : slash + 1;
    const std::size_t dot = m.name.find('.', base);
    const std::string key = dot == std::string::npos ? m.name : m.name.substr(0, dot);
    const std::string ext = dot == std::string::npos ? "" : m.name.substr(dot + 1);
    if (out.empty() || out.back().key != key) out.push_back({key, {}});
    out.back().fields.push_back({ext, m.offset, m.size});
  }
  return out;
}

// ---------------------------------------------------------------------------
// Writing (ustar, pax 'x' headers for long names)

namespace {

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

std::string ustar_block(std::string_view name, std::string_view prefix, std::uint64_t size, std::int64_t mtime, char type) {
  std::string h(kTarBlock, '\0');
  char* b = h.data();
  put_str(b, 100, name);
  put_octal(b + 100, 8, 0644);
  put_octal(b + 108, 8, 0);
  put_octal(b + 116, 8, 0);
  put_size(b + 124, size);
  // Negative mtimes are clamped; ones beyond 11 octal digits wrap rather than spill into the next field.
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

}  // namespace

std::string tar_member_headers(const std::string& name, std::uint64_t size, std::int64_t mtime) {
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
  out.append(tar_padded(records.size()) - records.size(), '\0');
  // The ustar name is only a fallback for readers without pax support.
  out += ustar_block(std::string_view(name).substr(0, 100), "", size, mtime, '0');
  return out;
}

// ---------------------------------------------------------------------------
// The per-shard index

std::string index_path(const std::string& shard) { return shard + ".pidx"; }

// Index file: "PACERIDX" magic, u32 version 1, u32 reserved, u64 shard size,
// u64 sample count, then per sample: u16 key length, key, u16 field count, and
// per field u16 ext length, ext, u64 offset, u64 size. Little-endian.
namespace {
constexpr char kMagic[8] = {'P', 'A', 'C', 'E', 'R', 'I', 'D', 'X'};
template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <class T>
bool take(const std::string& s, std::size_t& pos, T& v) {
  if (pos + sizeof(T) > s.size()) return false;
  std::memcpy(&v, s.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}
}  // namespace

namespace {

Expected<ShardIndex> scan_index(const std::string& shard) {
  auto members = scan_tar(shard);
  if (!members) return members.error();
  ShardIndex idx;
  idx.shard = shard;
  idx.shard_bytes = fs::file_size(shard);
  idx.entries = group_samples(*members);
  idx.samples = idx.entries.size();
  return idx;
}

Status write_index(const ShardIndex& idx) {
  std::string bin(kMagic, 8);
  put<std::uint32_t>(bin, 1);
  put<std::uint32_t>(bin, 0);
  put<std::uint64_t>(bin, idx.shard_bytes);
  put<std::uint64_t>(bin, idx.samples);
  for (const auto& e : idx.entries) {
    put<std::uint16_t>(bin, static_cast<std::uint16_t>(e.key.size()));
    bin += e.key;
    put<std::uint16_t>(bin, static_cast<std::uint16_t>(e.fields.size()));
    for (const auto& f : e.fields) {
      put<std::uint16_t>(bin, static_cast<std::uint16_t>(f.ext.size()));
      bin += f.ext;
      put<std::uint64_t>(bin, f.offset);
      put<std::uint64_t>(bin, f.size);
    }
  }
  return write_file_atomic(index_path(idx.shard), bin);
}

}  // namespace

Expected<ShardIndex> build_index(const std::string& shard) {
  auto idx = scan_index(shard);
  if (!idx) return idx.error();
  if (Status st = write_index(*idx); !st) return st.error();
  return idx;
}

Expected<ShardIndex> read_index(const std::string& shard, bool header_only) {
  const std::string path = index_path(shard);
  std::string bin;
  if (header_only) {
    File f(path);
    if (f.fd() < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
    bin.resize(32);
    if (!read_exact(f.fd(), bin.data(), 32, 0)) return Error{ErrorKind::kConfig, fmt::format("{}: truncated index", path)};
  } else {
    auto text = read_file(path);
    if (!text) return text.error();
    bin = std::move(*text);
  }
  std::size_t pos = 0;
  if (bin.size() < 32 || std::memcmp(bin.data(), kMagic, 8) != 0) return Error{ErrorKind::kConfig, fmt::format("{}: not a pacer shard index", path)};
  pos = 8;
  std::uint32_t version = 0, reserved = 0;
  ShardIndex idx;
  idx.shard = shard;
  take(bin, pos, version);
  take(bin, pos, reserved);
  take(bin, pos, idx.shard_bytes);
  take(bin, pos, idx.samples);
  if (version != 1) return Error{ErrorKind::kConfig, fmt::format("{}: index version {} (this pacer reads 1)", path, version)};
  std::error_code ec;
  const auto actual = fs::file_size(shard, ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", shard, ec.message())};
  if (actual != idx.shard_bytes)
    return Error{ErrorKind::kConfig, fmt::format("{}: index is for a {}-byte shard, the shard has {} bytes (rebuild with pacer shard index)", path, idx.shard_bytes, actual)};
  if (header_only) return idx;
  // Each entry takes at least 4 bytes: a corrupt count must not reserve absurd memory.
  idx.entries.reserve(std::min<std::uint64_t>(idx.samples, bin.size() / 4));
  for (std::uint64_t i = 0; i < idx.samples; ++i) {
    SampleEntry e;
    std::uint16_t klen = 0, nf = 0;
    if (!take(bin, pos, klen) || pos + klen > bin.size()) return Error{ErrorKind::kConfig, fmt::format("{}: truncated at sample {}", path, i)};
    e.key = bin.substr(pos, klen);
    pos += klen;
    if (!take(bin, pos, nf)) return Error{ErrorKind::kConfig, fmt::format("{}: truncated at sample {}", path, i)};
    for (std::uint16_t k = 0; k < nf; ++k) {
      Field f;
      std::uint16_t elen = 0;
      if (!take(bin, pos, elen) || pos + elen > bin.size()) return Error{ErrorKind::kConfig, fmt::format("{}: truncated at sample {}", path, i)};
      f.ext = bin.substr(pos, elen);
      pos += elen;
      if (!take(bin, pos, f.offset) || !take(bin, pos, f.size)) return Error{ErrorKind::kConfig, fmt::format("{}: truncated at sample {}", path, i)};
      if (f.offset + f.size > idx.shard_bytes) return Error{ErrorKind::kConfig, fmt::format("{}: sample {} points past the shard's end", path, i)};
      e.fields.push_back(std::move(f));
    }
    idx.entries.push_back(std::move(e));
  }
  return idx;
}

Expected<ShardIndex> load_or_build_index(const std::string& shard, bool header_only) {
  if (fs::exists(index_path(shard))) return read_index(shard, header_only);
  auto idx = scan_index(shard);
  if (!idx) return idx.error();
  // A read-only dataset directory still works; the index just stays in memory.
  (void)write_index(*idx);
  return idx;
}

}  // namespace pacer::data
