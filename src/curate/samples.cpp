// Inputs of a data set and their samples: JSON lines and pacer shard sets.
#include <fmt/format.h>
#include <xxhash.h>

#include <fcntl.h>
#include <simdjson.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>

#include "curate_internal.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/curate.hpp"
#include "pacer/data.hpp"

namespace pacer::curate {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::size_t kMaxReported = 20;

bool is_jsonl(const std::string& path) {
  return path.ends_with(".jsonl") || path.ends_with(".ndjson") || path.ends_with(".json.txt") || path.ends_with(".jsonl.txt");
}

void note(Malformed& bad, const std::string& where) {
  ++bad.count;
  if (bad.first.size() < kMaxReported) bad.first.push_back(where);
}

bool is_blank(std::string_view v) {
  for (char c : v)
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  return true;
}

// simdjson reads up to this many bytes past a document's end.
constexpr std::size_t kPadding = simdjson::SIMDJSON_PADDING;
// Lines longer than this go to the reference parser: simdjson's tape takes
// several times a document's size, and a parser keeps its largest allocation.
constexpr std::size_t kFastMaxBytes = 1 << 20;
// Shard samples per chunk (JSON lines come a block at a time).
constexpr std::size_t kShardChunk = 1 << 14;

// A JSON-lines file read a large block at a time: its lines are views into
// the block, with simdjson's padding readable after the data; the partial
// line a block ends with begins the next. A block grows only for a line
// longer than half of one: it never exceeds twice the longest line or the
// block size, whichever is larger.
class LineBlocks {
 public:
  struct Block {
    std::unique_ptr<char[]> buf;
    std::size_t cap = 0, end = 0;
    std::size_t tail = 0;  // where the partial line it ends with begins
  };

  LineBlocks(const Input& in, Fd fd, std::size_t block) : in_(in), fd_(std::move(fd)), block_(block) {}

  // Reads the next block into `dst`: `prev`'s partial line (prev may be dst),
  // then the file's next bytes. Its complete lines go to c.samples (blank ones
  // are counted, not handed out). False once the file is read.
  Expected<bool> next(Block& dst, const Block* prev, RawChunk& c) {
    c.samples.clear();
    const std::size_t carried = prev ? prev->end - prev->tail : 0;
    if (eof_ && carried == 0) return false;
    if (dst.cap < carried + block_ / 2) {
      const std::size_t cap = std::max(block_, 2 * carried);
      std::unique_ptr<char[]> b(new char[cap + kPadding]);
      if (prev == &dst && carried) std::memcpy(b.get(), dst.buf.get() + dst.tail, carried);
      dst.buf = std::move(b);
      dst.cap = cap;
      if (prev == &dst) dst.tail = 0;
    }
    if (prev == &dst) std::memmove(dst.buf.get(), dst.buf.get() + dst.tail, carried);
    else if (carried) std::memcpy(dst.buf.get(), prev->buf.get() + prev->tail, carried);
    dst.end = carried;
    if (!eof_) {
      auto n = read_full(fd_.get(), dst.buf.get() + carried, dst.cap - carried, in_.path);
      if (!n) return Error{ErrorKind::kIo, fmt::format("{}:{}: read failed: {}", in_.path, lineno_ + 1, n.error().message)};
      dst.end += *n;
      eof_ = dst.end < dst.cap;
    }
    std::memset(dst.buf.get() + dst.end, 0, kPadding);
    const char* p = dst.buf.get();
    std::size_t at = 0;
    while (at < dst.end) {
      const void* nl = std::memchr(p + at, '\n', dst.end - at);
      if (!nl && !eof_) break;  // a partial line: the next block completes it
      const std::size_t stop = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - p) : dst.end;
      ++lineno_;
      std::string_view v(p + at, stop - at);
      while (!v.empty() && v.back() == '\r') v.remove_suffix(1);
      if (!is_blank(v)) c.samples.push_back({RawSample::Kind::kJsonLine, lineno_, v, {}});
      at = nl ? stop + 1 : dst.end;
    }
    dst.tail = at;
    return true;
  }

  std::uint64_t lines() const { return lineno_; }

 private:
  const Input& in_;
  Fd fd_;
  std::size_t block_;
  bool eof_ = false;
  std::uint64_t lineno_ = 0;
};

Status jsonl_chunks(const Input& in, std::size_t index, const std::function<Status(RawChunk&)>& fn, int workers, std::uint64_t& rows) {
  auto fd = open_fd(in.path, O_RDONLY);
  if (!fd) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", in.path, fd.error().message)};
  ::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  // 1 MiB of lines (some 4,000 samples) per worker and block, 4 to 32 MiB: each worker's share of a
  // chunk stays long next to starting the threads and waiting for the last of them.
  const std::size_t block = std::clamp<std::size_t>(static_cast<std::size_t>(workers) << 20, 4 << 20, 32 << 20);
  LineBlocks lines(in, std::move(*fd), block);
  LineBlocks::Block blocks[2];
  RawChunk chunks[2];
  for (RawChunk& c : chunks) {
    c.input = index;
    c.in = &in;
    c.base = fs::path(in.path).filename().string();
  }
  if (workers <= 1) {
    for (;;) {
      auto more = lines.next(blocks[0], &blocks[0], chunks[0]);
      if (!more) return more.error();
      if (!*more) break;
      if (!chunks[0].samples.empty())
        if (Status st = fn(chunks[0]); !st) return st;
    }
  } else {
    // The next block is read while the workers score this one: a serial read
    // between chunks would idle every worker for its duration.
    int cur = 0;
    auto more = lines.next(blocks[0], nullptr, chunks[0]);
    for (;;) {
      if (!more) return more.error();
      if (!*more) break;
      auto ahead = std::async(std::launch::async, [&, cur] { return lines.next(blocks[1 - cur], &blocks[cur], chunks[1 - cur]); });
      Status st = chunks[cur].samples.empty() ? Status{} : fn(chunks[cur]);
      more = ahead.get();
      if (!st) return st;
      cur = 1 - cur;
    }
  }
  rows = lines.lines();
  return {};
}

Status shard_chunks(const Input& in, std::size_t index, const std::function<Status(RawChunk&)>& fn, std::uint64_t& rows) {
  auto ds = data::Dataset::open(in.path);
  if (!ds) return ds.error();
  rows = (*ds)->size();
  RawChunk c;
  c.input = index;
  c.in = &in;
  std::vector<data::Dataset::Sample> held;
  for (std::uint64_t first = 0; first < rows; first += kShardChunk) {
    const std::uint64_t last = std::min<std::uint64_t>(rows, first + kShardChunk);
    held.clear();
    for (std::uint64_t i = first; i < last; ++i) {
      auto smp = (*ds)->read(i);
      if (!smp) return smp.error();
      held.push_back(std::move(*smp));
    }
    c.samples.clear();
    for (std::uint64_t i = first; i < last; ++i) {
      const auto& smp = held[i - first];
      RawSample r{RawSample::Kind::kShardNoText, i, {}, smp.key};
      // The last json field, else the last txt or text field, as the sample's.
      const std::string* js = nullptr;
      const std::string* txt = nullptr;
      for (const auto& [ext, bytes] : smp.fields) {
        if (ext == "json") js = &bytes;
        if (ext == "txt" || ext == "text") txt = &bytes;
      }
      if (js) r = {RawSample::Kind::kShardJson, i, *js, smp.key};
      else if (txt) r = {RawSample::Kind::kShardText, i, *txt, smp.key};
      c.samples.push_back(r);
    }
    if (Status st = fn(c); !st) return st;
  }
  return {};
}

}  // namespace

json to_json(const Malformed& m) { return {{"count", m.count}, {"first", m.first}}; }

Expected<std::string> sample_text(const json& j) {
  if (auto t = j.find("text"); t != j.end()) {
    if (!t->is_string()) return Error{ErrorKind::kConfig, "\"text\" is not a string"};
    return t->get<std::string>();
  }
  auto m = j.find("messages");
  if (m == j.end()) return Error{ErrorKind::kConfig, "no \"text\" or \"messages\""};
  if (!m->is_array()) return Error{ErrorKind::kConfig, "\"messages\" is not an array"};
  std::string out;
  std::size_t k = 0;
  for (const auto& msg : *m) {
    if (!msg.is_object()) return Error{ErrorKind::kConfig, fmt::format("message {} is not an object", k)};
    auto role = msg.find("role");
    auto content = msg.find("content");
    if (role == msg.end() || !role->is_string() || content == msg.end() || !content->is_string())
      return Error{ErrorKind::kConfig, fmt::format("message {} has no string \"role\" and \"content\"", k)};
    if (k++) out += '\n';
    out += role->get_ref<const std::string&>();
    out += ": ";
    out += content->get_ref<const std::string&>();
  }
  return out;
}

std::string sample_id(const json& j, const std::string& fallback) {
  auto id = j.find("id");
  if (id == j.end()) return fallback;
  if (id->is_string()) return id->get<std::string>();
  if (id->is_number_integer()) return id->dump();
  return fallback;
}

Expected<Input> describe_input(const std::string& path) {
  Input in;
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  if (is_jsonl(path) || (exists && fs::is_regular_file(path, ec) && !path.ends_with(".tar") && !path.ends_with(".tar.gz") &&
                         !path.ends_with(".json"))) {
    if (!exists) return Error{ErrorKind::kUsage, fmt::format("{}: no such file", path)};
    in.path = fs::absolute(path, ec).lexically_normal().string();
    in.kind = "jsonl";
    in.bytes = fs::file_size(path, ec);
    auto h = data::file_xxh3(path);
    if (!h) return h.error();
    in.xxh3 = fmt::format("{:016x}", *h);
    return in;
  }
  std::string spec = path;
  if (exists && fs::is_directory(path, ec)) {
    if (fs::exists(fs::path(path) / "manifest.json", ec)) spec = (fs::path(path) / "manifest.json").string();
    else return Error{ErrorKind::kUsage, fmt::format("{}: a directory without manifest.json (not a pacer shard set)", path)};
  }
  auto shards = data::expand_shard_spec(spec);
  if (!shards) return shards.error();
  if (shards->empty()) return Error{ErrorKind::kUsage, fmt::format("{}: names no shards", path)};
  in.path = fs::absolute(spec, ec).lexically_normal().string();
  in.kind = "shards";
  std::string sums;
  for (const auto& s : *shards) {
    in.bytes += fs::file_size(s, ec);
    if (ec) return Error{ErrorKind::kUsage, fmt::format("{}: no such shard", s)};
    auto h = data::file_xxh3(s);
    if (!h) return h.error();
    sums += fmt::format("{:016x}", *h);
  }
  in.xxh3 = fmt::format("{:016x}", XXH3_64bits(sums.data(), sums.size()));
  return in;
}

Status note_malformed(const RawChunk& c, const RawSample& s, const std::string& why, bool strict, Malformed& bad) {
  const std::string where = s.kind == RawSample::Kind::kJsonLine ? fmt::format("{}:{}: {}", c.in->path, s.row, why)
                                                                 : fmt::format("{}: sample {} ({}): {}", c.in->path, s.row, s.key, why);
  if (strict) return Error{ErrorKind::kConfig, where + " (--strict)"};
  note(bad, where);
  return {};
}

Status for_each_raw_chunk(const std::vector<Input>& inputs, const std::function<Status(RawChunk&)>& fn, std::vector<std::uint64_t>* rows,
                          int workers) {
  if (rows) rows->assign(inputs.size(), 0);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::uint64_t n = 0;
    Status st = inputs[i].kind == "shards" ? shard_chunks(inputs[i], i, fn, n) : jsonl_chunks(inputs[i], i, fn, workers, n);
    if (!st) return st;
    if (rows) (*rows)[i] = n;
  }
  return {};
}

struct SampleParser::Impl {
  simdjson::dom::parser parser;
  std::string padded;  // a shard's json field with simdjson's padding
  std::string text;    // a chat sample's joined messages, or the reference's text
};

SampleParser::SampleParser() : impl_(std::make_unique<Impl>()) {}
SampleParser::~SampleParser() = default;

bool SampleParser::parse_reference(const RawChunk& c, const RawSample& s, std::string_view& text, std::string* id, std::string& why) {
  if (s.kind == RawSample::Kind::kShardNoText) {
    why = "no json or txt field";
    return false;
  }
  if (s.kind == RawSample::Kind::kShardText) {
    text = s.bytes;
    if (id) id->assign(s.key);
    return true;
  }
  const bool line = s.kind == RawSample::Kind::kJsonLine;
  json j = json::parse(s.bytes.begin(), s.bytes.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    why = !line ? "its json field is not a JSON object" : j.is_discarded() ? "not valid JSON" : "not a JSON object";
    return false;
  }
  auto t = sample_text(j);
  if (!t) {
    why = t.error().message;
    return false;
  }
  impl_->text = std::move(*t);
  text = impl_->text;
  if (id) *id = sample_id(j, line ? fmt::format("{}:{}", c.base, s.row) : std::string(s.key));
  return true;
}

namespace {

// The plain cases through simdjson: an object whose last "text" is a string,
// or without "text", whose last "messages" is an array of objects each with
// string "role" and "content" (the last of each). Anything else, and any
// document simdjson refuses (it accepts a subset of what nlohmann does:
// tests/curate compares them), returns false for the reference to decide.
// nlohmann keeps the last of duplicate keys, hence the scans to the end.
bool fast_sample(simdjson::dom::element doc, std::string& joined, std::string_view& text, std::string* id, bool& id_fallback) {
  simdjson::dom::object obj;
  if (doc.get(obj)) return false;
  simdjson::dom::element t, m, i;
  bool has_t = false, has_m = false, has_i = false;
  for (auto field : obj) {
    if (field.key == "text") t = field.value, has_t = true;
    else if (field.key == "messages") m = field.value, has_m = true;
    else if (field.key == "id") i = field.value, has_i = true;
  }
  if (has_t) {
    if (t.get(text)) return false;
  } else {
    simdjson::dom::array msgs;
    if (!has_m || m.get(msgs)) return false;
    joined.clear();
    std::size_t k = 0;
    for (auto msg : msgs) {
      simdjson::dom::object o;
      if (msg.get(o)) return false;
      std::string_view role, content;
      bool has_role = false, has_content = false;
      for (auto field : o) {
        if (field.key == "role") has_role = !field.value.get(role);
        else if (field.key == "content") has_content = !field.value.get(content);
      }
      if (!has_role || !has_content) return false;
      if (k++) joined += '\n';
      joined += role;
      joined += ": ";
      joined += content;
    }
    text = joined;
  }
  id_fallback = true;
  if (id && has_i) {
    std::string_view sv;
    std::int64_t si = 0;
    std::uint64_t ui = 0;
    if (!i.get(sv)) id->assign(sv), id_fallback = false;
    else if (!i.get(si)) id->assign(fmt::format_int(si).str()), id_fallback = false;
    else if (!i.get(ui)) id->assign(fmt::format_int(ui).str()), id_fallback = false;
  }
  return true;
}

}  // namespace

bool SampleParser::parse(const RawChunk& c, const RawSample& s, std::string_view& text, std::string* id, std::string& why) {
  if (s.kind == RawSample::Kind::kShardText || s.kind == RawSample::Kind::kShardNoText || s.bytes.size() > kFastMaxBytes)
    return parse_reference(c, s, text, id, why);
  const char* p = s.bytes.data();
  if (s.kind == RawSample::Kind::kShardJson) {
    // JSON lines come with padding from their block; a shard field does not.
    impl_->padded.assign(s.bytes);
    impl_->padded.append(kPadding, '\0');
    p = impl_->padded.data();
  }
  simdjson::dom::element doc;
  bool fallback = false;
  if (impl_->parser.parse(p, s.bytes.size(), false).get(doc) || !fast_sample(doc, impl_->text, text, id, fallback))
    return parse_reference(c, s, text, id, why);
  if (id && fallback) *id = s.kind == RawSample::Kind::kJsonLine ? fmt::format("{}:{}", c.base, s.row) : std::string(s.key);
  return true;
}

Status for_each_sample(const std::vector<Input>& inputs, bool strict, Malformed& bad, const std::function<Status(Sample&)>& fn,
                       std::vector<std::uint64_t>* rows) {
  SampleParser parser;
  Sample smp;
  std::string why;
  return for_each_raw_chunk(
      inputs,
      [&](RawChunk& c) -> Status {
        smp.input = c.input;
        for (const RawSample& s : c.samples) {
          std::string_view text;
          if (!parser.parse(c, s, text, &smp.id, why)) {
            if (Status st = note_malformed(c, s, why, strict, bad); !st) return st;
            continue;
          }
          smp.row = s.row;
          smp.text.assign(text);
          if (Status st = fn(smp); !st) return st;
        }
        return {};
      },
      rows);
}

std::string normalise(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool space = false;
  for (unsigned char c : text) {
    if (std::isspace(c)) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += static_cast<char>(c < 0x80 ? std::tolower(c) : c);
  }
  return out;
}

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  for (unsigned char c : text) {
    if (c >= 0x80 || std::isalnum(c)) {
      cur += static_cast<char>(c < 0x80 ? std::tolower(c) : c);
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

}  // namespace pacer::curate
