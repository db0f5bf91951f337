// Tar shards: header parsing (ustar, pax, GNU) and writing (ustar, pax), WebDataset grouping and the per-shard index.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/time.hpp"
#include "pacer/core/host_buffer.hpp"
#include "pacer/data.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace fs = std::filesystem;

namespace {

// For memory written whole right after it is allocated (an index's bytes,
// its table's arrays): 2 MiB pages where it spans them, and every page mapped
// in one call instead of a fault per page as it is first written. On the
// 2-core VM a first write cost 15 us per 4 KiB page faulted, 7.4 us
// populated first, 0.3 us in 2 MiB pages (bench/results/first_touch-2026-12-06.md).
void ready_for_writing(void* p, std::size_t bytes) {
  (void)advise_huge_pages(p, bytes);
  (void)prefault_for_write(p, bytes);
}

Error shard_error(const std::string& path, std::uint64_t offset, const std::string& what) {
  return Error{ErrorKind::kConfig, fmt::format("{}: offset {}: {}", path, offset, what)};
}

// Octal, NUL/space terminated; or base-256 when the top bit is set (GNU, for
// sizes of 8 GiB and more). A value that does not fit 64 bits is refused.
bool parse_number(const unsigned char* p, std::size_t n, std::uint64_t& out) {
  out = 0;
  if (p[0] & 0x80) {
    if (p[0] != 0x80) return false;  // negative or too large
    for (std::size_t i = 1; i < n; ++i) {
      if (out >> 56) return false;
      out = (out << 8) | p[i];
    }
    return true;
  }
  std::size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) {
    if (out >> 61) return false;
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

// A decimal byte count, digits only, that fits 64 bits.
bool parse_decimal(std::string_view s, std::uint64_t& out) {
  out = 0;
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const std::uint64_t d = static_cast<std::uint64_t>(c - '0');
    if (out > (~std::uint64_t{0} - d) / 10) return false;
    out = out * 10 + d;
  }
  return true;
}

struct PaxRecords {
  std::string path;
  std::uint64_t size = 0;
  bool has_size = false;
};

// "27 path=some/long/name\n" records. Returns what is wrong, or "" when every
// record is well formed. Sparse files (GNU.sparse.*) are refused: their data
// is a sparse map and pieces, not the file's bytes.
std::string parse_pax(std::string_view data, PaxRecords& out) {
  std::size_t pos = 0;
  while (pos < data.size()) {
    // Some writers pad the records with NULs to the block.
    if (data.find_first_not_of('\0', pos) == std::string_view::npos) break;
    const std::size_t sp = data.find(' ', pos);
    std::uint64_t len = 0;
    if (sp == std::string_view::npos || !parse_decimal(data.substr(pos, sp - pos), len))
      return fmt::format("malformed pax record at byte {}: no decimal length", pos);
    if (len > data.size() - pos) return fmt::format("pax record at byte {} claims {} bytes, past the header's end", pos, len);
    const std::size_t end = pos + static_cast<std::size_t>(len);  // one past the record's newline
    if (end < sp + 2 || data[end - 1] != '\n') return fmt::format("malformed pax record at byte {}: not 'LEN key=value\\n'", pos);
    const std::string_view rec = data.substr(sp + 1, end - 1 - (sp + 1));
    const std::size_t eq = rec.find('=');
    if (eq == std::string_view::npos || eq == 0) return fmt::format("malformed pax record at byte {}: no key=value", pos);
    const std::string_view key = rec.substr(0, eq), value = rec.substr(eq + 1);
    if (key == "path") {
      out.path = std::string(value);
    } else if (key == "size") {
      if (!parse_decimal(value, out.size)) return fmt::format("pax size '{}' is not a byte count", value);
      out.has_size = true;
    } else if (key.starts_with("GNU.sparse.")) {
      return fmt::format("a GNU sparse file (pax record {}): sparse members are not supported; pack the file without --sparse", key);
    }
    pos = end;
  }
  return "";
}

// Whether all n bytes at off could be read; the callers name the shard and member.
bool read_exact(int fd, void* buf, std::size_t n, std::uint64_t off) {
  auto got = pread_full(fd, buf, n, off, "");
  return got && *got == n;
}

// The member name resolved from a pax path, a GNU long name or the header.
std::string member_name(const unsigned char* h, const PaxRecords& pax, const std::string& long_name) {
  std::string name;
  if (!pax.path.empty()) name = pax.path;
  else if (!long_name.empty()) name = long_name;
  else {
    name = field(h, 100);
    // Only POSIX ustar ("ustar\0") has a name prefix there; old GNU headers
    // ("ustar  \0") keep atime and ctime in those bytes.
    const std::string prefix = std::memcmp(h + 257, "ustar", 6) == 0 ? field(h + 345, 155) : "";
    if (!prefix.empty()) name = prefix + "/" + name;
  }
  while (name.rfind("./", 0) == 0) name = name.substr(2);
  return name;
}

// Every size read from a header is checked against the bytes the file really
// has left before it is added to an offset or allocated, so a crafted size
// can neither wrap an offset nor reserve memory the file does not back.
Expected<std::vector<TarMember>> scan_fd(int fd, const std::string& path, std::uint64_t file_size, const MappedFile* map = nullptr) {
  // Through `map` (the same file mapped) where there is one: see scan_index.
  auto read_at = [&](void* dst, std::size_t n, std::uint64_t at) {
    return map ? static_cast<bool>(map->copy(at, n, dst)) : read_exact(fd, dst, n, at);
  };
  std::vector<TarMember> out;
  unsigned char h[kTarBlock];
  std::uint64_t off = 0;
  std::string long_name;
  PaxRecords pax;
  // Offset of the first 'L'/'x' record before a member; kNone when there is none.
  constexpr std::uint64_t kNone = ~std::uint64_t{0};
  std::uint64_t first_header = kNone;
  for (;;) {
    if (off > file_size || file_size - off < kTarBlock)
      return shard_error(path, off, "truncated: the archive ends inside a header (no end-of-archive blocks)");
    if (!read_at(h, kTarBlock, off)) return shard_error(path, off, "read failed");
    bool zero = true;
    for (unsigned char c : h) zero = zero && c == 0;
    if (zero) break;  // end of archive
    if (!checksum_ok(h)) return shard_error(path, off, "bad header checksum (corrupt or not a tar file)");
    std::uint64_t size = 0;
    if (!parse_number(h + 124, 12, size)) return shard_error(path, off, "bad size field");
    const char type = static_cast<char>(h[156]);
    const bool meta = type == 'x' || type == 'g' || type == 'L' || type == 'K';
    if (pax.has_size && !meta) size = pax.size;
    const std::uint64_t data_off = off + kTarBlock;
    if (size > file_size - data_off)
      return shard_error(path, off, fmt::format("truncated: member data of {} bytes runs past the end of the file ({} bytes)", size, file_size));
    const std::uint64_t next = data_off + tar_padded(size);  // no wrap: size < file_size < 2^63
    if (type == 'L' || type == 'x') {
      const std::uint64_t limit = type == 'L' ? kMaxMemberName + 1 : kMaxPaxHeader;
      if (size > limit)
        return shard_error(path, off, fmt::format("{} of {} bytes (at most {})", type == 'L' ? "GNU long name" : "pax header", size, limit));
      if (first_header == kNone) first_header = off;
      std::string data(static_cast<std::size_t>(size), '\0');
      if (!read_at(data.data(), data.size(), data_off)) return shard_error(path, off, "read failed");
      if (type == 'L') {
        long_name = field(reinterpret_cast<const unsigned char*>(data.data()), data.size());
      } else if (std::string bad = parse_pax(data, pax); !bad.empty()) {
        return shard_error(path, off, fmt::format("pax header '{}': {}", field(h, 100), bad));
      }
      off = next;
      continue;
    }
    if (type == 'K' || type == 'g') {
      // A link target's long name, or a global pax header: records of their
      // own, not members, so a pending long name or pax path is kept for
      // the member that follows.
      if (first_header == kNone) first_header = off;
      off = next;
      continue;
    }
    const std::uint64_t header_off = first_header == kNone ? off : first_header;
    if (type == '0' || type == '\0' || type == '7' || type == 'S' || type == 'M') {
      const std::string name = member_name(h, pax, long_name);
      // A regular-file type with a trailing '/' is how pre-POSIX tars wrote
      // directories; GNU tar and Python's tarfile read it as one.
      const bool old_directory = (type == '0' || type == '\0') && !name.empty() && name.back() == '/';
      if (type == 'S')
        return shard_error(path, header_off, fmt::format("member '{}' is a GNU sparse file (type S): not supported; pack it without --sparse", name));
      if (type == 'M')
        return shard_error(path, header_off, fmt::format("member '{}' continues a multi-volume archive (type M): not supported", name));
      if (escapes_root(name)) return shard_error(path, header_off, fmt::format("member '{}' escapes the archive root", name));
      if (name.size() > kMaxMemberName)
        return shard_error(path, header_off, fmt::format("member name of {} bytes (at most {})", name.size(), kMaxMemberName));
      if (!old_directory) out.push_back({name, header_off, data_off, size});
    }
    // Directories, links, devices: not samples.
    first_header = kNone;
    long_name.clear();
    pax = PaxRecords{};
    off = next;
  }
  return out;
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

namespace {
// Shards from this size (a huge page) up are mapped before their first bytes
// are read (shard_data).
constexpr std::uint64_t kMappedMagicMin = 2u << 20;

Expected<ShardData> shard_data(Fd f, const std::string& path, std::uint64_t file_bytes) {
  ShardData d;
  // The gzip magic is read through the shard's mapping (advised as huge
  // pages, MappedFile::map), which the caller then reads through too: a
  // 2-byte pread of a shard not yet cached starts the file's readahead,
  // which left its first 2-16 MiB in small folios, and every later mapping
  // of the shard (each process, each dataset opened again) then fills a
  // page-table entry per 4 KiB there instead of one per 2 MiB
  // (bench/results/loader_fresh-2026-12-05.md). The cost: the first read of
  // a cold shard brings in its first 2-4 MiB, which a full epoch reads anyway.
  std::optional<bool> gz;
  if (file_bytes >= kMappedMagicMin)
    if (auto m = MappedFile::map(f.get(), path); m && m->size() >= 2) {
      unsigned char magic[2] = {0, 0};
      if (m->copy(0, 2, magic)) {
        gz = magic[0] == 0x1f && magic[1] == 0x8b;
        // A file that changed size since its fstat keeps no mapping: its
        // readers would bound themselves by file_bytes, not by the mapping.
        if (!*gz && m->size() == file_bytes) d.map = std::make_shared<const MappedFile>(std::move(*m));
      }
    }
  if (!gz) {
    // Small, or the mapping failed (address space, a file system without
    // mmap, a file cut meanwhile): a pread says why, if anything is wrong.
    auto got = is_gzip(f.get(), path);
    if (!got) return got.error();
    gz = *got;
  }
  if (!*gz) {
    d.fd = std::move(f);
    d.tar_bytes = file_bytes;
    return d;
  }
  auto mem = gunzip_to_memory(f.get(), path, gzip_shard_limit(), d.tar_bytes);
  if (!mem) return mem.error();
  d.fd = std::move(*mem);
  d.gzip = true;
  return d;
}
std::int64_t mtime_ns(const struct stat& st) { return ns_of(st.st_mtim); }
}  // namespace

Expected<ShardData> open_shard_data(const std::string& path) {
  auto f = open_fd(path, O_RDONLY);
  if (!f) return f.error();
  struct stat st {};
  if (::fstat(f->get(), &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", path, std::strerror(errno))};
  if (!S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", path)};
  auto d = shard_data(std::move(*f), path, static_cast<std::uint64_t>(st.st_size));
  if (d) {
    d->file_bytes = static_cast<std::uint64_t>(st.st_size);
    d->mtime_ns = mtime_ns(st);
  }
  return d;
}

Expected<std::vector<TarMember>> scan_tar(const std::string& path) {
  auto d = open_shard_data(path);
  if (!d) return d.error();
  return scan_fd(d->fd.get(), path, d->tar_bytes);
}

// Members of one key form one sample wherever they lie in the shard: GNU tar
// writes a directory in its own order (a.txt, b.txt, a.json, b.json), and
// grouping only runs of equal keys would split such samples silently.
// Samples keep the order of their keys' first appearance.
Expected<std::vector<SampleEntry>> group_samples(const std::string& shard, const std::vector<TarMember>& members) {
  std::vector<SampleEntry> out;
  std::unordered_map<std::string, std::size_t> sample_of;  // key -> its place in `out`
  // "SAMPLE/EXT" for every field seen: unambiguous, as an extension has no '/'.
  std::unordered_set<std::string> seen;
  for (const auto& m : members) {
    const std::size_t slash = m.name.rfind('/');
    const std::size_t base = slash == std::string::npos ? 0 : slash + 1;
    const std::size_t dot = m.name.find('.', base);
    std::string key = dot == std::string::npos ? m.name : m.name.substr(0, dot);
    std::string ext = dot == std::string::npos ? "" : m.name.substr(dot + 1);
    auto [at, added] = sample_of.try_emplace(key, out.size());
    if (added) out.push_back({std::move(key), {}});
    SampleEntry& e = out[at->second];
    // A reader keyed by extension could only keep one of the two: refuse rather than pick.
    if (!seen.insert(fmt::format("{}/{}", at->second, ext)).second)
      return shard_error(shard, m.header_offset, fmt::format("sample '{}' has field '{}' twice", e.key, ext));
    if (e.fields.size() == kMaxSampleFields)
      return shard_error(shard, m.header_offset, fmt::format("sample '{}' has more than {} fields", e.key, kMaxSampleFields));
    e.fields.push_back({std::move(ext), m.offset, m.size});
  }
  return out;
}

// ---------------------------------------------------------------------------
// SampleTable

void SampleTable::reserve(std::size_t samples, std::size_t fields, std::size_t key_bytes) {
  keys_.reserve(key_bytes);
  key_at_.reserve(samples + 1);
  first_.reserve(samples + 1);
  fields_.reserve(fields);
  ready_for_writing(keys_.data(), keys_.capacity());
  ready_for_writing(key_at_.data(), key_at_.capacity() * sizeof(std::uint64_t));
  ready_for_writing(first_.data(), first_.capacity() * sizeof(std::uint64_t));
  ready_for_writing(fields_.data(), fields_.capacity() * sizeof(FieldRow));
}

void SampleTable::add_sample(std::string_view key) {
  if (key_at_.empty()) key_at_.push_back(0);  // moved from
  if (first_.empty()) first_.push_back(0);
  keys_ += key;
  key_at_.push_back(keys_.size());
  first_.push_back(fields_.size());
}

void SampleTable::add_field(std::string_view ext, std::uint64_t offset, std::uint64_t size) {
  if (this->size() == 0) add_sample("");
  // A shard's samples share a few extensions, usually in the same order in
  // every sample: the one after the last one's is the likely one, then the
  // last one's. Otherwise the first kSearched distinct ones are searched;
  // past them (a crafted index, or samples of very many fields) a new
  // extension is added without looking further, so that no input costs more
  // than kSearched comparisons per field (a hash map could be made to
  // collide on every key by a crafted index).
  constexpr std::size_t kSearched = 64;
  std::uint32_t x = last_ext_ + 1;
  if (x >= exts_.size() || exts_[x] != ext) {
    x = last_ext_;
    if (x >= exts_.size() || exts_[x] != ext) {
      x = 0;
      const std::size_t n = std::min(kSearched, exts_.size());
      while (x < n && exts_[x] != ext) ++x;
      if (x == n) {
        x = static_cast<std::uint32_t>(exts_.size());
        exts_.emplace_back(ext);
      }
    }
  }
  last_ext_ = x;
  fields_.push_back({offset, size, x});
  first_.back() = fields_.size();
}

SampleEntry SampleTable::entry(std::size_t i) const {
  SampleEntry e;
  e.key = key(i);
  e.fields.reserve(field_count(i));
  for (const FieldRow* f = fields_begin(i); f != fields_end(i); ++f) e.fields.push_back({exts_[f->ext], f->offset, f->size});
  return e;
}

std::vector<SampleEntry> SampleTable::entries() const {
  std::vector<SampleEntry> out;
  out.reserve(size());
  for (std::size_t i = 0; i < size(); ++i) out.push_back(entry(i));
  return out;
}

SampleTable SampleTable::of(const std::vector<SampleEntry>& entries) {
  SampleTable t;
  std::size_t fields = 0, key_bytes = 0;
  for (const auto& e : entries) {
    fields += e.fields.size();
    key_bytes += e.key.size();
  }
  t.reserve(entries.size(), fields, key_bytes);
  for (const auto& e : entries) {
    t.add_sample(e.key);
    for (const auto& f : e.fields) t.add_field(f.ext, f.offset, f.size);
  }
  return t;
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

// Index file, version 5 (docs/data.md): a 96-byte header, then per sample u16
// key length, key, u16 field count, and per field u16 ext length, ext, u64
// offset, u64 size. Little-endian. The header binds the index to its shard
// (size, mtime, an XXH3-64 of every byte between the fields' data, and the
// inode and change time the shard had when that hash last matched) and
// checksums itself and the entries, so a flipped bit, or a shard rewritten
// under its index, is found instead of pairing keys with other samples' bytes.
namespace {

constexpr char kMagic[8] = {'P', 'A', 'C', 'E', 'R', 'I', 'D', 'X'};
// Versions 1-3 are rebuilt, never trusted: a version 2 index may hold
// samples split where their members were not adjacent (group_samples grouped
// runs of equal keys then), and a version 3 index's header hash covered only
// the ustar header in front of each field (member_headers_hash). A version 4
// index (a 64-byte header: no inode, change time or hash time; its header
// checksum at 56) is read, its headers always hashed, and written back as
// version 5 where it can be.
constexpr std::uint32_t kIndexVersion = 5;
constexpr std::size_t kIndexHeader = 96;
constexpr std::size_t kIndexHeaderV4 = 64;
// Header fields by offset.
constexpr std::size_t kAtVersion = 8, kAtShardBytes = 16, kAtSamples = 24, kAtMtime = 32, kAtHeaders = 40, kAtEntries = 48, kAtIno = 56,
                      kAtCtime = 64, kAtHashedAt = 72, kAtSelf = 88;
// A shard whose change time is this close to the moment its headers were
// hashed may have changed again within the same timestamp tick (ext4 keeps
// coarse times; some NFS servers whole seconds), so that binding is not
// trusted to skip the hash.
constexpr std::int64_t kSettledNs = 2'000'000'000;
// Shards from this size up are scanned through a mapping (scan_index).
constexpr std::uint64_t kScanMappedMin = 4u << 20;

template <class T>
void put_at(std::string& s, std::size_t pos, T v) {
  std::memcpy(s.data() + pos, &v, sizeof(T));
}
template <class T>
T get_at(const std::string& s, std::size_t pos) {
  return load<T>(s.data() + pos);
}
template <class T>
bool take(const std::string& s, std::size_t& pos, T& v) {
  if (sizeof(T) > s.size() - pos) return false;
  std::memcpy(&v, s.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

std::uint64_t xxh3(const char* p, std::size_t n) { return XXH3_64bits(p, n); }

// Reads `samples` records of an index's entries from bin[pos]: per sample
// u16 key length, key, u16 field count, then per field u16 extension
// length, extension, u64 offset, u64 size. Calls on_sample(key) and
// on_field(sample, key, ext, offset, size), which returns false to stop.
// Returns the number of samples read whole: fewer than `samples` where the
// bytes ran out (pos is then inside that sample) or on_field stopped.
template <class OnSample, class OnField>
std::uint64_t read_records(const std::string& bin, std::size_t& pos, std::uint64_t samples, OnSample&& on_sample, OnField&& on_field) {
  for (std::uint64_t i = 0; i < samples; ++i) {
    std::uint16_t klen = 0, nf = 0;
    if (!take(bin, pos, klen) || klen > bin.size() - pos) return i;
    const std::string_view key(bin.data() + pos, klen);
    pos += klen;
    if (!take(bin, pos, nf)) return i;
    on_sample(key);
    for (std::uint16_t k = 0; k < nf; ++k) {
      std::uint16_t elen = 0;
      std::uint64_t offset = 0, size = 0;
      if (!take(bin, pos, elen) || elen > bin.size() - pos) return i;
      const std::string_view ext(bin.data() + pos, elen);
      pos += elen;
      if (!take(bin, pos, offset) || !take(bin, pos, size)) return i;
      if (!on_field(i, key, ext, offset, size)) return i;
    }
  }
  return samples;
}

// An open shard and what fstat says of it; its tar bytes once open_data ran
// (for a gzip shard, decompressed into memory then).
struct OpenShard {
  Fd file;
  std::uint64_t bytes = 0;
  std::int64_t mtime_ns = 0;
  std::uint64_t ino = 0;
  std::int64_t ctime_ns = 0;
  std::int64_t stat_at_ns = 0;  // the wall clock just after the fstat
  ShardData data;
};

Status open_data(OpenShard& s, const std::string& shard) {
  auto d = shard_data(std::move(s.file), shard, s.bytes);
  if (!d) return d.error();
  s.data = std::move(*d);
  return {};
}

Expected<OpenShard> open_shard(const std::string& shard) {
  OpenShard s;
  auto fd = open_fd(shard, O_RDONLY);
  if (!fd) return fd.error();
  s.file = std::move(*fd);
  struct stat st {};
  if (::fstat(s.file.get(), &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", shard, std::strerror(errno))};
  if (!S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", shard)};
  s.bytes = static_cast<std::uint64_t>(st.st_size);
  s.mtime_ns = mtime_ns(st);
  s.ino = static_cast<std::uint64_t>(st.st_ino);
  s.ctime_ns = ns_of(st.st_ctim);
  s.stat_at_ns = static_cast<std::int64_t>(wall_now() * 1e9);
  return s;
}

// Records in `idx` the inode and change time `s` had before its headers were
// hashed (and matched), which lets later reads skip the hash.
void bind_inode(ShardIndex& idx, const OpenShard& s) {
  idx.shard_ino = s.ino;
  idx.shard_ctime_ns = s.ctime_ns;
  idx.headers_hashed_at_ns = s.stat_at_ns;
}

// The shard has not changed since its headers were hashed: same inode, and a
// change time that was already settled then (a write, truncate, rename or
// utimes all set the change time to the current time, which no caller can
// set back).
bool settled(std::int64_t ctime_ns, std::int64_t at_ns) {
  // Compared without subtracting below INT64_MIN (the index's fields are read from disk).
  return at_ns >= std::numeric_limits<std::int64_t>::min() + kSettledNs && ctime_ns <= at_ns - kSettledNs;
}
bool unchanged_since_hashed(const ShardIndex& idx, const OpenShard& s) {
  return idx.shard_ino != 0 && s.ino == idx.shard_ino && s.ctime_ns == idx.shard_ctime_ns && settled(idx.shard_ctime_ns, idx.headers_hashed_at_ns);
}

// XXH3-64 of every byte of the shard that is not a field's data, in file
// order: the gaps before, between and after the fields' (padded) data. They
// hold each member's ustar header and the pax ('x') and GNU long-name ('L')
// records before it, which set its name and size, so a rewrite that keeps
// the shard's size and mtime but renames or resizes a member is caught
// (index version 3 hashed only the 512-byte ustar header in front of each
// field). For the usual layout the gaps are exactly those headers.
struct Gap {
  std::uint64_t offset = 0, size = 0;
};

// The gaps of a shard's samples in its `tar_bytes`, or the sample whose
// field overlaps another or runs past the end (an index that does not fit).
struct Gaps {
  std::vector<Gap> gaps;
  bool bad = false;
  std::size_t bad_sample = 0;
  std::uint64_t bad_offset = 0;
};

// Calls gap(offset, size) for each gap of `t` in offset order and returns
// true, or sets out's bad sample and returns false. A shard written in key
// order (every writer that keeps a sample together) has its fields in
// offset order already and is walked as it is: the list of every field this
// built before (and sorted when out of order), grown one field at a time,
// was fresh heap whose page faults a fresh epoch's first batch paid on the
// VM; only a scattered shard's fields are listed and sorted.
template <class OnGap>
bool walk_gaps(const SampleTable& t, std::uint64_t tar_bytes, Gaps& out, OnGap&& gap) {
  std::uint64_t at = 0;
  // A member's data follows at least its own 512-byte header. Fields are
  // checked to lie inside the shard before this runs; padding may pass its end.
  auto next = [&](std::uint64_t offset, std::uint64_t size, std::size_t sample) {
    if (offset < at + kTarBlock || offset > tar_bytes) {
      out.bad = true;
      out.bad_sample = sample;
      out.bad_offset = offset;
      return false;
    }
    gap(at, offset - at);
    at = std::min(tar_bytes, offset + tar_padded(size));
    return true;
  };
  bool sorted = true;
  std::uint64_t last = 0;
  for (std::size_t i = 0; i < t.size() && sorted; ++i)
    for (const auto* f = t.fields_begin(i); f != t.fields_end(i); ++f) {
      sorted = sorted && f->offset >= last;
      last = f->offset;
    }
  if (sorted) {
    for (std::size_t i = 0; i < t.size(); ++i)
      for (const auto* f = t.fields_begin(i); f != t.fields_end(i); ++f)
        if (!next(f->offset, f->size, i)) return false;
  } else {
    struct Span {
      std::uint64_t offset, size;
      std::size_t sample;
    };
    std::vector<Span> spans;
    spans.reserve(t.total_fields());
    for (std::size_t i = 0; i < t.size(); ++i)
      for (const auto* f = t.fields_begin(i); f != t.fields_end(i); ++f) spans.push_back({f->offset, f->size, i});
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.offset < b.offset; });
    for (const auto& sp : spans)
      if (!next(sp.offset, sp.size, sp.sample)) return false;
  }
  if (at < tar_bytes) gap(at, tar_bytes - at);
  return true;
}

Gaps shard_gaps(const SampleTable& t, std::uint64_t tar_bytes) {
  Gaps out;
  out.gaps.reserve(t.total_fields() + 1);
  walk_gaps(t, tar_bytes, out, [&](std::uint64_t offset, std::uint64_t size) { out.gaps.push_back({offset, size}); });
  return out;
}

struct MappedGaps {
  const std::vector<Gap>* gaps;
  XXH3_state_t* state;
  bool outside = false;  // a gap past the mapping
};

// Hashes the gaps where they lie in the mapping, in one guarded read. Each
// is usually one 512-byte header on a page of its own (a sample's data
// between them), so each is a cache miss: prefetching a few ahead overlaps them.
void hash_mapped_gaps(const unsigned char* base, std::size_t n, void* ctx) {
  auto* h = static_cast<MappedGaps*>(ctx);
  const std::vector<Gap>& gaps = *h->gaps;
  constexpr std::size_t kAhead = 8;
  for (std::size_t i = 0; i < gaps.size(); ++i) {
    if (gaps[i].offset > n || gaps[i].size > n - gaps[i].offset) {
      h->outside = true;
      return;
    }
    if (i + kAhead < gaps.size() && gaps[i + kAhead].offset <= n - std::min<std::size_t>(n, kTarBlock))
      for (std::size_t line = 0; line < kTarBlock; line += 64) __builtin_prefetch(base + gaps[i + kAhead].offset + line);
    XXH3_64bits_update(h->state, base + gaps[i].offset, static_cast<std::size_t>(gaps[i].size));
  }
}

// The error naming the sample whose field overlaps another member or has no
// header before it: every index is held to this, hashed or not.
Error misfit(const std::string& shard, const SampleTable& t, const Gaps& g) {
  return Error{ErrorKind::kConfig, fmt::format("{}: sample '{}': a field at offset {} overlaps another member or has no header before it", shard,
                                               t.key(g.bad_sample), g.bad_offset)};
}

Expected<Gaps> fitting_gaps(const std::string& shard, const SampleTable& t, std::uint64_t tar_bytes) {
  Gaps g = shard_gaps(t, tar_bytes);
  if (g.bad) return misfit(shard, t, g);
  return g;
}

// fitting_gaps' check alone, for an index whose hash is not read again:
// nothing is allocated for a shard in key order.
Status fits(const std::string& shard, const SampleTable& t, std::uint64_t tar_bytes) {
  Gaps g;
  if (!walk_gaps(t, tar_bytes, g, [](std::uint64_t, std::uint64_t) {})) return misfit(shard, t, g);
  return {};
}

// With `map` (the same shard mapped), the gaps are hashed in the mapping: a
// pread per member was most of a shard's first read (10,000 system calls
// for a shard of 5,000 two-field samples), and the page faults taken here
// fill the page tables the loader's reads then use.
Expected<std::uint64_t> member_headers_hash(int fd, const std::string& shard, const SampleTable& entries, std::uint64_t tar_bytes,
                                            const MappedFile* map = nullptr) {
  auto fit = fitting_gaps(shard, entries, tar_bytes);
  if (!fit) return fit.error();
  const Gaps& g = *fit;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(st.get());
  if (map) {
    MappedGaps h{&g.gaps, st.get()};
    if (Status read = map->read(0, static_cast<std::size_t>(map->size()), hash_mapped_gaps, &h); !read)
      return Error{ErrorKind::kIo, fmt::format("{}: cannot read the member headers: {}", shard, read.error().message)};
    if (h.outside) return Error{ErrorKind::kIo, fmt::format("{}: cannot read the member headers: the shard is shorter than its index says", shard)};
    // A cut inside a page reads as zeros there instead of faulting.
    if (Status size = map->check_size(map->size()); !size) return size.error();
    return static_cast<std::uint64_t>(XXH3_64bits_digest(st.get()));
  }
  // Gaps are read in pieces: one may hold a large pax header or skipped member.
  std::vector<unsigned char> buf(64 * 1024);
  for (const auto& gap : g.gaps)
    for (std::uint64_t done = 0; done < gap.size;) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), gap.size - done));
      if (!read_exact(fd, buf.data(), n, gap.offset + done))
        return Error{ErrorKind::kIo, fmt::format("{}: offset {}: cannot read the member headers", shard, gap.offset + done)};
      XXH3_64bits_update(st.get(), buf.data(), n);
      done += n;
    }
  return static_cast<std::uint64_t>(XXH3_64bits_digest(st.get()));
}

Expected<TableIndex> scan_index(const std::string& shard) {
  auto s = open_shard(shard);
  if (!s) return s.error();
  if (Status st = open_data(*s, shard); !st) return st.error();
  // A shard of several huge pages is scanned through a mapping (advised as
  // huge pages, MappedFile::map): read from the disk that way, it comes into
  // the page cache in 2 MiB folios, which the loader's mappings then fill a
  // page-table entry at a time per 2 MiB; a pread per member header cached
  // it in small folios, and a fresh mapping of a 56 MiB shard took 57-63 ms
  // to read through after that scan (bench/results/loader_folios-2026-12-05.md).
  // Not for a gzip shard (its bytes are in memory) or a small one.
  const MappedFile* through = s->data.tar_bytes >= kScanMappedMin ? s->data.map.get() : nullptr;
  auto members = scan_fd(s->data.fd.get(), shard, s->data.tar_bytes, through);
  if (!members) return members.error();
  auto entries = group_samples(shard, *members);
  if (!entries) return entries.error();
  TableIndex out;
  out.table = SampleTable::of(*entries);
  std::vector<SampleEntry>().swap(*entries);
  auto headers = member_headers_hash(s->data.fd.get(), shard, out.table, s->data.tar_bytes, through);
  if (!headers) return headers.error();
  ShardIndex& idx = out.head;
  idx.shard = shard;
  idx.shard_bytes = s->bytes;
  idx.shard_mtime_ns = s->mtime_ns;
  idx.headers_xxh3 = *headers;
  bind_inode(idx, *s);
  idx.samples = out.table.size();
  return out;
}

Expected<std::string> index_image(const ShardIndex& idx, const SampleTable& t) {
  std::string bin(kIndexHeader, '\0');
  for (std::size_t i = 0; i < t.size(); ++i) {
    const std::string_view key = t.key(i);
    // scan_fd and group_samples hold names and field counts to these limits.
    if (key.size() > 0xffff || t.field_count(i) > 0xffff)
      return Error{ErrorKind::kRuntime, fmt::format("{}: sample '{}' does not fit the index format", idx.shard, key)};
    put<std::uint16_t>(bin, static_cast<std::uint16_t>(key.size()));
    bin += key;
    put<std::uint16_t>(bin, static_cast<std::uint16_t>(t.field_count(i)));
    for (const auto* f = t.fields_begin(i); f != t.fields_end(i); ++f) {
      const std::string& ext = t.ext(f->ext);
      if (ext.size() > 0xffff) return Error{ErrorKind::kRuntime, fmt::format("{}: sample '{}' does not fit the index format", idx.shard, key)};
      put<std::uint16_t>(bin, static_cast<std::uint16_t>(ext.size()));
      bin += ext;
      put<std::uint64_t>(bin, f->offset);
      put<std::uint64_t>(bin, f->size);
    }
  }
  std::memcpy(bin.data(), kMagic, 8);
  put_at<std::uint32_t>(bin, kAtVersion, kIndexVersion);
  put_at<std::uint64_t>(bin, kAtShardBytes, idx.shard_bytes);
  put_at<std::uint64_t>(bin, kAtSamples, idx.samples);
  put_at<std::int64_t>(bin, kAtMtime, idx.shard_mtime_ns);
  put_at<std::uint64_t>(bin, kAtHeaders, idx.headers_xxh3);
  put_at<std::uint64_t>(bin, kAtIno, idx.shard_ino);
  put_at<std::int64_t>(bin, kAtCtime, idx.shard_ctime_ns);
  put_at<std::int64_t>(bin, kAtHashedAt, idx.headers_hashed_at_ns);
  put_at<std::uint64_t>(bin, kAtEntries, xxh3(bin.data() + kIndexHeader, bin.size() - kIndexHeader));
  put_at<std::uint64_t>(bin, kAtSelf, xxh3(bin.data(), kAtSelf));
  return bin;
}

Status write_index(const ShardIndex& idx, const SampleTable& t) {
  auto bin = index_image(idx, t);
  if (!bin) return bin.error();
  // A cache: checksummed and bound to its shard, so one lost or torn in a
  // crash is found when read and rebuilt; an fsync per index would dominate
  // the first open of thousands of shards.
  return write_file_atomic(index_path(idx.shard), *bin, Durability::kCache);
}

// Reads and checks SHARD.pidx. A problem with the index itself or its fit to
// the shard is kConfig (a rebuild fixes it); one reading either file is kIo.
// The member headers are compared when the entries are read (unless the
// shard's inode and change time are still those recorded when they last
// matched), and also for a header-only read when the shard's mtime is not
// the indexed one (a copy that did not keep mtimes): after a comparison that
// matched, `refreshed` is set when the index returned carries a binding
// worth writing back (the shard's current mtime, inode and change time).
// Where an index's bytes lie: all of SHARD.pidx, or one record of the
// directory index.
struct IndexSource {
  std::string name;  // for messages
  int fd = -1;
  std::uint64_t base = 0, size = 0;
  // The change time of the file the index was written into after its hash
  // (for a record, the file system's time of the hash, estimated when its
  // directory index was written: docs/data.md).
  std::int64_t written_ctime_ns = 0;
  // A record: a header-only read also hashes a shard whose binding does not
  // let the hash be skipped, once the shard has settled, so that the
  // rebound record is written with the others at open (a loader's first
  // read rebinds a SHARD.pidx in place, but not a record).
  bool settle = false;
};

Expected<TableIndex> check_index(const std::string& shard, const IndexSource& src, bool header_only, bool* refreshed, bool* outdated,
                                 const MappedFile* map) {
  const std::string& path = src.name;
  auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {}", path, why)}; };
  auto read_at = [&](void* buf, std::size_t n, std::uint64_t off) { return read_exact(src.fd, buf, n, src.base + off); };
  const std::uint64_t isize = src.size;
  std::string bin(static_cast<std::size_t>(std::min<std::uint64_t>(isize, kIndexHeader)), '\0');
  if (!read_at(bin.data(), bin.size(), 0)) return Error{ErrorKind::kIo, fmt::format("{}: read failed", path)};
  if (bin.size() < 12 || std::memcmp(bin.data(), kMagic, 8) != 0) return bad("not a pacer shard index");
  const auto version = get_at<std::uint32_t>(bin, kAtVersion);
  if (version >= 1 && version <= 3) {
    if (outdated) *outdated = true;
    return bad(fmt::format("index version {} {} (this pacer reads 4 and {}; rebuild with pacer shard index)", version,
                           version == 1   ? "is not bound to its shard"
                           : version == 2 ? "may split samples whose members are not adjacent"
                                          : "does not bind the pax and GNU long-name records of its members",
                           kIndexVersion));
  }
  if (version != 4 && version != kIndexVersion) return bad(fmt::format("index version {} (this pacer reads 4 and {})", version, kIndexVersion));
  const std::size_t head = version == 4 ? kIndexHeaderV4 : kIndexHeader;
  if (bin.size() < head) return bad("truncated index header");
  bin.resize(head);
  if (xxh3(bin.data(), head - 8) != get_at<std::uint64_t>(bin, head - 8)) return bad("header checksum mismatch (the index is corrupt)");
  TableIndex out;
  ShardIndex& idx = out.head;
  idx.shard = shard;
  idx.shard_bytes = get_at<std::uint64_t>(bin, kAtShardBytes);
  idx.samples = get_at<std::uint64_t>(bin, kAtSamples);
  idx.shard_mtime_ns = get_at<std::int64_t>(bin, kAtMtime);
  idx.headers_xxh3 = get_at<std::uint64_t>(bin, kAtHeaders);
  if (version == kIndexVersion) {
    idx.shard_ino = get_at<std::uint64_t>(bin, kAtIno);
    idx.shard_ctime_ns = get_at<std::int64_t>(bin, kAtCtime);
    idx.headers_hashed_at_ns = get_at<std::int64_t>(bin, kAtHashedAt);
  }
  // Each sample takes at least 4 bytes.
  if (idx.samples > (isize - head) / 4) return bad(fmt::format("{} samples cannot fit in {} bytes (truncated index?)", idx.samples, isize));
  auto sh = open_shard(shard);
  if (!sh) return sh.error();
  if (sh->bytes != idx.shard_bytes)
    return bad(fmt::format("index is for a {}-byte shard, the shard has {} bytes (rebuild with pacer shard index)", idx.shard_bytes, sh->bytes));
  const bool moved = sh->mtime_ns != idx.shard_mtime_ns;
  // Hashing touches every member header (0.4 us each, a fifth of a dataset's
  // first epoch on a VM): skipped for a shard whose inode was not changed
  // since its hash last matched. The index's own change time, set by the
  // same file system's clock when it was written after that hash, must also
  // be 2 s past the shard's: this machine's clock may run ahead of a file
  // server's. The fields' layout is checked either way.
  const bool trusted = !moved && unchanged_since_hashed(idx, *sh) && settled(idx.shard_ctime_ns, src.written_ctime_ns);
  if (header_only && !moved && !(src.settle && !trusted && settled(sh->ctime_ns, sh->stat_at_ns))) return out;
  if (Status st = open_data(*sh, shard); !st) return st.error();
  const std::uint64_t tar_bytes = sh->data.tar_bytes;

  bin.reserve(static_cast<std::size_t>(isize));
  ready_for_writing(bin.data(), bin.capacity());
  bin.resize(static_cast<std::size_t>(isize));
  if (!read_at(bin.data() + head, bin.size() - head, head)) return Error{ErrorKind::kIo, fmt::format("{}: read failed", path)};
  if (xxh3(bin.data() + head, bin.size() - head) != get_at<std::uint64_t>(bin, kAtEntries))
    return bad("entries do not match their checksum (the index is truncated or corrupt)");
  // Counted first, so that the table is one allocation per array, and
  // checked as counted: what is reserved is what the file's bytes describe,
  // a few times the index's size at most (16 bytes per sample of at least
  // 4), never a count read from it unchecked.
  std::size_t fields = 0, key_bytes = 0, pos = head;
  const std::uint64_t whole = read_records(
      bin, pos, idx.samples, [&](std::string_view key) { key_bytes += key.size(); },
      [&](std::uint64_t, std::string_view, std::string_view, std::uint64_t, std::uint64_t) {
        ++fields;
        return true;
      });
  if (whole != idx.samples) return bad(fmt::format("truncated at sample {}", whole));
  SampleTable& table = out.table;
  table.reserve(static_cast<std::size_t>(idx.samples), fields, key_bytes);
  std::optional<Error> outside;
  pos = head;
  read_records(
      bin, pos, idx.samples, [&](std::string_view key) { table.add_sample(key); },
      [&](std::uint64_t i, std::string_view key, std::string_view ext, std::uint64_t offset, std::uint64_t size) {
        // Compared without adding, so no offset + size can wrap past 2^64.
        if (offset < kTarBlock || size > tar_bytes || offset > tar_bytes - size) {
          outside = bad(fmt::format("sample {} ('{}') field '{}' at {}+{} lies outside the {}-byte {}", i, key, ext, offset, size, tar_bytes,
                                    sh->data.gzip ? "decompressed shard" : "shard"));
          return false;
        }
        table.add_field(ext, offset, size);
        return true;
      });
  if (outside) return *outside;
  if (pos != bin.size()) return bad(fmt::format("{} bytes after the last sample", bin.size() - pos));
  // A mapping of another size is not of this file (a gzip shard's mapping
  // is of its decompressed bytes, and so is tar_bytes).
  if (map && map->size() != tar_bytes) map = nullptr;
  // Without the caller's, a large shard is hashed through the mapping its
  // magic was read through, for the reason scan_index scans one that way.
  if (!map && tar_bytes >= kScanMappedMin) map = sh->data.map.get();
  if (trusted) {
    if (Status fit = fits(shard, table, tar_bytes); !fit) return fit.error();
    return out;
  }
  auto headers = member_headers_hash(sh->data.fd.get(), shard, table, tar_bytes, map);
  if (!headers) return headers.error();
  if (*headers != idx.headers_xxh3)
    return bad(fmt::format("does not match {}: the member headers at the indexed offsets changed "
                           "(the shard was rewritten; rebuild with pacer shard index)", shard));
  // A shard copied (another inode) or touched keeps its index, rebound to
  // it so that the next read skips the hash; one still settling is not
  // rewritten for nothing.
  if (moved || version != kIndexVersion || settled(sh->ctime_ns, sh->stat_at_ns)) {
    idx.shard_mtime_ns = sh->mtime_ns;
    bind_inode(idx, *sh);
    if (refreshed) *refreshed = true;
  }
  return out;
}

// SHARD.pidx, read and checked (check_index).
Expected<TableIndex> read_checked_index(const std::string& shard, bool header_only, bool* refreshed, bool* outdated = nullptr,
                                       const MappedFile* map = nullptr) {
  const std::string path = index_path(shard);
  auto fi = open_fd(path, O_RDONLY);
  if (!fi) return fi.error();
  struct stat ist {};
  if (::fstat(fi->get(), &ist) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", path, std::strerror(errno))};
  if (!S_ISREG(ist.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", path)};
  return check_index(shard, {path, fi->get(), 0, static_cast<std::uint64_t>(ist.st_size), ns_of(ist.st_ctim)}, header_only, refreshed, outdated, map);
}

// The shard's record in its directory index, read and checked (check_index).
Expected<TableIndex> read_record(const std::string& shard, const DirIndex& dir, const DirIndex::Record& rec, bool header_only, bool* refreshed,
                                 bool* outdated, const MappedFile* map, bool settle = false) {
  const std::string name = fmt::format("{} (record '{}')", dir.path(), fs::path(shard).filename().string());
  const std::int64_t written = rec.written_ctime_ns != 0 ? rec.written_ctime_ns : dir.ctime_ns();
  return check_index(shard, {name, dir.fd(), rec.offset, rec.bytes, written, settle}, header_only, refreshed, outdated, map);
}

// A shard whose index is in neither place.
Error no_index(const std::string& shard) {
  return Error{ErrorKind::kIo, fmt::format("{}: no index (neither {} nor a record in {})", shard, index_path(shard),
                                           (fs::path(shard_dir(shard)) / kDirIndexName).string())};
}

// Where a shard without SHARD.pidx finds its index: its record in the
// directory index, or nothing. A directory index that is corrupt is kConfig.
using FoundRecord = std::pair<std::shared_ptr<const DirIndex>, const DirIndex::Record*>;
Expected<FoundRecord> record_in(const Expected<std::shared_ptr<const DirIndex>>& dir, const std::string& shard) {
  if (!dir) return dir.error();
  if (!*dir) return FoundRecord{nullptr, nullptr};
  return FoundRecord{*dir, (*dir)->find(fs::path(shard).filename().string())};
}
Expected<FoundRecord> find_record(const std::string& shard) { return record_in(DirIndex::get(shard_dir(shard)), shard); }

Error stale_unwritable(const std::string& shard, const std::string& why, const Error& write) {
  // A stale index that cannot be replaced is refused rather than worked
  // around: every other reader of this dataset would still trust it.
  return Error{ErrorKind::kConfig, fmt::format("{}: the index cannot be used ({}) nor rebuilt here ({}); "
                                               "rebuild it with pacer shard index where the dataset is writable",
                                               shard, why, write.message)};
}

}  // namespace

std::string shard_dir(const std::string& shard) {
  // "./data/x.tar", "data//x.tar" and "data/x.tar" are one directory. A
  // ".." is kept: "a/b/../x.tar" lies in the parent of what b points to,
  // which is not "a" when b is a symbolic link, and the directory index is
  // the file beside the shard.
  fs::path dir;
  for (const auto& part : fs::path(shard).parent_path())
    if (!part.empty() && part != ".") dir /= part;
  return dir.empty() ? std::string(".") : dir.string();
}

Expected<bool> has_index(const std::string& shard) {
  std::error_code ec;
  if (fs::exists(index_path(shard), ec)) return true;
  auto found = find_record(shard);
  if (!found) return found.error();
  return found->second != nullptr;
}

namespace {
// What the public functions return: the entries as SampleEntry.
Expected<ShardIndex> public_index(Expected<TableIndex> t) {
  if (!t) return t.error();
  ShardIndex idx = std::move(t->head);
  idx.entries = t->table.entries();
  return idx;
}
}  // namespace

Expected<ShardIndex> build_index(const std::string& shard) {
  auto idx = scan_index(shard);
  if (!idx) return idx.error();
  if (Status st = write_index(idx->head, idx->table); !st) return st.error();
  return public_index(std::move(idx));
}

Expected<ShardIndex> read_index(const std::string& shard, bool header_only) {
  std::error_code ec;
  if (fs::exists(index_path(shard), ec)) return public_index(read_checked_index(shard, header_only, nullptr));
  auto found = find_record(shard);
  if (!found) return found.error();
  if (!found->second) return no_index(shard);
  return public_index(read_record(shard, *found->first, *found->second, header_only, nullptr, nullptr, nullptr));
}

Expected<ShardIndex> load_or_build_index(const std::string& shard, bool header_only) {
  return public_index(load_or_build_index(shard, header_only, nullptr));
}

Expected<TableIndex> load_or_build_index(const std::string& shard, bool header_only, const MappedFile* map) {
  return load_or_build_index(shard, header_only, map, nullptr);
}

Expected<TableIndex> load_or_build_index(const std::string& shard, bool header_only, const MappedFile* map, std::optional<PendingIndex>* defer,
                                         const KnownIndex* known) {
  if (defer) defer->reset();
  std::error_code ec;
  if (known ? known->own : fs::exists(index_path(shard), ec)) {
    bool refreshed = false, outdated = false;
    auto got = read_checked_index(shard, header_only, &refreshed, &outdated, map);
    if (got) {
      // Best effort: the next open then trusts the mtime again without reading headers.
      if (refreshed) (void)write_index(got->head, got->table);
      return got;
    }
    if (got.error().kind != ErrorKind::kConfig) return got.error();
    auto idx = scan_index(shard);
    if (!idx) return idx.error();
    // One of an older format no reader of this version trusts, so on a
    // read-only dataset the scan is used from memory, as for a missing index.
    if (Status st = write_index(idx->head, idx->table); !st && !outdated) return stale_unwritable(shard, got.error().message, st.error());
    return idx;
  }
  // No SHARD.pidx: the shard's record in its directory index, else a scan.
  std::optional<std::string> stale;  // why the record found could not be used
  auto found = known && known->dir ? record_in(*known->dir, shard) : find_record(shard);
  if (!found && found.error().kind == ErrorKind::kIo) {
    // A file replaced by another node can fail through the descriptor kept
    // for it (ESTALE on NFS): looked up again once.
    DirIndex::forget(shard_dir(shard));
    found = find_record(shard);
  }
  if (!found && found.error().kind != ErrorKind::kConfig) return found.error();
  if (!found) {
    stale = found.error().message;  // a corrupt directory index: its records are rebuilt
  } else if (found->second) {
    bool refreshed = false, outdated = false;
    // Rebound at open only where the open writes records together.
    const bool settle = defer != nullptr;
    auto got = read_record(shard, *found->first, *found->second, header_only, &refreshed, &outdated, map, settle);
    if (!got && got.error().kind == ErrorKind::kIo) {
      DirIndex::forget(shard_dir(shard));
      if (auto again = find_record(shard); again && again->second)
        got = read_record(shard, *again->first, *again->second, header_only, &refreshed, &outdated, map, settle);
    }
    if (got) {
      // Rebound: written with the others of a dataset open, alone as
      // SHARD.pidx by a small open, and not at a loader's first read (a
      // SHARD.pidx per shard is what the directory index saves).
      if (refreshed && (defer || header_only)) {
        auto image = index_image(got->head, got->table);
        if (image && defer) *defer = PendingIndex{shard, std::move(*image), std::nullopt};
        else if (image) (void)write_file_atomic(index_path(shard), *image, Durability::kCache);
      }
      return got;
    }
    if (got.error().kind != ErrorKind::kConfig) return got.error();
    if (!outdated) stale = got.error().message;
  }
  auto idx = scan_index(shard);
  if (!idx) return idx.error();
  auto image = index_image(idx->head, idx->table);
  // An index that cannot hold this shard (index_image's limits) stays in memory.
  if (!image) {
    if (stale) return stale_unwritable(shard, *stale, image.error());
    return idx;
  }
  if (defer) {
    *defer = PendingIndex{shard, std::move(*image), stale};
    return idx;
  }
  if (Status st = write_file_atomic(index_path(shard), *image, Durability::kCache); !st && stale) return stale_unwritable(shard, *stale, st.error());
  return idx;
}

Status write_pending_indexes(const std::vector<PendingIndex>& pending) {
  // Per directory, per file name: the last one (a shard named twice in a spec is one).
  std::map<std::string, std::map<std::string, const PendingIndex*>> by_dir;
  for (const auto& p : pending) by_dir[shard_dir(p.shard)][fs::path(p.shard).filename().string()] = &p;
  // The first stale index that cannot be written; the others are written all the same.
  std::optional<Error> failed;
  for (const auto& [dir, list] : by_dir) {
    std::vector<std::pair<std::string, std::string_view>> fresh;
    fresh.reserve(list.size());
    for (const auto& [name, p] : list) fresh.emplace_back(name, p->image);
    if (DirIndex::write(dir, fresh)) continue;
    // A directory index that cannot be written (a read-only directory, one
    // of a newer pacer): SHARD.pidx each, which wins over any record.
    const auto now = static_cast<std::int64_t>(wall_now() * 1e9);
    for (const auto& [name, p] : list) {
      std::string image = p->image;
      // Written now, the file's change time would date a hash made long
      // before it: such an index goes unbound (hashed again when read, and
      // rebound then).
      if (image.size() >= kIndexHeader && get_at<std::uint32_t>(image, kAtVersion) == kIndexVersion &&
          now - get_at<std::int64_t>(image, kAtHashedAt) > 500'000'000) {
        put_at<std::uint64_t>(image, kAtIno, 0);
        put_at<std::uint64_t>(image, kAtSelf, xxh3(image.data(), kAtSelf));
      }
      if (Status st = write_file_atomic(index_path(p->shard), image, Durability::kCache); !st && p->stale && !failed)
        failed = stale_unwritable(p->shard, *p->stale, st.error());
    }
  }
  return failed ? Status(*failed) : Status{};
}

}  // namespace pacer::data
