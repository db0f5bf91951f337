// Datasets of shards: spec expansion, random access to samples, and the order (permutation, partition).
#include <fcntl.h>
#include <fmt/format.h>
#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/mapped_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/data.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------
// Spec expansion

namespace {

// A spec names at most this many shards: a million 256 MB shards are 256 TB,
// and a larger expansion is a typo that would only exhaust memory.
constexpr std::uint64_t kMaxSpecNames = 1'000'000;

// The first {...} group of a spec: a {a,b,c} list or a {000..099}
// zero-padded numeric range. Groups may nest ("{a,b{0..1}}").
struct Group {
  bool none = true;  // the spec has no group
  std::string head, tail;
  std::vector<std::string> items;  // a list's items
  long long from = 0, to = 0;      // a range, when items is empty
  std::size_t width = 0;
  // Saturates: {LLONG_MIN..LLONG_MAX} holds 2^64 names, one more than fits.
  std::uint64_t range_size() const {
    const std::uint64_t span = static_cast<std::uint64_t>(to) - static_cast<std::uint64_t>(from);
    return span == ~std::uint64_t{0} ? span : span + 1;
  }
};

Expected<Group> first_group(const std::string& s) {
  Group g;
  const auto open = s.find('{');
  if (open == std::string::npos) return g;
  g.none = false;
  std::size_t close = std::string::npos;
  std::vector<std::size_t> commas;
  int depth = 0;
  for (std::size_t i = open; i < s.size() && close == std::string::npos; ++i) {
    if (s[i] == '{') ++depth;
    else if (s[i] == '}' && --depth == 0) close = i;
    else if (s[i] == ',' && depth == 1) commas.push_back(i);
  }
  if (close == std::string::npos) return Error{ErrorKind::kUsage, fmt::format("'{}': unbalanced '{{'", s)};
  const std::string body = s.substr(open + 1, close - open - 1);
  g.head = s.substr(0, open);
  g.tail = s.substr(close + 1);
  if (const auto dots = body.find(".."); commas.empty() && dots != std::string::npos) {
    const std::string a = body.substr(0, dots);
    const std::string b = body.substr(dots + 2);
    char* ea = nullptr;
    char* eb = nullptr;
    errno = 0;
    g.from = std::strtoll(a.c_str(), &ea, 10);
    g.to = std::strtoll(b.c_str(), &eb, 10);
    if (errno == ERANGE) return Error{ErrorKind::kUsage, fmt::format("'{}': range {{{}}} does not fit 64 bits", s, body)};
    if (a.empty() || b.empty() || *ea || *eb || g.to < g.from || a.size() > 64)
      return Error{ErrorKind::kUsage, fmt::format("'{}': bad range {{{}}}", s, body)};
    g.width = a.size();
    return g;
  }
  std::size_t pos = open + 1;
  commas.push_back(close);
  for (const std::size_t comma : commas) {
    g.items.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return g;
}

// How many names s expands to, saturating just past kMaxSpecNames, without
// expanding it. A group's alternatives are balanced, so the names of
// head + item + tail number count(item) * count(tail).
Expected<std::uint64_t> count_names(const std::string& s) {
  auto g = first_group(s);
  if (!g) return g.error();
  if (g->none) return std::uint64_t{1};
  std::uint64_t here = 0;
  if (g->items.empty()) {
    here = std::min<std::uint64_t>(g->range_size(), kMaxSpecNames + 1);
  } else {
    for (const auto& it : g->items) {
      auto n = count_names(it);
      if (!n) return n.error();
      here = std::min<std::uint64_t>(here + *n, kMaxSpecNames + 1);
    }
  }
  auto rest = count_names(g->tail);
  if (!rest) return rest.error();
  if (here == 0 || *rest == 0) return std::uint64_t{0};
  return *rest > (kMaxSpecNames + 1) / here ? kMaxSpecNames + 1 : std::min<std::uint64_t>(here * *rest, kMaxSpecNames + 1);
}

// Expands the first group and recurses; count_names has bounded the total.
Status expand_braces(const std::string& s, std::vector<std::string>& out) {
  auto g = first_group(s);
  if (!g) return g.error();
  if (g->none) {
    out.push_back(s);
    return {};
  }
  if (g->items.empty()) {
    for (long long v = g->from;; ++v) {
      if (Status st = expand_braces(g->head + fmt::format("{:0{}d}", v, g->width) + g->tail, out); !st) return st;
      if (v == g->to) break;  // not v <= to: to may be LLONG_MAX
    }
    return {};
  }
  for (const auto& it : g->items)
    if (Status st = expand_braces(g->head + it + g->tail, out); !st) return st;
  return {};
}

}  // namespace

Expected<std::vector<std::string>> expand_shard_spec(const std::string& spec) {
  if (spec.size() > 5 && spec.ends_with(".json")) {
    auto text = read_file(spec);
    if (!text) return text.error();
    json j = json::parse(*text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || j.value("schema", "") != "pacer.shards/1" || !j.contains("shards") ||
        !j["shards"].is_array())
      return Error{ErrorKind::kConfig, fmt::format("{}: not a pacer shard manifest (schema pacer.shards/1)", spec)};
    std::vector<std::string> out;
    const fs::path dir = fs::path(spec).parent_path();
    try {
      // Each shard once: one listed twice would be read twice per epoch.
      std::unordered_set<std::string> seen;
      for (const auto& s : j["shards"]) {
        const auto path = s.at("path").get<std::string>();
        if (Status st = check_path(path); !st) return Error{ErrorKind::kConfig, fmt::format("{}: shard {}: {}", spec, out.size(), st.error().message)};
        if (!seen.insert(fs::path(path).lexically_normal().string()).second)
          return Error{ErrorKind::kConfig, fmt::format("{}: shard '{}' is listed twice", spec, path)};
        out.push_back((dir / path).string());
      }
    } catch (const json::exception& e) {
      return Error{ErrorKind::kConfig, fmt::format("{}: shard {}: {}", spec, out.size(), e.what())};
    }
    return out;
  }
  // Groups are expanded recursively, each level copying the rest of the
  // spec: deep nesting would cost quadratic memory and then the stack.
  constexpr int kMaxSpecDepth = 32;
  int depth = 0;
  for (const char c : spec)
    if (c == '{' && ++depth > kMaxSpecDepth)
      return Error{ErrorKind::kUsage, fmt::format("'{}...': braces nest deeper than {} levels", spec.substr(0, 64), kMaxSpecDepth)};
    else if (c == '}' && depth > 0)
      --depth;
  auto names = count_names(spec);
  if (!names) return names.error();
  if (*names > kMaxSpecNames)
    return Error{ErrorKind::kUsage, fmt::format("'{}' expands to more than {} names, the most a spec may name", spec, kMaxSpecNames)};
  std::vector<std::string> expanded;
  expanded.reserve(static_cast<std::size_t>(*names));
  if (Status st = expand_braces(spec, expanded); !st) return st.error();
  std::vector<std::string> out;
  for (const auto& e : expanded) {
    if (e.find_first_of("*?[") == std::string::npos) {
      out.push_back(e);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(e.c_str(), 0, nullptr, &g);
    if (rc == 0)
      for (std::size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc == GLOB_NOMATCH) return Error{ErrorKind::kUsage, fmt::format("'{}' matches no file", e)};
  }
  if (out.empty()) return Error{ErrorKind::kUsage, fmt::format("'{}' names no shard", spec)};
  return out;
}

// ---------------------------------------------------------------------------
// Dataset

struct Dataset::Impl {
  // An open descriptor, closed when the last reader lets go of it: evicting a
  // shard must not close a descriptor another thread is reading from.
  // Per shard: its index entries (loaded on first use) and an open descriptor.
  struct Shard {
    std::mutex mu;
    std::shared_ptr<const SampleTable> entries;
    // The size and mtime of the file the entries describe, compared each
    // time the shard is opened for reading: entries kept from the scan at
    // open (no usable index), or loaded before an LRU close, are read again
    // (rebuilt, or refused) for a shard replaced since, never applied at the
    // old offsets to the new file.
    std::uint64_t entries_bytes = 0;
    std::int64_t entries_mtime_ns = 0;
    std::shared_ptr<const pacer::Fd> file;
    // The same file mapped (see read_span), or null where mapping failed.
    std::shared_ptr<const MappedFile> map;
    // Its place in the LRU list of open shards (guarded by lru_mu).
    std::list<std::size_t>::iterator lru_pos;
    bool in_lru = false;
    // A gzip shard: the decompressed bytes `file` holds in memory, and how
    // many times it was decompressed (guarded by mu).
    std::uint64_t in_memory = 0;
    std::uint64_t decompressions = 0;
    // Set once entries and file are loaded in a dataset that never closes a
    // shard (no more shards than max_open, none decompressed): from then on
    // they are read without the lock or reference counts, which two reader
    // threads on the same shard otherwise contend for on every sample.
    std::atomic<bool> settled{false};
    // Whether a loader's prefetch asked for the mapping to be filled (once).
    mutable std::atomic<bool> populated{false};
  };
  std::vector<std::unique_ptr<Shard>> shards;
  // Open descriptors are bounded: thousands of shards must not exhaust the
  // open-file limit.
  std::mutex lru_mu;
  std::list<std::size_t> lru;
  std::size_t max_open = 128;
  // Decompressed gzip shards stay open while they hold at most this many
  // bytes together (at least the two most recent: readers cross shard
  // boundaries); guarded by lru_mu.
  std::uint64_t max_in_memory = 2ULL << 30;  // gzip_cache_limit() at open
  std::uint64_t in_memory = 0;
  std::atomic<bool> warned_gzip{false};
};

Dataset::~Dataset() = default;

Expected<std::shared_ptr<Dataset>> Dataset::open(const std::string& spec) {
  auto shards = expand_shard_spec(spec);
  if (!shards) return shards.error();
  auto ds = open(*shards);
  if (ds) (*ds)->name_ = spec;
  return ds;
}

Expected<std::shared_ptr<Dataset>> Dataset::open(const std::vector<std::string>& shards) {
  for (const auto& s : shards)
    if (Status st = check_path(s); !st) return st.error();
  std::shared_ptr<Dataset> ds(new Dataset());
  ds->impl_ = std::make_unique<Impl>();
  ds->impl_->max_in_memory = gzip_cache_limit();
  if (shards.size() == 1) ds->name_ = shards.front();
  else if (!shards.empty()) ds->name_ = fmt::format("{} .. {} ({} shards)", shards.front(), shards.back(), shards.size());
  // Index headers (or, on a first open, whole scans) of many shards are read
  // on several threads: a first open is mostly system calls per small file.
  std::vector<std::optional<Expected<TableIndex>>> found(shards.size());
  const std::size_t threads = shards.size() < 64 ? 1 : std::min<std::size_t>(8, std::max(1u, std::thread::hardware_concurrency()));
  auto each = [&](const std::function<void(std::size_t)>& fn) {
    if (threads == 1) {
      for (std::size_t i = 0; i < shards.size(); ++i) fn(i);
      return;
    }
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < threads; ++t)
      pool.emplace_back([&] {
        for (std::size_t i; (i = next.fetch_add(1)) < shards.size();) fn(i);
      });
    for (auto& t : pool) t.join();
  };
  // A directory with kDirIndexMin or more of these shards without a
  // SHARD.pidx gets what they need written in one file, its directory
  // index, once all are indexed (write_pending_indexes): creating a file
  // per shard is what a first open of thousands of shards spent its time on.
  std::vector<char> own(shards.size());
  each([&](std::size_t i) {
    std::error_code ec;
    own[i] = fs::exists(index_path(shards[i]), ec);
  });
  struct Dir {
    std::set<std::string> without;  // file names without SHARD.pidx
    Expected<std::shared_ptr<const DirIndex>> index{std::shared_ptr<const DirIndex>{}};
  };
  std::map<std::string, Dir> dirs;
  std::vector<Dir*> dir_of(shards.size());
  for (std::size_t i = 0; i < shards.size(); ++i) {
    dir_of[i] = &dirs[shard_dir(shards[i])];
    if (!own[i]) dir_of[i]->without.insert(fs::path(shards[i]).filename().string());
  }
  // Each directory's index looked up once, not once per shard.
  for (auto& [path, dir] : dirs)
    if (!dir.without.empty()) dir.index = DirIndex::get(path);
  std::vector<std::optional<PendingIndex>> pending(shards.size());
  each([&](std::size_t i) {
    std::error_code ec;
    if (!fs::exists(shards[i], ec)) {
      found[i].emplace(Error{ErrorKind::kUsage, fmt::format("{}: no such shard", shards[i])});
      return;
    }
    const bool together = !own[i] && dir_of[i]->without.size() >= kDirIndexMin;
    const KnownIndex known{own[i] != 0, &dir_of[i]->index};
    found[i].emplace(load_or_build_index(shards[i], true, nullptr, together ? &pending[i] : nullptr, &known));
  });
  // Written before any error is returned: the indexes of the good shards
  // are kept when one shard is bad.
  std::vector<PendingIndex> to_write;
  for (auto& p : pending)
    if (p) to_write.push_back(std::move(*p));
  const Status written = write_pending_indexes(to_write);
  for (std::size_t i = 0; i < shards.size(); ++i)
    if (!*found[i]) return found[i]->error();  // the first bad shard in the given order
  if (!written) return written.error();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string& s = shards[i];
    auto& idx = *found[i];
    ds->shards_.push_back(s);
    ds->starts_.push_back(ds->total_);
    ds->counts_.push_back(idx->head.samples);
    ds->total_ += idx->head.samples;
    auto shard = std::make_unique<Impl::Shard>();
    if (!idx->table.empty()) {
      shard->entries = std::make_shared<const SampleTable>(std::move(idx->table));
      shard->entries_bytes = idx->head.shard_bytes;
      shard->entries_mtime_ns = idx->head.shard_mtime_ns;
    }
    ds->impl_->shards.push_back(std::move(shard));
  }
  return ds;
}

// Finds sample i's index entry and an open descriptor for its shard.
struct Dataset::Located {
  std::size_t shard = 0;
  const SampleTable* entries = nullptr;
  std::size_t row = 0;  // the sample's in `entries`
  const pacer::Fd* file = nullptr;
  const MappedFile* map = nullptr;  // when the shard is mapped
  // Keep the above alive while the shard may be closed under the reader
  // (empty for a settled shard, which the dataset keeps open).
  std::shared_ptr<const SampleTable> entries_ref;
  std::shared_ptr<const pacer::Fd> file_ref;
  std::shared_ptr<const MappedFile> map_ref;
};

Expected<Dataset::Located> Dataset::locate(std::uint64_t i) const {
  if (i >= total_) return Error{ErrorKind::kUsage, fmt::format("sample {} of a {}-sample dataset", i, total_)};
  Located loc;
  const std::size_t s = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1);
  loc.shard = s;
  Impl::Shard& sh = *impl_->shards[s];
  const std::uint64_t local = i - starts_[s];
  if (sh.settled.load(std::memory_order_acquire)) {
    // Sizes were checked when the shard settled.
    loc.entries = sh.entries.get();
    loc.row = local;
    loc.file = sh.file.get();
    loc.map = sh.map.get();
    return loc;
  }
  std::uint64_t gained = 0;  // decompressed bytes this call brought into memory
  bool held_in_memory = false;
  {
    std::lock_guard g(sh.mu);
    if (!sh.file) {
      auto d = open_shard_data(shards_[s]);
      if (!d) return d.error();
      if (d->gzip) {
        sh.in_memory = d->tar_bytes;
        if (++sh.decompressions == 2 && !impl_->warned_gzip.exchange(true))
          fmt::print(stderr,
                     "pacer: warning: {}: gzip shard decompressed again ({} bytes): reading .tar.gz shards out of order "
                     "decompresses a whole shard per visit; read them in order (shuffle=False) or gunzip them (docs/data.md)\n",
                     shards_[s], d->tar_bytes);
      }
      // No POSIX_FADV_WILLNEED: it reads the whole shard ahead in 4 KiB
      // folios, which every later mapping of it then pays for page by page;
      // the mapping's own faults read 2 MiB folios, 2-4 MiB at a time, and a
      // cold epoch measured no slower (bench/results/loader_folios-2026-12-05.md).
      // A mapping that fails (address space, a file system without mmap)
      // leaves the shard to pread.
      if (d->map) sh.map = std::move(d->map);
      else if (auto m = MappedFile::map(d->fd.get(), shards_[s])) sh.map = std::make_shared<const MappedFile>(std::move(*m));
      if (sh.entries && (d->file_bytes != sh.entries_bytes || d->mtime_ns != sh.entries_mtime_ns)) sh.entries.reset();
      sh.file = std::make_shared<const pacer::Fd>(std::move(d->fd));
      gained = sh.in_memory;
    }
    if (!sh.entries) {
      // Reading the entries checks the shard's member headers too (through
      // the mapping just made); a shard rewritten under its index is rebuilt
      // here (or refused, read-only).
      auto idx = load_or_build_index(shards_[s], false, sh.map.get());
      if (!idx) return idx.error();
      if (idx->table.size() != counts_[s])
        return Error{ErrorKind::kConfig, fmt::format("{}: changed since the dataset was opened ({} samples then, {} now; open it again)", shards_[s],
                                                     counts_[s], idx->table.size())};
      sh.entries = std::make_shared<const SampleTable>(std::move(idx->table));
      sh.entries_bytes = idx->head.shard_bytes;
      sh.entries_mtime_ns = idx->head.shard_mtime_ns;
    }
    loc.entries_ref = sh.entries;
    loc.file_ref = sh.file;
    loc.map_ref = sh.map;
    held_in_memory = sh.in_memory > 0;
    if (shards_.size() <= impl_->max_open && !held_in_memory && sh.entries->size() == counts_[s]) sh.settled.store(true, std::memory_order_release);
  }
  if (shards_.size() > impl_->max_open || held_in_memory) {
    // Close the least recently used shards beyond the bounds. With fewer
    // shards than max_open and none decompressed into memory, every one stays
    // open and readers skip this lock.
    std::lock_guard g(impl_->lru_mu);
    auto& lru = impl_->lru;
    impl_->in_memory += gained;
    if (sh.in_lru) lru.splice(lru.begin(), lru, sh.lru_pos);
    else {
      lru.push_front(s);
      sh.lru_pos = lru.begin();
      sh.in_lru = true;
    }
    while (lru.size() > impl_->max_open || (impl_->in_memory > impl_->max_in_memory && lru.size() > 2)) {
      Impl::Shard& old = *impl_->shards[lru.back()];
      lru.pop_back();
      old.in_lru = false;
      if (&old == &sh) continue;
      std::lock_guard g2(old.mu);
      old.file.reset();
      old.map.reset();
      impl_->in_memory -= std::min(impl_->in_memory, old.in_memory);
      old.in_memory = 0;
    }
  }
  loc.file = loc.file_ref.get();
  loc.map = loc.map_ref.get();
  if (local >= loc.entries_ref->size())
    return Error{ErrorKind::kConfig, fmt::format("{}: index has {} samples, asked for {}", shards_[s], loc.entries_ref->size(), local)};
  loc.entries = loc.entries_ref.get();
  loc.row = local;
  return loc;
}

namespace {
// Reads exactly n bytes at `offset`; a short read is a truncated shard.
// Mapped shards are copied from the mapping: one memcpy per sample where
// pread costs a system call and a page-cache lookup per page, which measured
// 3x cat's CPU time (docs/data.md, "Reading mapped shards").
Status pread_all(int fd, const MappedFile* map, unsigned char* dst, std::uint64_t n, std::uint64_t offset, const std::string& shard,
                 std::string_view key) {
  if (map) {
    if (Status st = map->copy(offset, n, dst); !st) return Error{ErrorKind::kIo, fmt::format("{} (sample '{}')", st.error().message, key)};
    return {};
  }
  auto got = pread_full(fd, dst, n, offset, shard);
  if (!got) return Error{ErrorKind::kIo, fmt::format("{} (sample '{}')", got.error().message, key)};
  if (*got < n)
    return Error{ErrorKind::kIo, fmt::format("{}: offset {}: cannot read sample '{}': unexpected end of file (truncated shard?)", shard,
                                             offset + *got, key)};
  return {};
}
}  // namespace

Expected<Dataset::SampleRef> Dataset::read_located(std::uint64_t i, const std::function<unsigned char*(std::uint64_t)>& room, ReadCheck* check,
                                                     std::vector<std::uint64_t>& at) const {
  auto loc = locate(i);
  if (!loc) return loc.error();
  const SampleTable& t = *loc->entries;
  const std::size_t row = loc->row;
  SampleRef ref{loc->entries, row, loc->entries_ref};
  const auto* first = t.fields_begin(row);
  const auto* last = t.fields_end(row);
  // After a mapped read, the bytes up to `end` are the shard's only if it
  // still has them: checked here, or recorded for confirm() when the shard
  // stays open (its mapping is the one confirm() asks).
  std::uint64_t end = 0;
  auto checked = [&]() -> Status {
    if (!loc->map || end == 0) return {};
    if (!check || !impl_->shards[loc->shard]->settled.load(std::memory_order_acquire)) {
      if (Status st = loc->map->check_size(end); !st) return Error{ErrorKind::kIo, fmt::format("{} (sample '{}')", st.error().message, t.key(row))};
      return {};
    }
    for (auto& [s, furthest] : check->ends)
      if (s == loc->shard) {
        furthest = std::max(furthest, end);
        return {};
      }
    check->ends.emplace_back(loc->shard, end);
    return {};
  };
  at.clear();
  if (first == last) return ref;
  std::uint64_t lo = first->offset, hi = 0, total = 0;
  for (const auto* f = first; f != last; ++f) {
    lo = std::min(lo, f->offset);
    hi = std::max(hi, f->offset + f->size);
    total += f->size;
  }
  const std::string_view key = t.key(row);
  // Members written next to each other (every writer that keeps a sample
  // together) are one pread of their span, headers and padding included.
  // A sample scattered over its shard (tar's directory order) is read field
  // by field, so the members of other samples in between are not read.
  const std::uint64_t slack = 3 * kTarBlock * static_cast<std::uint64_t>(last - first);
  if (hi - lo <= total + slack) {
    if (Status st = pread_all(loc->file->get(), loc->map, room(hi - lo), hi - lo, lo, shards_[loc->shard], key); !st) return st.error();
    for (const auto* f = first; f != last; ++f) at.push_back(f->offset - lo);
    end = hi;
    if (Status st = checked(); !st) return st.error();
    return ref;
  }
  unsigned char* dst = room(total);
  std::uint64_t put = 0;
  for (const auto* f = first; f != last; ++f) {
    if (Status st = pread_all(loc->file->get(), loc->map, dst + put, f->size, f->offset, shards_[loc->shard], key); !st) return st.error();
    at.push_back(put);
    put += f->size;
    end = std::max(end, f->offset + f->size);
  }
  if (Status st = checked(); !st) return st.error();
  return ref;
}

Expected<SampleEntry> Dataset::read_span(std::uint64_t i, const std::function<unsigned char*(std::uint64_t)>& room, ReadCheck* check) const {
  std::vector<std::uint64_t> at;
  auto e = read_located(i, room, check, at);
  if (!e) return e.error();
  const SampleTable& t = *e->table;
  SampleEntry out;
  out.key = t.key(e->row);
  const auto* f = t.fields_begin(e->row);
  for (std::size_t k = 0; k < at.size(); ++k, ++f) out.fields.push_back({t.ext(f->ext), at[k], f->size});
  return out;
}

Expected<Dataset::SampleRef> Dataset::read_fields(std::uint64_t i, BatchBuffer& buf, ReadCheck* check, std::vector<std::uint64_t>& at) const {
  std::size_t base = 0;
  auto e = read_located(
      i,
      [&](std::uint64_t n) {
        base = buf.append(n);
        return buf.data() + base;
      },
      check, at);
  if (!e) return e.error();
  for (auto& a : at) a += base;
  return e;
}

void Dataset::prefetch(std::uint64_t i, int stage) const {
  if (i >= total_) return;
  const std::size_t s = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1);
  const Impl::Shard& sh = *impl_->shards[s];
  // Only a settled shard's entries and mapping are read without its lock.
  if (!sh.settled.load(std::memory_order_acquire) || !sh.map) return;
  const SampleTable& t = *sh.entries;
  const std::size_t row = i - starts_[s];
  if (stage >= 2) {
    t.prefetch_row(row);
    return;
  }
  const auto* first = t.fields_begin(row);
  const auto* last = t.fields_end(row);
  if (first == last) return;
  if (stage == 1) {
    __builtin_prefetch(t.key(row).data(), 0, 3);
    __builtin_prefetch(first, 0, 3);
    __builtin_prefetch(reinterpret_cast<const char*>(last) - 1, 0, 3);
    return;
  }
  // A loader reads every sample of the shard this epoch: a shard the page
  // cache holds is mapped whole now, so that its reads skip a page fault per
  // 2 MiB (or per 64 KiB of small folios). Only for a loader: a reader of a
  // few samples would pay for page tables of all of it.
  if (!sh.populated.load(std::memory_order_relaxed) && !sh.populated.exchange(true)) (void)sh.map->map_pages_if_cached();
  std::uint64_t lo = first->offset, hi = 0;
  for (const auto* f = first; f != last; ++f) {
    lo = std::min(lo, f->offset);
    hi = std::max(hi, f->offset + f->size);
  }
  sh.map->prefetch(lo, hi - lo);
}

Expected<Dataset::Sample> Dataset::read(std::uint64_t i) const {
  // One sample: a plain string holds the span (a BatchBuffer would map
  // 2 MiB for it).
  std::string span;
  auto e = read_span(i, [&](std::uint64_t n) {
    span.resize(n);
    return reinterpret_cast<unsigned char*>(span.data());
  });
  if (!e) return e.error();
  Sample out;
  out.key = std::move(e->key);
  for (const auto& f : e->fields) out.fields.emplace_back(f.ext, span.substr(f.offset, f.size));
  return out;
}

Expected<SampleEntry> Dataset::read_into(std::uint64_t i, BatchBuffer& buf) const { return read_into(i, buf, nullptr); }

Expected<SampleEntry> Dataset::read_into(std::uint64_t i, BatchBuffer& buf, ReadCheck* check) const {
  std::size_t base = 0;
  auto e = read_span(
      i,
      [&](std::uint64_t n) {
        base = buf.append(n);
        return buf.data() + base;
      },
      check);
  if (!e) return e.error();
  for (auto& f : e->fields) f.offset += base;
  return e;
}

Status Dataset::confirm(const ReadCheck& check) const {
  // Only settled shards are recorded: their mapping stays.
  for (const auto& [s, end] : check.ends)
    if (Status st = impl_->shards[s]->map->check_size(end); !st) return st;
  return {};
}

// ---------------------------------------------------------------------------
// Permutation: a 4-round Feistel network over 2*half_bits bits.

namespace {
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

Permutation::Permutation(std::uint64_t n, std::uint64_t seed, std::uint64_t epoch) : n_(n) {
  while ((1ULL << (2 * half_bits_)) < n && half_bits_ < 31) ++half_bits_;
  std::uint64_t k = mix(seed ^ mix(epoch + 0x1234567ULL));
  for (auto& key : keys_) {
    k = mix(k);
    key = k;
  }
}

std::uint64_t Permutation::operator()(std::uint64_t i) const {
  const std::uint64_t mask = (1ULL << half_bits_) - 1;
  std::uint64_t x = i;
  // Cycle-walking: the network permutes [0, 4^h) and 4^h < 4n, so a few
  // steps at most land back inside [0, n).
  do {
    std::uint64_t l = x >> half_bits_;
    std::uint64_t r = x & mask;
    for (std::uint64_t key : keys_) {
      const std::uint64_t nl = r;
      r = l ^ (mix(r ^ key) & mask);
      l = nl;
    }
    x = (l << half_bits_) | r;
  } while (x >= n_);
  return x;
}

void Permutation::fill(std::uint64_t lo, std::uint64_t hi, std::uint64_t* out) const {
  const std::uint64_t mask = (1ULL << half_bits_) - 1;
  constexpr int kLanes = 8;
  std::uint64_t x[kLanes], slot[kLanes];  // each lane's value being walked, and where it goes
  int live = 0;
  std::uint64_t next = lo;
  auto start = [&](int j) {
    if (next >= hi) return false;
    x[j] = next;
    slot[j] = next - lo;
    ++next;
    return true;
  };
  for (; live < kLanes && start(live); ++live) {
  }
  while (live > 0) {
    // One network pass on every live lane, the lanes' rounds interleaved.
    for (std::uint64_t key : keys_)
      for (int j = 0; j < live; ++j) {
        const std::uint64_t l = x[j] >> half_bits_, r = x[j] & mask;
        x[j] = (r << half_bits_) | (l ^ (mix(r ^ key) & mask));
      }
    for (int j = 0; j < live;) {
      if (x[j] >= n_) {
        ++j;  // cycle-walking: another pass
        continue;
      }
      out[slot[j]] = x[j];
      if (!start(j)) {
        --live;  // the last lane takes this one's place
        x[j] = x[live];
        slot[j] = slot[live];
      } else {
        ++j;
      }
    }
  }
}

// ---------------------------------------------------------------------------

std::uint64_t Partition::batches() const {
  const std::uint64_t gb = global_batch();
  if (gb == 0) return 0;
  return drop_last ? samples / gb : (samples + gb - 1) / gb;
}

std::pair<std::uint64_t, std::uint64_t> Partition::range(std::uint64_t g) const {
  const std::uint64_t gb = global_batch();
  const std::uint64_t b = batch_size;
  const std::uint64_t r = static_cast<std::uint64_t>(rank);
  const std::uint64_t w = static_cast<std::uint64_t>(world_size);
  const std::uint64_t start = g * gb;
  if (start + gb <= samples) return {start + r * b, start + (r + 1) * b};
  // The last, partial global batch: split as evenly as possible.
  const std::uint64_t rem = samples > start ? samples - start : 0;
  const std::uint64_t per = rem / w;
  const std::uint64_t extra = rem % w;
  const std::uint64_t lo = start + r * per + std::min(r, extra);
  return {lo, lo + per + (r < extra ? 1 : 0)};
}

}  // namespace pacer::data
