// Inputs of a data set and their samples: JSON lines and pacer shard sets.
#include <fmt/format.h>
#include <xxhash.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "curate_internal.hpp"
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

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

// One JSON line into s.row, s.id and s.text; the reason it is malformed, or empty.
std::string parse_line(std::string_view v, const std::string& base, std::uint64_t lineno, Sample& s) {
  json j = json::parse(v.begin(), v.end(), nullptr, false);
  if (j.is_discarded()) return "not valid JSON";
  if (!j.is_object()) return "not a JSON object";
  auto text = sample_text(j);
  if (!text) return text.error().message;
  s.row = lineno;
  s.id = sample_id(j, fmt::format("{}:{}", base, lineno));
  s.text = std::move(*text);
  return {};
}

bool is_blank(std::string_view v) {
  for (char c : v)
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  return true;
}

Status jsonl_samples(const Input& in, std::size_t index, bool strict, Malformed& bad, const std::function<Status(Sample&)>& fn,
                     std::uint64_t& rows) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(in.path.c_str(), "rb"));
  if (!f) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", in.path, std::strerror(errno))};
  const std::string base = fs::path(in.path).filename().string();
  char* line = nullptr;
  std::size_t cap = 0;
  std::unique_ptr<char, decltype(&std::free)> hold(nullptr, &std::free);
  std::uint64_t lineno = 0;
  Sample s;
  s.input = index;
  for (;;) {
    errno = 0;
    const ssize_t n = ::getline(&line, &cap, f.get());
    hold.release();
    hold.reset(line);
    if (n < 0) {
      if (std::ferror(f.get())) return Error{ErrorKind::kIo, fmt::format("{}:{}: read failed: {}", in.path, lineno + 1, std::strerror(errno))};
      break;
    }
    ++lineno;
    std::string_view v(line, static_cast<std::size_t>(n));
    while (!v.empty() && (v.back() == '\n' || v.back() == '\r')) v.remove_suffix(1);
    if (is_blank(v)) continue;
    if (const std::string why = parse_line(v, base, lineno, s); !why.empty()) {
      const std::string where = fmt::format("{}:{}: {}", in.path, lineno, why);
      if (strict) return Error{ErrorKind::kConfig, where + " (--strict)"};
      note(bad, where);
      continue;
    }
    if (Status st = fn(s); !st) return st;
  }
  rows = lineno;
  return {};
}

Status shard_samples(const Input& in, std::size_t index, bool strict, Malformed& bad, const std::function<Status(Sample&)>& fn,
                     std::uint64_t& rows) {
  auto ds = data::Dataset::open(in.path);
  if (!ds) return ds.error();
  rows = (*ds)->size();
  Sample s;
  s.input = index;
  for (std::uint64_t i = 0; i < (*ds)->size(); ++i) {
    auto smp = (*ds)->read(i);
    if (!smp) return smp.error();
    auto fail = [&](const std::string& why) -> Status {
      const std::string where = fmt::format("{}: sample {} ({}): {}", in.path, i, smp->key, why);
      if (strict) return Error{ErrorKind::kConfig, where + " (--strict)"};
      note(bad, where);
      return {};
    };
    const std::string* js = nullptr;
    const std::string* txt = nullptr;
    for (const auto& [ext, bytes] : smp->fields) {
      if (ext == "json") js = &bytes;
      if (ext == "txt" || ext == "text") txt = &bytes;
    }
    s.row = i;
    if (js) {
      json j = json::parse(*js, nullptr, false);
      if (j.is_discarded() || !j.is_object()) {
        if (Status st = fail("its json field is not a JSON object"); !st) return st;
        continue;
      }
      auto text = sample_text(j);
      if (!text) {
        if (Status st = fail(text.error().message); !st) return st;
        continue;
      }
      s.id = sample_id(j, smp->key);
      s.text = std::move(*text);
    } else if (txt) {
      s.id = smp->key;
      s.text = *txt;
    } else {
      if (Status st = fail("no json or txt field"); !st) return st;
      continue;
    }
    if (Status st = fn(s); !st) return st;
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

Status for_each_sample(const std::vector<Input>& inputs, bool strict, Malformed& bad, const std::function<Status(Sample&)>& fn,
                       std::vector<std::uint64_t>* rows) {
  if (rows) rows->assign(inputs.size(), 0);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::uint64_t n = 0;
    Status st = inputs[i].kind == "shards" ? shard_samples(inputs[i], i, strict, bad, fn, n) : jsonl_samples(inputs[i], i, strict, bad, fn, n);
    if (!st) return st;
    if (rows) (*rows)[i] = n;
  }
  return {};
}

Status for_each_chunk(const std::vector<Input>& inputs, bool strict, int threads, Malformed& bad,
                      const std::function<Status(std::vector<Sample>&)>& fn, std::vector<std::uint64_t>* rows) {
  constexpr std::size_t kChunk = 1 << 14;
  if (rows) rows->assign(inputs.size(), 0);
  std::vector<Sample> out;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    if (in.kind == "shards") {
      // Shard samples are read (and their JSON parsed) one by one.
      std::uint64_t n = 0;
      Status st = shard_samples(in, i, strict, bad,
                                [&](Sample& s) -> Status {
                                  out.push_back(std::move(s));
                                  if (out.size() < kChunk) return {};
                                  Status r = fn(out);
                                  out.clear();
                                  return r;
                                },
                                n);
      if (!st) return st;
      if (!out.empty())
        if (Status r = fn(out); !r) return r;
      out.clear();
      if (rows) (*rows)[i] = n;
      continue;
    }
    std::ifstream f(in.path, std::ios::binary);
    if (!f) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", in.path, std::strerror(errno))};
    const std::string base = fs::path(in.path).filename().string();
    std::vector<std::string> lines;
    std::vector<std::string> why;
    std::uint64_t lineno = 0, first = 1;
    auto flush = [&]() -> Status {
      out.assign(lines.size(), Sample{});
      why.assign(lines.size(), std::string());
      parallel_blocks(lines.size(), threads, 256, [&](std::size_t b, std::size_t e) {
        for (std::size_t k = b; k < e; ++k) {
          std::string_view v = lines[k];
          while (!v.empty() && (v.back() == '\r' || v.back() == '\n')) v.remove_suffix(1);
          if (is_blank(v)) {
            why[k] = "\n";  // blank: no sample, no complaint
            continue;
          }
          out[k].input = i;
          why[k] = parse_line(v, base, first + k, out[k]);
        }
      });
      std::vector<Sample> kept;
      kept.reserve(out.size());
      for (std::size_t k = 0; k < out.size(); ++k) {
        if (why[k].empty()) {
          kept.push_back(std::move(out[k]));
        } else if (why[k] != "\n") {
          const std::string where = fmt::format("{}:{}: {}", in.path, first + k, why[k]);
          if (strict) return Error{ErrorKind::kConfig, where + " (--strict)"};
          note(bad, where);
        }
      }
      first += lines.size();
      lines.clear();
      return kept.empty() ? Status{} : fn(kept);
    };
    std::string line;
    while (std::getline(f, line)) {
      ++lineno;
      lines.push_back(std::move(line));
      if (lines.size() >= kChunk)
        if (Status st = flush(); !st) return st;
    }
    if (f.bad()) return Error{ErrorKind::kIo, fmt::format("{}:{}: read failed", in.path, lineno + 1)};
    if (Status st = flush(); !st) return st;
    if (rows) (*rows)[i] = lineno;
  }
  return {};
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
