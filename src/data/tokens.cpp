// Megatron-Core indexed datasets (.bin + .idx, "MMIDIDX"): reading (pread, no mapping) and writing.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <limits>
#include <set>
#include <thread>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/mapped_file.hpp"
#include "pacer/data.hpp"
#include "loader_internal.hpp"

namespace pacer::data {

namespace {

constexpr char kHeader[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

struct DtypeInfo {
  int code;
  const char* name;
  std::size_t size;
  bool integer;
};
constexpr DtypeInfo kDtypes[] = {{1, "uint8", 1, true},    {2, "int8", 1, true},     {3, "int16", 2, true},
                                 {4, "int32", 4, true},    {5, "int64", 8, true},    {6, "float64", 8, false},
                                 {7, "float32", 4, false}, {8, "uint16", 2, true}};

const DtypeInfo* by_code(int code) {
  for (const auto& d : kDtypes)
    if (d.code == code) return &d;
  return nullptr;
}
const DtypeInfo* by_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

std::int64_t element(const void* base, std::size_t i, int code) {
  const auto* p = static_cast<const unsigned char*>(base);
  switch (code) {
    case 1: return p[i];
    case 2: return static_cast<std::int8_t>(p[i]);
    case 3: { std::int16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    case 4: { std::int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case 5: { std::int64_t v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case 8: { std::uint16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    default: return 0;
  }
}

template <class T>
void widen_as(const unsigned char* p, std::size_t n, std::int64_t* out) {
  for (std::size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof(T));
    out[i] = static_cast<std::int64_t>(v);
  }
}

#if defined(__x86_64__)
// The loader widens every token it delivers, from wherever a shuffled
// document lies. GCC's own vectorization of the plain loop (SSE2 at -O2)
// took 1.18-1.19x the time of copy_tokens with these loops over a shuffled
// 268 MB int32 .bin, one thread or two (bench/widen_tokens.cpp,
// bench/results/widen_tokens-2026-12-04.md): two independent 256-bit loads
// and stores per step keep more misses in flight. Chosen at run time, so
// one binary runs on any x86-64.
template <int kCode>
[[gnu::target("avx2")]] void widen_avx2(const unsigned char* p, std::size_t n, std::int64_t* out) {
  constexpr std::size_t kSize = kCode == 4 ? 4 : 2;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i a, b;
    if constexpr (kSize == 4) {
      a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * i));
      b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * i + 16));
    } else {
      a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 * i));
      b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 * i + 8));
    }
    __m256i wa, wb;
    if constexpr (kCode == 4) {
      wa = _mm256_cvtepi32_epi64(a);
      wb = _mm256_cvtepi32_epi64(b);
    } else if constexpr (kCode == 3) {
      wa = _mm256_cvtepi16_epi64(a);
      wb = _mm256_cvtepi16_epi64(b);
    } else {
      wa = _mm256_cvtepu16_epi64(a);
      wb = _mm256_cvtepu16_epi64(b);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), wa);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 4), wb);
  }
  for (; i < n; ++i) out[i] = element(p, i, kCode);
}

const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
#endif

// element() over n items, with the dtype decided once rather than per token
// (the loader widens every token it delivers).
void widen_into(const void* base, std::size_t n, int code, std::int64_t* out) {
  const auto* p = static_cast<const unsigned char*>(base);
#if defined(__x86_64__)
  if (kHaveAvx2) switch (code) {
      case 3: return widen_avx2<3>(p, n, out);
      case 4: return widen_avx2<4>(p, n, out);
      case 8: return widen_avx2<8>(p, n, out);
      default: break;
    }
#endif
  switch (code) {
    case 1: return widen_as<std::uint8_t>(p, n, out);
    case 2: return widen_as<std::int8_t>(p, n, out);
    case 3: return widen_as<std::int16_t>(p, n, out);
    case 4: return widen_as<std::int32_t>(p, n, out);
    case 5: return widen_as<std::int64_t>(p, n, out);
    case 8: return widen_as<std::uint16_t>(p, n, out);
    default:
      for (std::size_t i = 0; i < n; ++i) out[i] = element(p, i, code);
  }
}

}  // namespace

TokenDataset::~TokenDataset() {
  if (bin_fd_ >= 0) ::close(bin_fd_);
}

Expected<std::shared_ptr<TokenDataset>> TokenDataset::open(const std::string& prefix) {
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  // Read straight into the arrays: a copy of the whole file first touched
  // twice the memory, and a first touch costs ~10 us a page on a KVM guest
  // (bench/results/loader_folios-2026-12-05.md).
  auto fi = open_fd(idx_path, O_RDONLY);
  if (!fi) return fi.error();
  struct stat ist {};
  if (::fstat(fi->get(), &ist) != 0 || S_ISDIR(ist.st_mode)) return io_error("cannot read", idx_path, S_ISDIR(ist.st_mode) ? EISDIR : errno);
  const auto isize = static_cast<std::uint64_t>(ist.st_size);
  auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {}", idx_path, why)}; };
  constexpr std::size_t kFixed = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype code, sequence and document counts
  unsigned char head[kFixed] = {};
  auto got = pread_full(fi->get(), head, kFixed, 0, idx_path);
  if (!got) return got.error();
  if (*got < 9 || std::memcmp(head, kHeader, 9) != 0) return bad("not a Megatron indexed dataset (no MMIDIDX header)");
  if (*got < kFixed) return bad("truncated header");
  std::uint64_t version = 0, seqs = 0, docs = 0;
  std::uint8_t code = 0;
  std::memcpy(&version, head + 9, 8);
  std::memcpy(&code, head + 17, 1);
  std::memcpy(&seqs, head + 18, 8);
  std::memcpy(&docs, head + 26, 8);
  if (version != 1) return bad(fmt::format("version {} (pacer reads 1)", version));
  const DtypeInfo* dt = by_code(code);
  if (!dt) return bad(fmt::format("unknown dtype code {}", code));
  // Counts beyond the file's size are refused before they are multiplied.
  if (seqs > isize || docs > isize)
    return bad(fmt::format("truncated: {} sequences and {} document indices cannot fit the {}-byte file", seqs, docs, isize));
  const std::uint64_t need = seqs * 4 + seqs * 8 + docs * 8;
  if (isize - kFixed < need)
    return bad(fmt::format("truncated: {} sequences and {} document indices need {} more bytes, the file has {}", seqs, docs, need, isize - kFixed));
  std::shared_ptr<TokenDataset> ds(new TokenDataset());
  ds->prefix_ = prefix;
  ds->dtype_ = dt->name;
  ds->itemsize_ = dt->size;
  ds->lengths_.resize(seqs);
  ds->pointers_.resize(seqs);
  ds->doc_index_.resize(docs);
  std::uint64_t at = kFixed;
  for (auto [dst, n] : {std::pair<void*, std::uint64_t>{ds->lengths_.data(), seqs * 4}, {ds->pointers_.data(), seqs * 8}, {ds->doc_index_.data(), docs * 8}}) {
    if (n == 0) continue;  // an empty vector's data() may be null
    if (Status st = pread_exact(fi->get(), dst, static_cast<std::size_t>(n), at, idx_path); !st) return st.error();
    at += n;
  }

  ds->bin_fd_ = ::open(bin_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (ds->bin_fd_ < 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", bin_path, std::strerror(errno))};
  struct stat st {};
  if (::fstat(ds->bin_fd_, &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", bin_path, std::strerror(errno))};
  if (!S_ISREG(st.st_mode)) return Error{ErrorKind::kConfig, fmt::format("{}: not a regular file", bin_path)};
  ds->bin_size_ = static_cast<std::uint64_t>(st.st_size);
  // Read through a guarded mapping (docs/data.md, "Token datasets"); one that
  // cannot be made leaves the .bin to pread.
  if (auto m = MappedFile::map(ds->bin_fd_, bin_path)) ds->bin_map_ = std::make_unique<MappedFile>(std::move(*m));
  for (std::uint64_t i = 0; i < seqs; ++i) {
    const auto len = ds->lengths_[i];
    const auto ptr = ds->pointers_[i];
    // len < 2^31 and itemsize <= 8, so the end cannot wrap.
    if (len < 0 || ptr < 0 || static_cast<std::uint64_t>(ptr) + static_cast<std::uint64_t>(len) * dt->size > ds->bin_size_)
      return Error{ErrorKind::kConfig, fmt::format("{}: sequence {} ({} elements at byte {}) lies outside {} ({} bytes: truncated?)", idx_path, i, len,
                                                   ptr, bin_path, ds->bin_size_)};
    // Megatron's pointers are sums of whole elements; one between elements
    // would read every token of the sequence shifted (garbage ids).
    if (static_cast<std::uint64_t>(ptr) % dt->size != 0)
      return bad(fmt::format("sequence {} starts at byte {}, not on a {}-byte {} element", i, ptr, dt->size, dt->name));
    ds->total_tokens_ += static_cast<std::uint64_t>(len);
  }
  for (std::uint64_t d = 0; d < docs; ++d) {
    const auto v = ds->doc_index_[d];
    if (v < 0 || static_cast<std::uint64_t>(v) > seqs || (d > 0 && v < ds->doc_index_[d - 1]))
      return bad(fmt::format("document index {} is {}: not a sequence boundary in order", d, v));
  }
  // Documents cover the sequences from the first to the last: an index that
  // starts later or ends earlier would leave sequences out of every epoch.
  // (Bytes after the document index are allowed: Megatron's multimodal
  // datasets put the sequence modes there.)
  if (docs == 0 ? seqs > 0 : ds->doc_index_.front() != 0 || static_cast<std::uint64_t>(ds->doc_index_.back()) != seqs)
    return bad(fmt::format("document indices {} .. {} do not span the {} sequences (they must run from 0 to {})",
                           docs ? ds->doc_index_.front() : 0, docs ? ds->doc_index_.back() : 0, seqs, seqs));
  if (Status st = attach_loss_mask(*ds, ds->mask_); !st) return st.error();
  return ds;
}

Status TokenDataset::read_bin(std::uint64_t offset, std::size_t n, void* out, std::uint64_t seq) const {
  const std::string bin = prefix_ + ".bin";
  auto got = pread_full(bin_fd_, out, n, offset, bin);
  if (!got) return Error{ErrorKind::kIo, fmt::format("{} (sequence {})", got.error().message, seq)};
  if (*got < n) {
    struct stat st {};
    const long long now = ::fstat(bin_fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
    return Error{ErrorKind::kIo, fmt::format("{}: sequence {} ends at byte {}, but the file now has {} bytes ({} when opened): truncated while open",
                                             bin, seq, offset + n, now, bin_size_)};
  }
  return {};
}

namespace {
struct WidenTo {
  int code;
  std::size_t n;
  std::int64_t* out;
};
void widen_mapped(const unsigned char* p, std::size_t, void* ctx) {
  const auto* w = static_cast<const WidenTo*>(ctx);
  widen_into(p, w->n, w->code, w->out);
}
}  // namespace

Status TokenDataset::check_size(std::uint64_t furthest) const {
  if (!bin_map_ || furthest == 0) return {};
  return bin_map_->check_size(furthest);
}

Status TokenDataset::widen(std::uint64_t seq, std::uint64_t first, std::uint64_t n, std::int64_t* out, std::uint64_t* furthest) const {
  const DtypeInfo* dt = by_name(dtype_);
  const std::uint64_t base = static_cast<std::uint64_t>(pointers_[seq]) + first * itemsize_;
  if (bin_map_) {
    // Straight from the mapping into `out`: no system call and no bounce buffer.
    const std::size_t bytes = static_cast<std::size_t>(n * itemsize_);
    WidenTo w{dt->code, static_cast<std::size_t>(n), out};
    Status st = dt->code == 5 ? bin_map_->copy(base, bytes, out) : bin_map_->read(base, bytes, widen_mapped, &w);
    if (st && furthest) *furthest = std::max(*furthest, base + bytes);
    else if (st) st = bin_map_->check_size(base + bytes);
    if (!st) return Error{ErrorKind::kIo, fmt::format("{} (sequence {})", st.error().message, seq)};
    return {};
  }
  if (dt->code == 5) return read_bin(base, static_cast<std::size_t>(n * 8), out, seq);
  unsigned char buf[64 << 10];
  const std::uint64_t per = sizeof(buf) / itemsize_;
  for (std::uint64_t done = 0; done < n;) {
    const std::uint64_t k = std::min(per, n - done);
    if (Status st = read_bin(base + done * itemsize_, static_cast<std::size_t>(k * itemsize_), buf, seq); !st) return st;
    widen_into(buf, static_cast<std::size_t>(k), dt->code, out + done);
    done += k;
  }
  return {};
}

Expected<std::string> TokenDataset::bytes(std::uint64_t seq) const {
  if (seq >= sequences()) return Error{ErrorKind::kUsage, fmt::format("{}: sequence {} of {}", prefix_, seq, sequences())};
  std::string out(static_cast<std::size_t>(length(seq) * itemsize_), '\0');
  if (Status st = read_bin(static_cast<std::uint64_t>(pointers_[seq]), out.size(), out.data(), seq); !st) return st.error();
  return out;
}

Expected<std::vector<std::int64_t>> TokenDataset::read(std::uint64_t seq) const {
  if (seq >= sequences()) return Error{ErrorKind::kUsage, fmt::format("{}: sequence {} of {}", prefix_, seq, sequences())};
  const DtypeInfo* dt = by_name(dtype_);
  if (!dt->integer) return Error{ErrorKind::kUsage, fmt::format("{}: dtype {} holds no token ids", prefix_, dtype_)};
  std::vector<std::int64_t> out(length(seq));
  if (Status st = widen(seq, 0, out.size(), out.data()); !st) return st.error();
  return out;
}

std::pair<std::uint64_t, std::uint64_t> TokenDataset::document(std::uint64_t d) const {
  return {static_cast<std::uint64_t>(doc_index_.at(d)), static_cast<std::uint64_t>(doc_index_.at(d + 1))};
}

Status write_token_dataset(const std::string& prefix, const std::string& dtype,
                           const std::vector<std::vector<std::int64_t>>& documents) {
  const DtypeInfo* dt = by_name(dtype);
  if (!dt || !dt->integer) return Error{ErrorKind::kUsage, fmt::format("token dtype '{}' (uint8, int8, int16, uint16, int32, int64)", dtype)};
  std::int64_t lo = 0, hi = 0;
  switch (dt->code) {
    case 1: lo = 0; hi = 255; break;
    case 2: lo = -128; hi = 127; break;
    case 3: lo = -32768; hi = 32767; break;
    case 8: lo = 0; hi = 65535; break;
    case 4: lo = std::numeric_limits<std::int32_t>::min(); hi = std::numeric_limits<std::int32_t>::max(); break;
    default: lo = std::numeric_limits<std::int64_t>::min(); hi = std::numeric_limits<std::int64_t>::max();
  }
  std::string bin;
  std::string idx(kHeader, 9);
  put<std::uint64_t>(idx, 1);
  put<std::uint8_t>(idx, static_cast<std::uint8_t>(dt->code));
  put<std::uint64_t>(idx, documents.size());
  put<std::uint64_t>(idx, documents.size() + 1);
  std::vector<std::int64_t> pointers;
  for (std::size_t d = 0; d < documents.size(); ++d) {
    const auto& doc = documents[d];
    if (doc.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      return Error{ErrorKind::kUsage, fmt::format("document {} has too many tokens for the format", d)};
    pointers.push_back(static_cast<std::int64_t>(bin.size()));
    for (std::int64_t t : doc) {
      if (t < lo || t > hi) return Error{ErrorKind::kUsage, fmt::format("document {}: token {} does not fit {}", d, t, dtype)};
      const std::uint64_t u = static_cast<std::uint64_t>(t);
      bin.append(reinterpret_cast<const char*>(&u), dt->size);  // little-endian low bytes
    }
  }
  for (const auto& doc : documents) put<std::int32_t>(idx, static_cast<std::int32_t>(doc.size()));
  for (auto p : pointers) put<std::int64_t>(idx, p);
  for (std::size_t d = 0; d <= documents.size(); ++d) put<std::int64_t>(idx, static_cast<std::int64_t>(d));
  if (Status st = write_file_atomic(prefix + ".bin", bin); !st) return st;
  return write_file_atomic(prefix + ".idx", idx);
}

}  // namespace pacer::data

namespace pacer::data {

std::uint64_t TokenDataset::document_tokens(std::uint64_t d) const {
  auto [first, last] = document(d);
  std::uint64_t n = 0;
  for (std::uint64_t q = first; q < last; ++q) n += length(q);
  return n;
}

void TokenDataset::prefetch(std::uint64_t d, std::uint64_t offset, int stage) const {
  if (doc_index_.size() < 2 || d >= doc_index_.size() - 1) return;  // d + 1 would wrap for d = 2^64 - 1
  if (stage >= 2) {
    __builtin_prefetch(&doc_index_[d], 0, 3);
    __builtin_prefetch(&doc_index_[d + 1], 0, 3);
    return;
  }
  const auto first = static_cast<std::uint64_t>(doc_index_[d]);
  if (first >= lengths_.size()) return;
  if (stage == 1) {
    __builtin_prefetch(&lengths_[first], 0, 3);
    __builtin_prefetch(&pointers_[first], 0, 3);
    return;
  }
  if (!bin_map_) return;
  // Within the first sequence only: a piece further in is found by the copy.
  const auto len = static_cast<std::uint64_t>(lengths_[first]);
  if (offset >= len) return;
  bin_map_->prefetch(static_cast<std::uint64_t>(pointers_[first]) + offset * itemsize_, static_cast<std::size_t>((len - offset) * itemsize_));
}

Status TokenDataset::copy_tokens(std::uint64_t d, std::uint64_t offset, std::uint64_t count, std::int64_t* out) const {
  return copy_tokens(d, offset, count, out, nullptr);
}

Status TokenDataset::copy_tokens(std::uint64_t d, std::uint64_t offset, std::uint64_t count, std::int64_t* out, std::uint64_t* furthest) const {
  if (d >= documents()) return Error{ErrorKind::kUsage, fmt::format("{}: document {} of {}", prefix_, d, documents())};
  const DtypeInfo* dt = by_name(dtype_);
  if (!dt->integer) return Error{ErrorKind::kUsage, fmt::format("{}: dtype {} holds no token ids", prefix_, dtype_)};
  auto [first, last] = document(d);
  for (std::uint64_t q = first; q < last && count > 0; ++q) {
    const std::uint64_t len = length(q);
    if (offset >= len) {
      offset -= len;
      continue;
    }
    const std::uint64_t n = std::min(count, len - offset);
    if (Status st = widen(q, offset, n, out, furthest); !st) return st;
    out += n;
    count -= n;
    offset = 0;
  }
  if (count > 0) return Error{ErrorKind::kUsage, fmt::format("{}: document {} ends {} tokens short of the range asked for", prefix_, d, count)};
  return {};
}

namespace {

// Packs the windows of order[lo, hi) (lo at a window's start) and appends
// their rows to `out`. Rows are laid out without a vector per row: each
// piece is given its row, then placed by a counting pass.
Status pack_windows(const TokenDataset& ds, const std::uint64_t* order, std::size_t lo, std::size_t hi, std::uint64_t seq_len,
                    std::uint64_t window, PackPlan& out) {
  std::vector<PackPiece> pieces, sorted;
  std::vector<std::uint64_t> keys;
  std::vector<std::size_t> row_of;
  std::vector<std::uint64_t> used;  // tokens per row of the window
  std::vector<std::size_t> at;
  // Open rows of the window by remaining room, then row number: the
  // smallest room that fits, ties to the earliest row (best fit). A full
  // row is left out: no piece is empty, so none would fit it.
  std::set<std::pair<std::uint64_t, std::size_t>> room;
  // A piece or so per document: growing by doubling touched fresh memory twice.
  out.pieces.reserve(out.pieces.size() + (hi - lo) + (hi - lo) / 4);
  for (std::size_t w = lo; w < hi; w += window) {
    pieces.clear();
    const std::size_t end = std::min<std::size_t>(hi, w + window);
    for (std::size_t k = w; k < end; ++k) {
      const std::uint64_t d = order[k];
      if (d >= ds.documents()) return Error{ErrorKind::kUsage, fmt::format("document {} of {}", d, ds.documents())};
      // Shuffled documents' index entries lie anywhere: ask for them ahead.
      if (k + 16 < end) ds.prefetch(order[k + 16], 0, 2);
      if (k + 8 < end) ds.prefetch(order[k + 8], 0, 1);
      const std::uint64_t n = ds.document_tokens(d);
      for (std::uint64_t off = 0; off < n; off += seq_len) pieces.push_back({d, off, std::min(seq_len, n - off)});
    }
    // Longest first; equal lengths keep their order in the window. Sorted
    // as 64-bit keys (room first, then position), which needs no buffer and
    // moves 8 bytes rather than a 24-byte piece.
    if (pieces.size() < (1ull << 32)) {
      keys.resize(pieces.size());
      for (std::size_t k = 0; k < pieces.size(); ++k) keys[k] = ((seq_len - pieces[k].length) << 32) | k;
      std::sort(keys.begin(), keys.end());
      sorted.resize(pieces.size());
      for (std::size_t k = 0; k < pieces.size(); ++k) sorted[k] = pieces[keys[k] & 0xffffffffu];
      pieces.swap(sorted);
    } else {
      std::stable_sort(pieces.begin(), pieces.end(), [](const PackPiece& a, const PackPiece& b) { return a.length > b.length; });
    }
    row_of.resize(pieces.size());
    used.clear();
    room.clear();
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const std::uint64_t len = pieces[k].length;
      auto it = room.lower_bound({len, 0});
      std::size_t r;
      decltype(room)::node_type node;  // a row moving to less room keeps its node: no free and malloc
      if (it == room.end()) {
        r = used.size();
        used.push_back(0);
      } else {
        r = it->second;
        node = room.extract(it);
      }
      row_of[k] = r;
      used[r] += len;
      if (used[r] < seq_len) {
        if (node) {
          node.value().first = seq_len - used[r];
          room.insert(std::move(node));
        } else {
          room.insert({seq_len - used[r], r});
        }
      }
      out.stats.tokens += len;
    }
    // Row r's pieces in the order they went in, rows in order of opening.
    at.assign(used.size() + 1, 0);
    for (std::size_t k = 0; k < pieces.size(); ++k) ++at[row_of[k] + 1];
    for (std::size_t r = 0; r < used.size(); ++r) at[r + 1] += at[r];
    const std::size_t base = out.pieces.size();
    out.pieces.resize(base + pieces.size());
    for (std::size_t r = 0; r < used.size(); ++r) {
      out.first_piece.push_back(base + at[r + 1]);
      out.stats.padding += seq_len - used[r];
    }
    for (std::size_t k = 0; k < pieces.size(); ++k) out.pieces[base + at[row_of[k]]++] = pieces[k];
  }
  return {};
}

}  // namespace

Expected<PackPlan> plan_packing(const TokenDataset& ds, const std::vector<std::uint64_t>& order, std::uint64_t seq_len,
                                std::uint64_t window, int threads) {
  if (seq_len == 0) return Error{ErrorKind::kUsage, "seq_len must be positive"};
  if (seq_len > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) return Error{ErrorKind::kUsage, "seq_len too large"};
  if (window == 0) window = 1;
  PackPlan plan;
  plan.seq_len = seq_len;
  // Windows are packed independently, so threads take runs of whole
  // windows and the runs are joined in order: the plan does not depend on
  // the thread count. Below ~16 windows a thread costs more than it saves.
  const std::size_t windows = (order.size() + window - 1) / window;
  const std::size_t parts = std::min<std::size_t>(static_cast<std::size_t>(std::max(1, threads)), windows / 16);
  if (parts <= 1) {
    if (Status st = pack_windows(ds, order.data(), 0, order.size(), seq_len, window, plan); !st) return st.error();
  } else {
    // The first run is packed into the plan itself, reserved for all of
    // them, and the others are appended to it: packing every run apart and
    // copying all of them into a new plan touched twice the fresh memory (a
    // page fault per 4 KiB, tens of microseconds each on the VM) and copied
    // every piece: bench/results/tokens_plan-2026-12-06.md.
    std::vector<PackPlan> part(parts);
    std::vector<Status> status(parts);
    plan.pieces.reserve(order.size() + order.size() / 4);
    auto run = [&](std::size_t t) {
      const std::size_t lo = std::min(order.size(), windows * t / parts * window);
      const std::size_t hi = std::min(order.size(), windows * (t + 1) / parts * window);
      PackPlan& out = t == 0 ? plan : part[t];
      if (t > 0) out.first_piece.clear();
      status[t] = pack_windows(ds, order.data(), lo, hi, seq_len, window, out);
    };
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < parts; ++t) pool.emplace_back(run, t);
    run(0);
    for (auto& t : pool) t.join();
    for (std::size_t t = 0; t < parts; ++t)
      if (!status[t]) return status[t].error();
    std::size_t pieces = plan.pieces.size(), rows = plan.first_piece.size();
    for (std::size_t t = 1; t < parts; ++t) {
      pieces += part[t].pieces.size();
      rows += part[t].first_piece.size();
    }
    plan.pieces.reserve(pieces);
    plan.first_piece.reserve(rows);
    for (std::size_t t = 1; t < parts; ++t) {
      const PackPlan& p = part[t];
      const std::size_t base = plan.pieces.size();
      plan.pieces.insert(plan.pieces.end(), p.pieces.begin(), p.pieces.end());
      for (auto f : p.first_piece) plan.first_piece.push_back(base + f);
      plan.stats.tokens += p.stats.tokens;
      plan.stats.padding += p.stats.padding;
    }
  }
  plan.stats.sequences = plan.rows();
  return plan;
}

Expected<std::vector<PackedSequence>> pack_documents(const TokenDataset& ds, const std::vector<std::uint64_t>& order,
                                                     std::uint64_t seq_len, std::uint64_t window, std::int64_t pad_id,
                                                     PackStats* stats) {
  auto plan = plan_packing(ds, order, seq_len, window);
  if (!plan) return plan.error();
  std::vector<PackedSequence> out(plan->rows());
  for (std::uint64_t r = 0; r < plan->rows(); ++r) {
    PackedSequence& s = out[r];
    s.tokens.assign(seq_len, pad_id);
    s.position_ids.assign(seq_len, 0);
    s.cu_seqlens.push_back(0);
    std::uint64_t at = 0;
    for (std::uint64_t k = plan->first_piece[r]; k < plan->first_piece[r + 1]; ++k) {
      const PackPiece& p = plan->pieces[k];
      if (Status st = ds.copy_tokens(p.document, p.offset, p.length, s.tokens.data() + at); !st) return st.error();
      for (std::uint64_t i = 0; i < p.length; ++i) s.position_ids[at + i] = static_cast<std::int32_t>(i);
      at += p.length;
      s.cu_seqlens.push_back(static_cast<std::int32_t>(at));
      s.documents.push_back(p.document);
    }
  }
  if (stats) *stats = plan->stats;
  return out;
}

}  // namespace pacer::data

namespace pacer::data {

Expected<Vocabulary> Vocabulary::load(const std::string& path) {
  auto text = read_file(path);
  if (!text) return text.error();
  Vocabulary v;
  std::size_t pos = 0;
  std::size_t line = 0;
  while (pos < text->size()) {
    std::size_t end = text->find('\n', pos);
    if (end == std::string::npos) end = text->size();
    std::string tok = text->substr(pos, end - pos);
    if (!tok.empty() && tok.back() == '\r') tok.pop_back();
    ++line;
    pos = end + 1;
    if (tok.empty()) return Error{ErrorKind::kConfig, fmt::format("{}:{}: empty token", path, line)};
    if (!v.ids_.emplace(tok, static_cast<std::int64_t>(v.tokens_.size())).second)
      return Error{ErrorKind::kConfig, fmt::format("{}:{}: token '{}' appears twice", path, line, tok)};
    v.max_len_ = std::max(v.max_len_, tok.size());
    v.tokens_.push_back(std::move(tok));
  }
  return v;
}

std::vector<std::int64_t> Vocabulary::encode(std::string_view text) const {
  std::vector<std::int64_t> out;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t n = std::min(max_len_, text.size() - i);
    for (; n > 0; --n) {
      auto it = ids_.find(std::string(text.substr(i, n)));
      if (it != ids_.end()) {
        out.push_back(it->second);
        break;
      }
    }
    if (n == 0) {
      out.push_back(static_cast<std::int64_t>(tokens_.size()) + static_cast<unsigned char>(text[i]));
      n = 1;
    }
    i += n;
  }
  return out;
}

std::string Vocabulary::decode(const std::vector<std::int64_t>& ids) const {
  std::string out;
  for (auto id : ids) {
    if (id >= 0 && static_cast<std::size_t>(id) < tokens_.size()) out += tokens_[static_cast<std::size_t>(id)];
    else out.push_back(static_cast<char>(id - static_cast<std::int64_t>(tokens_.size())));
  }
  return out;
}

}  // namespace pacer::data
