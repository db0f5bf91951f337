// What an annotation session reads: the label set, the guidelines and the samples.
#include <fmt/format.h>
#include <xxhash.h>

#include <filesystem>
#include <set>
#include <toml++/toml.h>
#include <unordered_map>

#include "pacer/annotate.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/curate.hpp"

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

struct Collector {
  SampleSet set;
  std::unordered_map<std::string, std::string> where;  // id -> place, for duplicates

  Status add(Sample s, const std::string& at) {
    auto [it, fresh] = where.emplace(s.id, at);
    if (!fresh) return Error{ErrorKind::kConfig, fmt::format("{}: sample id '{}' again (first at {})", at, s.id, it->second)};
    set.samples.push_back(std::move(s));
    return {};
  }
};

}  // namespace

std::string version_id(std::string_view canonical) { return curate::version_id_of(canonical); }

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
  // pacer curate's reader, so that a sample has the same id and text in both tools.
  auto in = curate::describe_input(source);
  if (!in) return in.error();
  Collector c;
  c.set.source = source;
  curate::Malformed bad;
  const bool shards = in->kind == "shards";
  Status st = curate::for_each_sample({*in}, false, bad, [&](curate::Sample& s) {
    const std::string at = shards ? fmt::format("{}: sample {}", source, s.row) : fmt::format("{}:{}", source, s.row);
    return c.add(Sample{std::move(s.id), std::move(s.text)}, at);
  });
  if (!st) return st.error();
  c.set.malformed = bad.count;
  for (auto& m : bad.first)
    if (c.set.malformed_at.size() < kReportedMalformed) c.set.malformed_at.push_back(std::move(m));
  if (c.set.samples.empty())
    return Error{ErrorKind::kUsage, fmt::format("{}: no samples ({} malformed)", source, c.set.malformed)};
  return std::move(c.set);
}

}  // namespace pacer::annotate
