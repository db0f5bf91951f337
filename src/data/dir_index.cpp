// The directory index: the indexes of many shards of one directory in one file (docs/data.md, "Directory index").
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
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/time.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace fs = std::filesystem;

namespace {

// Layout (little-endian): a 48-byte header (magic, u32 version, u32 zero,
// u64 rows, u64 table bytes, u64 XXH3 of the table, u64 XXH3 of the 40 bytes
// before it), the table (per row: u16 name length, the file name, u64
// offset, u64 bytes, i64 the file system's time of the record's hash; sorted by name), then the
// records, each a whole index image as SHARD.pidx holds it, with its own
// checksums.
constexpr char kDirMagic[8] = {'P', 'A', 'C', 'E', 'R', 'D', 'I', 'R'};
constexpr std::uint32_t kDirVersion = 1;
constexpr std::size_t kDirHeader = 48;
constexpr std::size_t kAtRows = 16, kAtTableBytes = 24, kAtTableSum = 32, kAtHeaderSum = 40;
constexpr std::size_t kRowMin = 2 + 1 + 3 * 8;
// Directories whose index is kept open; beyond that the cache starts over.
constexpr std::size_t kCachedDirs = 64;

// What identifies one version of the file: a rewrite is a rename of a new inode.
struct Identity {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const Identity&) const = default;
};
Identity identity_of(const struct stat& st) { return {st.st_dev, st.st_ino, st.st_size, ns_of(st.st_mtim), ns_of(st.st_ctim)}; }

struct Cached {
  Identity id;
  std::shared_ptr<const DirIndex> index;
};
std::mutex cache_mu;
std::unordered_map<std::string, Cached>& cache() {
  static auto* c = new std::unordered_map<std::string, Cached>();
  return *c;
}

// A name a row may carry: one file of the directory.
bool plain_name(std::string_view n) { return !n.empty() && n != "." && n != ".." && n.find('/') == std::string_view::npos && n.find('\0') == std::string_view::npos; }

// A row's name as an error message shows it: control bytes as '?', at most 200 bytes.
std::string shown(std::string_view n) {
  std::string out(n.substr(0, 200));
  for (auto& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  if (n.size() > 200) out += "...";
  return out;
}

// One write of a directory index at a time in this process: two dataset
// opens merging into the same file would each drop the other's records.
std::mutex write_mu;

// The version of a file that is a directory index, else 0.
std::uint32_t version_of(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  Fd f(fd);
  char head[12];
  auto got = pread_full(f.get(), head, sizeof head, 0, path);
  if (!got || *got != sizeof head || std::memcmp(head, kDirMagic, 8) != 0) return 0;
  return load<std::uint32_t>(head + 8);
}

}  // namespace

// Builds the table of one version of the file; friends with DirIndex through get().
struct DirIndexParser {
  static Expected<std::shared_ptr<const DirIndex>> parse(const std::string& path, Fd fd, const struct stat& st);
};

Expected<std::shared_ptr<const DirIndex>> DirIndex::get(const std::string& dir) {
  const std::string path = (fs::path(dir) / kDirIndexName).string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::shared_ptr<const DirIndex>{};
    return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", path, std::strerror(errno))};
  }
  {
    std::lock_guard g(cache_mu);
    auto it = cache().find(dir);
    if (it != cache().end() && it->second.id == identity_of(st)) return it->second.index;
  }
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    if (errno == ENOENT) return std::shared_ptr<const DirIndex>{};  // removed since the stat
    return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
  }
  Fd fd(raw);
  if (::fstat(fd.get(), &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", path, std::strerror(errno))};
  const Identity id = identity_of(st);
  auto parsed = DirIndexParser::parse(path, std::move(fd), st);
  if (!parsed) return parsed.error();
  std::lock_guard g(cache_mu);
  if (cache().size() >= kCachedDirs) cache().clear();
  cache()[dir] = Cached{id, *parsed};
  return parsed;
}

Expected<std::shared_ptr<const DirIndex>> DirIndexParser::parse(const std::string& path, Fd fd, const struct stat& st) {
  auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {}", path, why)}; };
  auto io = [&](std::uint64_t at) { return Error{ErrorKind::kIo, fmt::format("{}: offset {}: read failed", path, at)}; };
  if (!S_ISREG(st.st_mode)) return bad("not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < kDirHeader) return bad(fmt::format("truncated header ({} bytes)", size));
  char head[kDirHeader];
  auto got = pread_full(fd.get(), head, kDirHeader, 0, path);
  if (!got || *got != kDirHeader) return io(0);
  if (std::memcmp(head, kDirMagic, 8) != 0) return bad("not a pacer directory index");
  const auto version = load<std::uint32_t>(head + 8);
  // A newer pacer's file (its header may differ) is left to it: its shards
  // are indexed as if it were not there, and it is not replaced (write).
  if (version > kDirVersion) return std::shared_ptr<const DirIndex>{};
  if (XXH3_64bits(head, kAtHeaderSum) != load<std::uint64_t>(head + kAtHeaderSum)) return bad("header checksum mismatch (the file is corrupt)");
  if (version != kDirVersion) return bad(fmt::format("directory index version {} (this pacer reads {})", version, kDirVersion));
  const auto rows = load<std::uint64_t>(head + kAtRows);
  const auto table_bytes = load<std::uint64_t>(head + kAtTableBytes);
  if (table_bytes > size - kDirHeader) return bad(fmt::format("a {}-byte table cannot fit in {} bytes (truncated?)", table_bytes, size));
  if (rows > table_bytes / kRowMin) return bad(fmt::format("{} rows cannot fit in a {}-byte table", rows, table_bytes));
  std::string table(static_cast<std::size_t>(table_bytes), '\0');
  got = pread_full(fd.get(), table.data(), table.size(), kDirHeader, path);
  if (!got || *got != table.size()) return io(kDirHeader);
  if (XXH3_64bits(table.data(), table.size()) != load<std::uint64_t>(head + kAtTableSum))
    return bad("table does not match its checksum (the file is truncated or corrupt)");
  auto out = std::make_shared<DirIndex>();
  out->path_ = path;
  out->ctime_ns_ = ns_of(st.st_ctim);
  const std::uint64_t records_from = kDirHeader + table_bytes;
  std::size_t pos = 0;
  for (std::uint64_t i = 0; i < rows; ++i) {
    if (table.size() - pos < 2) return bad(fmt::format("table truncated at row {}", i));
    const auto len = load<std::uint16_t>(table.data() + pos);
    pos += 2;
    if (len > table.size() - pos || table.size() - pos - len < 3 * 8) return bad(fmt::format("table truncated at row {}", i));
    std::string name = table.substr(pos, len);
    pos += len;
    DirIndex::Record rec;
    rec.offset = load<std::uint64_t>(table.data() + pos);
    rec.bytes = load<std::uint64_t>(table.data() + pos + 8);
    rec.written_ctime_ns = load<std::int64_t>(table.data() + pos + 16);
    pos += 3 * 8;
    if (!plain_name(name)) return bad(fmt::format("row {}: '{}' is not a file name", i, shown(name)));
    // Compared without adding, so no offset + bytes can wrap.
    if (rec.offset < records_from || rec.bytes > size || rec.offset > size - rec.bytes)
      return bad(fmt::format("record '{}' at {}+{} lies outside the {}-byte file's records", shown(name), rec.offset, rec.bytes, size));
    if (!out->rows_.empty() && !(out->rows_.back().first < name))
      return bad(fmt::format("row {} ('{}') is out of order or repeated", i, shown(name)));
    out->rows_.emplace_back(std::move(name), rec);
  }
  if (pos != table.size()) return bad(fmt::format("{} bytes after the last row", table.size() - pos));
  out->fd_ = std::move(fd);
  return std::shared_ptr<const DirIndex>(std::move(out));
}

const DirIndex::Record* DirIndex::find(std::string_view name) const {
  auto it = std::lower_bound(rows_.begin(), rows_.end(), name, [](const auto& row, std::string_view n) { return row.first < n; });
  return it != rows_.end() && it->first == name ? &it->second : nullptr;
}

void DirIndex::forget(const std::string& dir) {
  std::lock_guard g(cache_mu);
  cache().erase(dir);
}

Status DirIndex::write(const std::string& dir, const std::vector<std::pair<std::string, std::string_view>>& fresh) {
  const std::string path = (fs::path(dir) / kDirIndexName).string();
  std::lock_guard one(write_mu);
  if (const auto v = version_of(path); v > kDirVersion)
    return Error{ErrorKind::kRuntime, fmt::format("{}: written by a newer pacer (version {}), not replaced", path, v)};
  // Created first: a directory that cannot take it (read-only) fails before
  // any work, and its change time dates the fresh records' hashes.
  auto w = AtomicFileWriter::create(path);
  if (!w) return w.error();
  auto written_at = w->change_time_ns();
  if (!written_at) return written_at.error();
  const auto here_at = static_cast<std::int64_t>(wall_now() * 1e9);

  // Per name, the last of `fresh`; then the current file's other records.
  struct Row {
    std::string_view image;                // a fresh record
    const DirIndex::Record* old = nullptr;  // or one copied from the current file
    std::int64_t written_ctime_ns = 0;
    std::uint64_t bytes = 0, offset = 0;
  };
  std::map<std::string, Row> rows;
  for (const auto& [name, image] : fresh) {
    if (!plain_name(name) || name.size() > 0xffff)
      return Error{ErrorKind::kRuntime, fmt::format("{}: '{}' cannot be a row of a directory index", path, shown(name))};
    // The file system's time of the record's hash: this file's change time
    // less the time since the hash by this machine's clock (a difference,
    // so an offset between the two clocks cancels). A reader trusts the
    // record's binding only when that is 2 s past the shard's change time,
    // as it does a SHARD.pidx written right after its hash.
    std::int64_t hashed_at = 0;
    if (image.size() >= 80) std::memcpy(&hashed_at, image.data() + 72, 8);
    const std::int64_t since = hashed_at > 0 && hashed_at < here_at ? here_at - hashed_at : 0;
    rows[name] = Row{image, nullptr, *written_at - since, image.size()};
  }
  // A current file that cannot be read is replaced without its records.
  std::shared_ptr<const DirIndex> current;
  if (auto cur = get(dir)) current = *cur;
  if (current) {
    // Records of shards deleted since are dropped: one listing of the
    // directory, not a stat per record.
    std::unordered_set<std::string> present;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) present.insert(it->path().filename().string());
    for (const auto& [name, rec] : current->rows_) {
      if (rows.count(name) || !present.count(name)) continue;
      // Its binding keeps the time it was given when first written.
      rows[name] = Row{{}, &rec, rec.written_ctime_ns != 0 ? rec.written_ctime_ns : current->ctime_ns_, rec.bytes};
    }
  }
  std::uint64_t table_bytes = 0;
  for (const auto& [name, row] : rows) table_bytes += 2 + name.size() + 3 * 8;
  std::uint64_t at = kDirHeader + table_bytes;
  std::string head_and_table(kDirHeader, '\0');
  head_and_table.reserve(static_cast<std::size_t>(kDirHeader + table_bytes));
  for (auto& [name, row] : rows) {
    row.offset = at;
    at += row.bytes;
    put<std::uint16_t>(head_and_table, static_cast<std::uint16_t>(name.size()));
    head_and_table += name;
    put<std::uint64_t>(head_and_table, row.offset);
    put<std::uint64_t>(head_and_table, row.bytes);
    put<std::int64_t>(head_and_table, row.written_ctime_ns);
  }
  char* h = head_and_table.data();
  std::memcpy(h, kDirMagic, 8);
  const std::uint32_t version = kDirVersion;
  std::memcpy(h + 8, &version, 4);
  const std::uint64_t n = rows.size(), table_sum = XXH3_64bits(h + kDirHeader, static_cast<std::size_t>(table_bytes));
  std::memcpy(h + kAtRows, &n, 8);
  std::memcpy(h + kAtTableBytes, &table_bytes, 8);
  std::memcpy(h + kAtTableSum, &table_sum, 8);
  const std::uint64_t head_sum = XXH3_64bits(h, kAtHeaderSum);
  std::memcpy(h + kAtHeaderSum, &head_sum, 8);

  if (Status st = w->write(head_and_table.data(), head_and_table.size()); !st) return st;
  std::string buf;
  for (const auto& [name, row] : rows) {
    if (!row.old) {
      if (Status st = w->write(row.image.data(), row.image.size()); !st) return st;
      continue;
    }
    // Copied in pieces: a record of a large shard is megabytes.
    for (std::uint64_t done = 0; done < row.bytes;) {
      const auto piece = static_cast<std::size_t>(std::min<std::uint64_t>(row.bytes - done, 1u << 20));
      buf.resize(piece);
      if (Status st = pread_exact(current->fd_.get(), buf.data(), piece, row.old->offset + done, current->path_); !st) return st;
      if (Status st = w->write(buf.data(), piece); !st) return st;
      done += piece;
    }
  }
  // A cache, as SHARD.pidx is: checked when read, rebuilt when lost or torn.
  return w->commit(Durability::kCache);
}

}  // namespace pacer::data
