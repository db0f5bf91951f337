// `pacer shard tokenize`: text and JSON lines to PREFIX.bin/.idx and a manifest, encoded on every core.
#include "pacer/data/tokenize.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::data {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }
Error config_error(std::string m) { return Error{ErrorKind::kConfig, std::move(m)}; }

using XxhState = std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)>;
XxhState new_xxh3() {
  XxhState s(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(s.get());
  return s;
}

// The length of the UTF-8 sequence at p (1-4), or, for an ill-formed one,
// minus the length of its maximal subpart (Unicode 15, 3.9 "U+FFFD
// substitution of maximal subparts"), so that one U+FFFD replaces it.
int utf8_step(const unsigned char* p, std::size_t n) {
  const unsigned char c = p[0];
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c == 0xE0) len = 3, lo = 0xA0;
  else if (c == 0xED) len = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) len = 3;
  else if (c == 0xF0) len = 4, lo = 0x90;
  else if (c == 0xF4) len = 4, hi = 0x8F;
  else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else return -1;
  for (int i = 1; i < len; ++i) {
    if (static_cast<std::size_t>(i) >= n || p[i] < lo || p[i] > hi) return -i;
    lo = 0x80, hi = 0xBF;
  }
  return len;
}

// The offset of the first ill-formed byte, or npos.
std::size_t first_bad_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t i = 0; i < s.size();) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const int k = utf8_step(p + i, s.size() - i);
    if (k < 0) return i;
    i += static_cast<std::size_t>(k);
  }
  return std::string_view::npos;
}

std::string replace_bad_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t i = 0; i < s.size();) {
    const int k = utf8_step(p + i, s.size() - i);
    if (k > 0) {
      out.append(s.data() + i, static_cast<std::size_t>(k));
      i += static_cast<std::size_t>(k);
    } else {
      out += kReplacement;
      i += static_cast<std::size_t>(-k);
    }
  }
  return out;
}

bool is_jsonl(const std::string& path) { return path.ends_with(".jsonl") || path.ends_with(".json"); }

// ---------------------------------------------------------------------------
// The tokenizers.

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string path, std::uint64_t xxh3) : path_(std::move(path)), xxh3_(xxh3) {}
  sentencepiece::SentencePieceProcessor& processor() { return sp_; }

  Status encode(const std::vector<std::string_view>& docs, std::vector<std::int64_t>& ids,
                std::vector<std::uint64_t>& lengths) const override {
    // Encode(text, &ids) builds and frees a SentencePieceText per document;
    // one reused for the whole batch keeps its pieces' allocations (Encode
    // clears it), so a thread allocates little per document.
    sentencepiece::ImmutableSentencePieceText spt;
    for (const auto& d : docs) {
      // Encode is const and keeps no state, so threads share one processor.
      const auto st = sp_.Encode(d, spt.mutable_proto());
      if (!st.ok()) return Error{ErrorKind::kRuntime, fmt::format("{}: {}", path_, st.ToString())};
      const std::size_t n = spt.pieces_size();
      for (std::size_t i = 0; i < n; ++i) ids.push_back(spt.pieces(static_cast<int>(i)).id());
      lengths.push_back(n);
    }
    return {};
  }
  std::uint64_t vocab_size() const override { return static_cast<std::uint64_t>(sp_.GetPieceSize()); }
  std::optional<std::int64_t> eos_id() const override {
    const int e = sp_.eos_id();
    return e >= 0 ? std::optional<std::int64_t>(e) : std::nullopt;
  }
  json identity() const override {
    const auto e = eos_id();
    return {{"kind", "sentencepiece"}, {"path", path_}, {"xxh3", hex64(xxh3_)}, {"vocab_size", vocab_size()},
            {"eos_id", e ? json(*e) : json(nullptr)}};
  }

 private:
  std::string path_;
  std::uint64_t xxh3_;
  sentencepiece::SentencePieceProcessor sp_;
};

class VocabularyTokenizer final : public Tokenizer {
 public:
  VocabularyTokenizer(Vocabulary v, std::string path, std::uint64_t xxh3) : v_(std::move(v)), path_(std::move(path)), xxh3_(xxh3) {}
  Status encode(const std::vector<std::string_view>& docs, std::vector<std::int64_t>& ids,
                std::vector<std::uint64_t>& lengths) const override {
    for (const auto& d : docs) {
      const auto e = v_.encode(d);
      ids.insert(ids.end(), e.begin(), e.end());
      lengths.push_back(e.size());
    }
    return {};
  }
  std::uint64_t vocab_size() const override { return v_.id_limit(); }
  std::optional<std::int64_t> eos_id() const override { return std::nullopt; }
  json identity() const override {
    if (path_.empty()) return {{"kind", "bytes"}, {"vocab_size", vocab_size()}};
    return {{"kind", "vocabulary"}, {"path", path_}, {"xxh3", hex64(xxh3_)}, {"vocab_size", vocab_size()}};
  }

 private:
  Vocabulary v_;
  std::string path_;
  std::uint64_t xxh3_;
};

// ---------------------------------------------------------------------------
// The pipeline: one thread reads chunks of whole lines and writes results in
// order; `threads` workers turn chunks into encoded tokens.

struct Chunk {
  std::size_t input = 0;
  std::uint64_t first_line = 1;  // of the chunk's first byte, 1-based
  std::string text;
  bool whole_file = false;  // the file is one document
};

struct Encoded {
  std::string bytes;                  // the tokens in the output dtype
  std::vector<std::uint64_t> lengths;  // per document written, eod included
  std::uint64_t tokens = 0, empty = 0, bad_utf8 = 0, first_bad_utf8_line = 0;
  std::optional<Error> error;
};

struct Context {
  const TokenizeOptions& o;
  const Tokenizer& tok;
  std::optional<std::int64_t> eod;
  std::uint64_t id_limit;
  std::size_t itemsize;
};

std::uint64_t line_of(const Chunk& c, std::size_t offset) {
  return c.first_line + static_cast<std::uint64_t>(std::count(c.text.begin(), c.text.begin() + static_cast<std::ptrdiff_t>(offset), '\n'));
}

Encoded encode_chunk(const Context& cx, const Chunk& c) {
  Encoded out;
  const std::string& path = cx.o.inputs[c.input];
  const bool jsonl = is_jsonl(path);
  std::vector<std::string_view> docs;
  std::vector<std::uint64_t> doc_lines;
  std::deque<std::string> owned;  // texts that are not slices of the chunk (a deque: views stay valid)
  auto fail = [&](Error e) {
    out.error = std::move(e);
    return std::move(out);
  };

  // A document's raw bytes `s` (at chunk offset `at`, on line `line`)
  // checked for UTF-8: kept, replaced (s then views the repaired copy),
  // or dropped (false); under kFail out.error is set.
  auto check_utf8 = [&](std::string_view& s, std::size_t at, std::uint64_t line) -> bool {
    const std::size_t bad = first_bad_utf8(s);
    if (bad == std::string_view::npos) return true;
    std::uint64_t column = bad + 1;
    if (c.whole_file) {
      const std::size_t abs = at + bad;
      const std::size_t nl = abs == 0 ? std::string::npos : c.text.rfind('\n', abs - 1);
      line = line_of(c, abs);
      column = abs - (nl == std::string::npos ? 0 : nl + 1) + 1;
    }
    if (cx.o.bad_utf8 == BadUtf8::kFail) {
      out.error = config_error(fmt::format("{}:{}: not valid UTF-8 (byte {} of the line); --bad-utf8 replace or skip goes on", path, line, column));
      return false;
    }
    ++out.bad_utf8;
    if (!out.first_bad_utf8_line) out.first_bad_utf8_line = line;
    if (cx.o.bad_utf8 == BadUtf8::kSkip) return false;
    s = owned.emplace_back(replace_bad_utf8(s));
    return true;
  };

  if (c.whole_file) {
    std::string_view s(c.text);
    const bool keep = check_utf8(s, 0, c.first_line);
    if (out.error) return out;
    if (keep) {
      docs.push_back(s);
      doc_lines.push_back(c.first_line);
    }
  } else {
    std::uint64_t line = c.first_line;
    for (std::size_t pos = 0; pos < c.text.size(); ++line) {
      std::size_t end = c.text.find('\n', pos);
      if (end == std::string::npos) end = c.text.size();
      std::string_view l(c.text.data() + pos, end - pos);
      const std::size_t at = pos;
      pos = end + 1;
      if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
      if (l.empty()) continue;  // blank lines separate documents, they are none
      const bool keep = check_utf8(l, at, line);
      if (out.error) return out;
      if (!keep) continue;
      if (jsonl) {
        json j;
        try {
          j = json::parse(l);
        } catch (const json::parse_error& e) {
          // Say why: a lone UTF-16 surrogate escape ("\ud800") is invalid JSON, not bad UTF-8 bytes,
          // so --bad-utf8 does not apply to it.
          return fail(config_error(fmt::format("{}:{}: not valid JSON: {}", path, line, e.what())));
        }
        if (!j.is_object() || !j.contains(cx.o.field) || !j[cx.o.field].is_string())
          return fail(config_error(fmt::format("{}:{}: not a JSON object with a string field '{}'", path, line, cx.o.field)));
        l = owned.emplace_back(j[cx.o.field].get<std::string>());
      }
      docs.push_back(l);
      doc_lines.push_back(line);
    }
  }

  std::vector<std::int64_t> ids;
  std::vector<std::uint64_t> lengths;
  if (Status st = cx.tok.encode(docs, ids, lengths); !st) 
    return fail(Error{st.error().kind, fmt::format("{}: lines {}-{}: {}", path, c.first_line, line_of(c, c.text.size()), st.error().message)});
  if (lengths.size() != docs.size())
    return fail(Error{ErrorKind::kRuntime, fmt::format("{}: the tokenizer returned {} documents for {}", path, lengths.size(), docs.size())});
  std::uint64_t total = 0;
  for (auto n : lengths) total += n;
  if (total != ids.size())
    return fail(Error{ErrorKind::kRuntime, fmt::format("{}: the tokenizer's lengths add up to {} ids, it returned {}", path, total, ids.size())});

  out.bytes.reserve((ids.size() + docs.size()) * cx.itemsize);
  std::size_t k = 0;
  auto put = [&](std::int64_t id) {
    const auto u = static_cast<std::uint64_t>(id);
    out.bytes.append(reinterpret_cast<const char*>(&u), cx.itemsize);  // little-endian low bytes
  };
  for (std::size_t d = 0; d < docs.size(); ++d) {
    const std::uint64_t n = lengths[d];
    if (n == 0) {  // no text, or none the model keeps: an eod alone is no document
      ++out.empty;
      continue;
    }
    for (std::uint64_t i = 0; i < n; ++i, ++k) {
      const std::int64_t id = ids[k];
      if (id < 0 || static_cast<std::uint64_t>(id) >= cx.id_limit)
        return fail(config_error(fmt::format("{}:{}: token id {} outside the tokenizer's vocabulary of {}", path, doc_lines[d], id, cx.id_limit)));
      put(id);
    }
    if (cx.eod) put(*cx.eod);
    const std::uint64_t len = n + (cx.eod ? 1 : 0);
    if (len > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
      return fail(config_error(fmt::format("{}:{}: a document of {} tokens does not fit the format's int32 length", path, doc_lines[d], len)));
    out.lengths.push_back(len);
    out.tokens += len;
  }
  return out;
}

template <class T>
void put_le(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

class Pipeline {
 public:
  Pipeline(const Context& cx, int threads, std::size_t max_in_flight) : cx_(cx), max_in_flight_(max_in_flight) {
    for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { work(); });
  }
  ~Pipeline() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  // Queues a chunk; first hands back finished ones, in order, while too many are in flight.
  template <class Sink>
  Status push(Chunk c, Sink& sink) {
    while (pushed_ - taken_ >= max_in_flight_)
      if (Status st = take(sink); !st) return st;
    {
      std::lock_guard<std::mutex> lk(mu_);
      todo_.emplace_back(pushed_++, std::move(c));
    }
    work_cv_.notify_one();
    return {};
  }
  template <class Sink>
  Status drain(Sink& sink) {
    while (taken_ < pushed_)
      if (Status st = take(sink); !st) return st;
    return {};
  }

 private:
  template <class Sink>
  Status take(Sink& sink) {
    std::pair<std::size_t, Encoded> r;
    {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return done_.count(taken_) > 0; });
      auto it = done_.find(taken_);
      r = std::move(it->second);
      done_.erase(it);
    }
    ++taken_;
    if (r.second.error) return *r.second.error;
    return sink(r.first, r.second);
  }
  void work() {
    for (;;) {
      std::pair<std::uint64_t, Chunk> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, [&] { return stop_ || !todo_.empty(); });
        if (stop_) return;
        job = std::move(todo_.front());
        todo_.pop_front();
      }
      Encoded e = encode_chunk(cx_, job.second);
      {
        std::lock_guard<std::mutex> lk(mu_);
        done_.emplace(job.first, std::make_pair(job.second.input, std::move(e)));
      }
      done_cv_.notify_all();
    }
  }

  const Context& cx_;
  const std::size_t max_in_flight_;
  std::uint64_t pushed_ = 0, taken_ = 0;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::pair<std::uint64_t, Chunk>> todo_;
  std::map<std::uint64_t, std::pair<std::size_t, Encoded>> done_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// An output must not be one of the inputs (NAME.json is both JSON lines and
// a manifest's name).
Status check_outputs(const TokenizeOptions& o, const std::vector<std::string>& outputs) {
  for (const auto& out : outputs)
    for (const auto& in : o.inputs) {
      std::error_code ec;
      if (fs::equivalent(out, in, ec)) return Error{ErrorKind::kUsage, fmt::format("{}: is an input and would be overwritten by the output {}", in, out)};
    }
  return {};
}

}  // namespace

Expected<BadUtf8> parse_bad_utf8(const std::string& name) {
  if (name == "replace") return BadUtf8::kReplace;
  if (name == "skip") return BadUtf8::kSkip;
  if (name == "fail") return BadUtf8::kFail;
  return Error{ErrorKind::kUsage, fmt::format("bad UTF-8 handling '{}': expected replace, skip or fail", name)};
}

const char* to_string(BadUtf8 b) {
  switch (b) {
    case BadUtf8::kReplace: return "replace";
    case BadUtf8::kSkip: return "skip";
    default: return "fail";
  }
}

Expected<std::unique_ptr<Tokenizer>> load_sentencepiece(const std::string& model_path) {
  auto bytes = read_file(model_path);
  // Named on a command line or in code: a model that cannot be read is a usage error, like one that does not parse.
  if (!bytes) return Error{ErrorKind::kUsage, bytes.error().message};
  auto t = std::make_unique<SentencePieceTokenizer>(model_path, XXH3_64bits(bytes->data(), bytes->size()));
  const auto st = t->processor().LoadFromSerializedProto(*bytes);
  if (!st.ok()) return config_error(fmt::format("{}: not a SentencePiece model that loads: {}", model_path, st.ToString()));
  if (t->vocab_size() == 0) return config_error(fmt::format("{}: a SentencePiece model without pieces", model_path));
  return std::unique_ptr<Tokenizer>(std::move(t));
}

Expected<std::unique_ptr<Tokenizer>> load_vocabulary(const std::string& path) {
  if (path.empty()) return std::unique_ptr<Tokenizer>(std::make_unique<VocabularyTokenizer>(Vocabulary::bytes_only(), "", 0));
  auto bytes = read_file(path);
  // As for a model: a vocabulary named on the command line that cannot be read is a usage error.
  if (!bytes) return Error{ErrorKind::kUsage, bytes.error().message};
  auto v = Vocabulary::load(path);
  if (!v) return v.error();
  return std::unique_ptr<Tokenizer>(std::make_unique<VocabularyTokenizer>(std::move(*v), path, XXH3_64bits(bytes->data(), bytes->size())));
}

Expected<json> external_identity(const std::string& kind, const std::string& name, const std::string& model_file) {
  json j = {{"kind", kind}, {"name", name}};
  if (model_file.empty()) return j;
  auto bytes = read_file(model_file);
  if (!bytes) return bytes.error();
  j["path"] = model_file;
  j["xxh3"] = hex64(XXH3_64bits(bytes->data(), bytes->size()));
  return j;
}

namespace {
// How much text the next chunk takes: guided self-scheduling. A chunk is
// encoded on one thread at a few MB/s, so the last chunks decide how long
// the other threads wait at the end: with 256 KiB chunks the last wave of a
// 12 MB input on 16 threads kept most of them idle for ~0.1 s, a fifth of
// the run (bench/results/tokenize_vs_spm-h200-2026-12-01.json). A chunk is
// a quarter of a thread's fair share of what is left, at most chunk_bytes
// and at least 16 KiB: large while much is left, small at the end. The
// output does not depend on where chunks are cut: documents are lines,
// written in order.
class ChunkSizer {
 public:
  ChunkSizer(const TokenizeOptions& o, const std::vector<Fd>& fds, int threads)
      : max_(o.chunk_bytes), threads_(static_cast<std::uint64_t>(std::max(1, threads))) {
    for (const auto& fd : fds) {
      struct stat st {};
      if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        known_ = false;  // a pipe: size unknown
        return;
      }
      left_ += static_cast<std::uint64_t>(st.st_size);
    }
  }
  std::size_t next() const {
    if (!known_) return max_;
    constexpr std::uint64_t kShare = 4, kMin = 16u << 10;
    return static_cast<std::size_t>(std::min<std::uint64_t>(max_, std::max(kMin, left_ / (kShare * threads_))));
  }
  void consumed(std::size_t n) { left_ -= std::min<std::uint64_t>(left_, n); }

 private:
  std::size_t max_;
  std::uint64_t threads_, left_ = 0;
  bool known_ = true;
};
}  // namespace

Expected<TokenizeReport> tokenize(const TokenizeOptions& o, const Tokenizer& tok) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.inputs.empty()) return Error{ErrorKind::kUsage, "no input files"};
  if (o.prefix.empty()) return Error{ErrorKind::kUsage, "an output prefix is needed"};
  if (o.chunk_bytes == 0) return Error{ErrorKind::kUsage, "chunk_bytes must be positive"};
  if (o.threads < 0) return Error{ErrorKind::kUsage, fmt::format("threads {}: expected 0 (every CPU) or more", o.threads)};
  TokenizeReport r;
  r.prefix = o.prefix;
  r.manifest = o.prefix + ".manifest.json";
  r.tokenizer = tok.identity();
  r.vocab_size = tok.vocab_size();
  r.field = o.field;
  r.document_per_file = o.document_per_file;
  r.bad_utf8 = o.bad_utf8;
  r.threads = o.threads > 0 ? o.threads : static_cast<int>(std::max<std::size_t>(1, hw::allowed_cpus().size()));
  if (o.append_eod) r.eod = o.eod_id ? o.eod_id : tok.eos_id();
  if (r.eod && (*r.eod < 0 || static_cast<std::uint64_t>(*r.eod) >= r.vocab_size))
    return Error{ErrorKind::kUsage, fmt::format("end-of-document id {} is outside the tokenizer's vocabulary (0..{})", *r.eod, r.vocab_size - 1)};
  if (r.vocab_size > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
    return Error{ErrorKind::kUsage, fmt::format("a vocabulary of {} ids does not fit int32 tokens", r.vocab_size)};
  r.dtype = r.vocab_size <= 65536 ? "uint16" : "int32";
  const std::string bin_path = o.prefix + ".bin", idx_path = o.prefix + ".idx";
  if (Status st = check_outputs(o, {bin_path, idx_path, r.manifest}); !st) return st.error();

  // Every input opens before anything is written.
  std::vector<Fd> fds;
  for (const auto& in : o.inputs) {
    auto fd = open_fd(in, O_RDONLY);
    if (!fd) return fd.error();
    ::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_SEQUENTIAL);
    fds.push_back(std::move(*fd));
    TokenizeInputReport ir;
    ir.path = in;
    ir.format = is_jsonl(in) ? "jsonl" : "text";
    r.inputs.push_back(ir);
  }

  const std::size_t itemsize = r.dtype == "uint16" ? 2 : 4;
  auto bin = AtomicFileWriter::create(bin_path);
  if (!bin) return bin.error();
  XxhState bin_hash = new_xxh3();
  std::vector<std::int32_t> lengths;
  std::vector<std::int64_t> pointers;
  std::uint64_t bin_bytes = 0, queued = 0;
  auto sink = [&](std::size_t input, const Encoded& e) -> Status {
    TokenizeInputReport& ir = r.inputs[input];
    for (auto n : e.lengths) {
      pointers.push_back(static_cast<std::int64_t>(bin_bytes));
      lengths.push_back(static_cast<std::int32_t>(n));
      bin_bytes += n * itemsize;
    }
    ir.documents += e.lengths.size();
    ir.tokens += e.tokens;
    ir.empty += e.empty;
    ir.bad_utf8 += e.bad_utf8;
    if (!ir.first_bad_utf8_line) ir.first_bad_utf8_line = e.first_bad_utf8_line;
    XXH3_64bits_update(bin_hash.get(), e.bytes.data(), e.bytes.size());
    if (Status st = bin->write(e.bytes.data(), e.bytes.size()); !st) return st;
    // The disk writes while the threads encode: the fsync at the end found
    // tens of MB still dirty, on one thread with every other idle.
    if (bin_bytes - queued >= (4u << 20)) {
      bin->start_writeback();
      queued = bin_bytes;
    }
    return {};
  };

  const Context cx{o, tok, r.eod, r.vocab_size, itemsize};
  {
    Pipeline pipe(cx, r.threads, 4 * static_cast<std::size_t>(r.threads) + 2);
    ChunkSizer sizer(o, fds, r.threads);
    std::string buf;
    for (std::size_t i = 0; i < o.inputs.size(); ++i) {
      const std::string& path = o.inputs[i];
      const bool whole_file = o.document_per_file && !is_jsonl(path);  // JSON lines hold a document per line regardless
      XxhState h = new_xxh3();
      std::string pending;  // a line not yet ended, or (whole_file) the file so far
      std::uint64_t line = 1;
      for (bool eof = false; !eof;) {
        buf.resize(sizer.next());
        auto n = read_full(fds[i].get(), buf.data(), buf.size(), path);
        if (!n) return n.error();
        eof = *n < buf.size();
        sizer.consumed(*n);
        XXH3_64bits_update(h.get(), buf.data(), *n);
        r.inputs[i].bytes += *n;
        const std::string_view got(buf.data(), *n);
        // A chunk ends after its last newline; the rest waits for more bytes.
        const std::size_t last = whole_file ? std::string_view::npos : got.rfind('\n');
        if (last == std::string_view::npos && !(eof && !whole_file)) {
          pending.append(got);
          continue;
        }
        const std::size_t cut = eof ? got.size() : last + 1;
        // One copy of the bytes into the chunk: the carried line, then this read's whole lines.
        Chunk c{i, line, std::move(pending), false};
        c.text.append(got.substr(0, cut));
        pending.assign(got.substr(cut));
        if (c.text.empty()) continue;
        line += static_cast<std::uint64_t>(std::count(c.text.begin(), c.text.end(), '\n'));
        if (Status st = pipe.push(std::move(c), sink); !st) return st.error();
      }
      if (whole_file)
        if (Status st = pipe.push(Chunk{i, 1, std::move(pending), true}, sink); !st) return st.error();
      r.inputs[i].xxh3 = XXH3_64bits_digest(h.get());
    }
    if (Status st = pipe.drain(sink); !st) return st.error();
  }

  for (const auto& ir : r.inputs) {
    r.documents += ir.documents;
    r.tokens += ir.tokens;
    r.bytes += ir.bytes;
    r.empty += ir.empty;
    r.bad_utf8_documents += ir.bad_utf8;
  }
  if (r.documents == 0) {
    std::string names;
    for (const auto& in : o.inputs) names += (names.empty() ? "" : ", ") + in;
    return config_error(fmt::format("{}: no documents (empty input{}); nothing written", names,
                                    r.empty ? fmt::format(", {} empty document(s)", r.empty) : std::string()));
  }

  std::string idx("MMIDIDX\0\0", 9);
  put_le<std::uint64_t>(idx, 1);
  put_le<std::uint8_t>(idx, r.dtype == "uint16" ? 8 : 4);
  put_le<std::uint64_t>(idx, lengths.size());
  put_le<std::uint64_t>(idx, lengths.size() + 1);
  idx.append(reinterpret_cast<const char*>(lengths.data()), lengths.size() * sizeof(std::int32_t));
  idx.append(reinterpret_cast<const char*>(pointers.data()), pointers.size() * sizeof(std::int64_t));
  for (std::size_t d = 0; d <= lengths.size(); ++d) put_le<std::int64_t>(idx, static_cast<std::int64_t>(d));
  r.bin_bytes = bin_bytes;
  r.bin_xxh3 = XXH3_64bits_digest(bin_hash.get());
  r.idx_bytes = idx.size();
  r.idx_xxh3 = XXH3_64bits(idx.data(), idx.size());
  auto idx_file = AtomicFileWriter::create(idx_path);
  if (!idx_file) return idx_file.error();
  if (Status st = idx_file->write(idx.data(), idx.size()); !st) return st.error();
  const std::string manifest = manifest_json(r).dump(2) + "\n";
  auto manifest_file = AtomicFileWriter::create(r.manifest);
  if (!manifest_file) return manifest_file.error();
  if (Status st = manifest_file->write(manifest.data(), manifest.size()); !st) return st.error();
  // The manifest in place last, once the files it names are durable: one
  // that names these checksums describes files that exist. Committed
  // together, the three cost two directory fsyncs rather than three, and the
  // manifest's data is synced with theirs
  // (bench/results/tokenize_fsyncs-2026-12-04.md).
  if (Status st = commit_in_order({{&*bin, &*idx_file}, {&*manifest_file}}); !st) return st.error();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

json manifest_json(const TokenizeReport& r) {
  json inputs = json::array();
  for (const auto& i : r.inputs)
    inputs.push_back({{"path", i.path}, {"format", i.format}, {"bytes", i.bytes}, {"xxh3", hex64(i.xxh3)}, {"documents", i.documents},
                      {"tokens", i.tokens}, {"empty", i.empty}, {"bad_utf8", i.bad_utf8},
                      {"first_bad_utf8_line", i.first_bad_utf8_line ? json(i.first_bad_utf8_line) : json(nullptr)}});
  return {{"schema", "pacer.tokens/1"},
          {"bin", {{"path", r.prefix + ".bin"}, {"bytes", r.bin_bytes}, {"xxh3", hex64(r.bin_xxh3)}}},
          {"idx", {{"path", r.prefix + ".idx"}, {"bytes", r.idx_bytes}, {"xxh3", hex64(r.idx_xxh3)}}},
          {"tokenizer", r.tokenizer},
          {"vocab_size", r.vocab_size},
          {"eod", r.eod ? json(*r.eod) : json(nullptr)},
          {"dtype", r.dtype},
          {"field", r.field},
          {"document", r.document_per_file ? "file" : "line"},
          {"bad_utf8", to_string(r.bad_utf8)},
          {"documents", r.documents},
          {"tokens", r.tokens},
          {"bytes", r.bytes},
          {"empty", r.empty},
          {"bad_utf8_documents", r.bad_utf8_documents},
          {"inputs", inputs}};
}

json to_json(const TokenizeReport& r) {
  json j = manifest_json(r);
  j["schema"] = "pacer.shard.tokenize/2";
  j["prefix"] = r.prefix;
  j["manifest"] = r.manifest;
  j["threads"] = r.threads;
  j["seconds"] = r.seconds;
  return j;
}

}  // namespace pacer::data
