// What an annotation session reads: the label set, the guidelines and the samples.
#include <fmt/format.h>
#include <xxhash.h>

#include <filesystem>
#include <set>
#include <toml++/toml.h>
#include <unordered_map>

#include "pacer/annotate.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/data.hpp"

namespace pacer::annotate {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::size_t kReportedMalformed = 10;

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

Error toml_at(const std::string& path, const toml::node& node, const std::string& what) {
  const auto& b = node.source().begin;
  return Error{ErrorKind::kConfig, fmt::format("{}:{}:{}: {}", path, b.line, b.column, what)};
}

// A sample's id and text from one JSON object; an error says why not.
Expected<Sample> sample_from_json(const json& j, const std::string& fallback_id) {
  if (!j.is_object()) return Error{ErrorKind::kConfig, "not a JSON object"};
  Sample s;
  s.id = fallback_id;
  if (auto it = j.find("id"); it != j.end()) {
    if (it->is_string()) s.id = it->get<std::string>();
    else if (it->is_number_integer()) s.id = it->dump();
    else return Error{ErrorKind::kConfig, "\"id\" is neither a string nor an integer"};
    if (s.id.empty()) return Error{ErrorKind::kConfig, "\"id\" is empty"};
  }
  if (auto it = j.find("text"); it != j.end()) {
    if (!it->is_string()) return Error{ErrorKind::kConfig, "\"text\" is not a string"};
    s.text = it->get<std::string>();
    return s;
  }
  auto m = j.find("messages");
  if (m == j.end()) return Error{ErrorKind::kConfig, "neither \"text\" nor \"messages\""};
  if (!m->is_array()) return Error{ErrorKind::kConfig, "\"messages\" is not an array"};
  for (const auto& msg : *m) {
    if (!msg.is_object() || !msg.contains("content") || !msg["content"].is_string())
      return Error{ErrorKind::kConfig, "a message without a string \"content\""};
    const std::string role = msg.value("role", "");
    if (!s.text.empty()) s.text += '\n';
    if (!role.empty()) s.text += role + ": ";
    s.text += msg["content"].get<std::string>();
  }
  return s;
}

struct Collector {
  SampleSet set;
  std::unordered_map<std::string, std::string> where;  // id -> place, for duplicates

  void malformed(const std::string& at, const std::string& why) {
    ++set.malformed;
    if (set.malformed_at.size() < kReportedMalformed) set.malformed_at.push_back(at + ": " + why);
  }
  Status add(Sample s, const std::string& at) {
    auto [it, fresh] = where.emplace(s.id, at);
    if (!fresh) return Error{ErrorKind::kConfig, fmt::format("{}: sample id '{}' again (first at {})", at, s.id, it->second)};
    set.samples.push_back(std::move(s));
    return {};
  }
};

Status read_json_lines(const std::string& path, Collector& c) {
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kUsage, text.error().message};
  const std::string base = fs::path(path).filename().string();
  std::size_t pos = 0;
  std::uint64_t line_no = 0;
  while (pos < text->size()) {
    ++line_no;
    std::size_t end = text->find('\n', pos);
    if (end == std::string::npos) end = text->size();
    std::string_view line(text->data() + pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string at = fmt::format("{}:{}", path, line_no);
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) {
      c.malformed(at, "not a JSON value");
      continue;
    }
    auto s = sample_from_json(j, fmt::format("{}:{}", base, line_no));
    if (!s) {
      c.malformed(at, s.error().message);
      continue;
    }
    if (Status st = c.add(std::move(*s), at); !st) return st;
  }
  return {};
}

Status read_shards(const std::string& dir, Collector& c) {
  std::string spec = (fs::path(dir) / "manifest.json").string();
  if (!fs::exists(spec)) spec = (fs::path(dir) / "*.tar").string();
  auto ds = data::Dataset::open(spec);
  if (!ds) return ds.error();
  for (std::uint64_t i = 0; i < (*ds)->size(); ++i) {
    auto r = (*ds)->read(i);
    if (!r) return r.error();
    const std::string at = fmt::format("{}: sample '{}'", dir, r->key);
    const std::string* body = nullptr;
    bool is_json = false;
    for (const auto& [ext, bytes] : r->fields) {
      if (ext == "json") {
        body = &bytes;
        is_json = true;
        break;
      }
      if (ext == "txt") body = &bytes;
    }
    if (!body) {
      c.malformed(at, "no .json or .txt field");
      continue;
    }
    if (!is_json) {
      if (Status st = c.add(Sample{r->key, *body}, at); !st) return st;
      continue;
    }
    json j = json::parse(*body, nullptr, false);
    if (j.is_discarded()) {
      c.malformed(at, "not a JSON value");
      continue;
    }
    auto s = sample_from_json(j, r->key);
    if (!s) {
      c.malformed(at, s.error().message);
      continue;
    }
    if (Status st = c.add(std::move(*s), at); !st) return st;
  }
  return {};
}

}  // namespace

std::string version_id(std::string_view canonical) { return "v" + hex64(XXH3_64bits(canonical.data(), canonical.size())); }

Expected<Guideline> read_guideline(const std::string& path) {
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kUsage, text.error().message};
  Guideline g;
  g.path = path;
  g.xxh3 = hex64(XXH3_64bits(text->data(), text->size()));
  g.version = "v" + g.xxh3;
  g.text = std::move(*text);
  return g;
}

Expected<std::vector<Label>> read_labels(const std::string& path) {
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kUsage, text.error().message};
  toml::table root;
  try {
    root = toml::parse(*text, path);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    return Error{ErrorKind::kConfig, fmt::format("{}:{}:{}: {}", path, b.line, b.column, e.description())};
  }
  for (const auto& [k, node] : root)
    if (k.str() != "label") return toml_at(path, node, fmt::format("unknown key '{}' (expected [[label]] tables)", k.str()));
  const toml::array* arr = root["label"].as_array();
  if (!arr || arr->empty()) return Error{ErrorKind::kConfig, fmt::format("{}: no [[label]] tables", path)};
  std::vector<Label> out;
  std::set<std::string> names, keys;
  for (const auto& node : *arr) {
    const toml::table* t = node.as_table();
    if (!t) return toml_at(path, node, "'label' must be an array of tables ([[label]])");
    Label l;
    for (const auto& [k, v] : *t) {
      const std::string key(k.str());
      auto s = v.value<std::string>();
      if (!s || !v.is_string()) return toml_at(path, v, fmt::format("'{}' must be a string", key));
      if (key == "name") l.name = *s;
      else if (key == "key") l.key = *s;
      else if (key == "description") l.description = *s;
      else return toml_at(path, v, fmt::format("unknown key '{}' in [[label]] (name, key, description)", key));
    }
    if (l.name.empty()) return toml_at(path, node, "[[label]] without a name");
    if (l.name.size() > 64 || l.name.find_first_of("\n\r\t") != std::string::npos)
      return toml_at(path, node, fmt::format("label name '{}': at most 64 characters, on one line", l.name));
    if (l.key.empty()) {
      if (out.size() >= 9) return toml_at(path, node, fmt::format("label '{}' needs a key (only the first nine default to 1-9)", l.name));
      l.key = std::to_string(out.size() + 1);
    }
    if (l.key.size() != 1 || l.key[0] <= ' ' || l.key[0] > '~')
      return toml_at(path, node, fmt::format("label '{}': key '{}' must be one printable ASCII character other than space", l.name, l.key));
    if (!names.insert(l.name).second) return toml_at(path, node, fmt::format("label '{}' twice", l.name));
    if (!keys.insert(l.key).second) return toml_at(path, node, fmt::format("key '{}' of label '{}' is taken by another label", l.key, l.name));
    out.push_back(std::move(l));
  }
  return out;
}

Expected<SampleSet> read_samples(const std::string& source) {
  Collector c;
  c.set.source = source;
  std::error_code ec;
  if (fs::is_directory(source, ec)) {
    if (Status st = read_shards(source, c); !st) return st.error();
  } else if (Status st = read_json_lines(source, c); !st) {
    return st.error();
  }
  if (c.set.samples.empty())
    return Error{ErrorKind::kUsage, fmt::format("{}: no samples ({} malformed)", source, c.set.malformed)};
  return std::move(c.set);
}

}  // namespace pacer::annotate
