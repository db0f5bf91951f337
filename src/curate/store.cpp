// Data-set versions: content-derived ids, manifests in a store directory,
// lineage, diffs, exports and the score columns beside the inputs.
#include <fmt/format.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <unordered_map>

#include "curate_internal.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/time.hpp"
#include "pacer/curate.hpp"
#include "pacer/data.hpp"

namespace pacer::curate {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kSchema = "pacer.dataset/1";

Error config(const std::string& source, const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {}", source, why)}; }

Status make_dirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: cannot create directory: {}", dir, ec.message())};
  return {};
}

// A per-input membership: member[i][row].
using Members = std::vector<std::vector<bool>>;

// The drop records of filter version `id`: (input, row) -> clause.
Expected<std::vector<std::tuple<std::size_t, std::uint64_t, std::string, std::string>>> read_dropped(const Store& store,
                                                                                                    const std::string& id) {
  std::vector<std::tuple<std::size_t, std::uint64_t, std::string, std::string>> out;
  const std::string path = store.version_dir(id) + "/dropped.jsonl";
  std::ifstream f(path);
  if (!f) return Error{ErrorKind::kIo, fmt::format("{}: cannot open (the samples version {} dropped)", path, id)};
  std::string line;
  std::uint64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("input") || !j["input"].is_number_unsigned() || !j.contains("row") ||
        !j["row"].is_number_unsigned())
      return config(fmt::format("{}:{}", path, n), "not a drop record {\"input\", \"row\", \"id\", \"rule\"}");
    out.emplace_back(j["input"].get<std::size_t>(), j["row"].get<std::uint64_t>(), j.value("id", ""), j.value("rule", ""));
  }
  return out;
}

}  // namespace

std::string version_id_of(std::string_view canonical) {
  return fmt::format("v{:016x}", XXH3_64bits(canonical.data(), canonical.size()));
}

std::string version_id(const json& description) { return version_id_of(description.dump()); }

bool is_version_id(const std::string& s) {
  if (s.size() != 17 || s[0] != 'v') return false;
  return std::all_of(s.begin() + 1, s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

json to_json(const Manifest& m) {
  json inputs = json::array();
  for (const auto& in : m.inputs) inputs.push_back({{"path", in.path}, {"kind", in.kind}, {"bytes", in.bytes}, {"xxh3", in.xxh3}});
  json columns = json::object();
  for (const auto& c : m.columns) columns[c.name] = {{"version", c.version}, {"files", c.files}, {"xxh3", c.xxh3}, {"source", c.source}};
  return {{"schema", kSchema},
          {"version", m.version},
          {"step", m.step},
          {"parent", m.parent.empty() ? json(nullptr) : json(m.parent)},
          {"parameters", m.parameters},
          {"inputs", inputs},
          {"columns", columns},
          {"counts", m.counts},
          {"created", m.created}};
}

Expected<Manifest> manifest_from_json(const json& j, const std::string& source) {
  if (!j.is_object() || j.value("schema", "") != kSchema) return config(source, fmt::format("not a data-set manifest (schema is not {})", kSchema));
  try {
    Manifest m;
    m.version = j.at("version").get<std::string>();
    if (!is_version_id(m.version)) return config(source, fmt::format("version '{}' is not v + 16 hex digits", m.version));
    m.step = j.at("step").get<std::string>();
    if (!j.at("parent").is_null()) m.parent = j.at("parent").get<std::string>();
    if (!m.parent.empty() && !is_version_id(m.parent)) return config(source, fmt::format("parent '{}' is not a version id", m.parent));
    m.parameters = j.at("parameters");
    for (const auto& in : j.at("inputs")) {
      Input i;
      i.path = in.at("path").get<std::string>();
      i.kind = in.at("kind").get<std::string>();
      i.bytes = in.at("bytes").get<std::uint64_t>();
      i.xxh3 = in.at("xxh3").get<std::string>();
      if (i.kind != "jsonl" && i.kind != "shards") return config(source, fmt::format("input {}: kind '{}' (jsonl or shards)", i.path, i.kind));
      m.inputs.push_back(std::move(i));
    }
    for (const auto& [name, c] : j.at("columns").items()) {
      Column col;
      col.name = name;
      col.version = c.at("version").get<std::string>();
      col.files = c.at("files").get<std::vector<std::string>>();
      col.xxh3 = c.at("xxh3").get<std::vector<std::string>>();
      col.source = c.value("source", json(nullptr));
      if (col.files.size() != m.inputs.size() || col.xxh3.size() != m.inputs.size())
        return config(source, fmt::format("column {}: {} files for {} inputs", name, col.files.size(), m.inputs.size()));
      m.columns.push_back(std::move(col));
    }
    m.counts = j.at("counts");
    m.created = j.value("created", "");
    return m;
  } catch (const json::exception& e) {
    return config(source, fmt::format("malformed manifest: {}", e.what()));
  }
}

Expected<Store> Store::open(const std::string& dir) {
  Store s;
  s.dir_ = dir;
  if (s.dir_.empty()) {
    const char* env = std::getenv("PACER_DATA_STORE");
    s.dir_ = env && *env ? env : "pacer-data";
  }
  if (Status st = make_dirs(s.dir_ + "/versions"); !st) return st.error();
  return s;
}

std::string Store::version_dir(const std::string& id) const { return dir_ + "/versions/" + id; }

bool Store::has(const std::string& id) const {
  struct stat st {};
  return is_version_id(id) && ::stat((version_dir(id) + "/manifest.json").c_str(), &st) == 0;
}

Expected<Manifest> Store::read(const std::string& id) const {
  if (!is_version_id(id)) return Error{ErrorKind::kUsage, fmt::format("'{}' is not a version id (v + 16 hex digits)", id)};
  if (!has(id)) return Error{ErrorKind::kUsage, fmt::format("version {} is not in the store {} (pacer data log lists a version's ancestors)", id, dir_)};
  const std::string path = version_dir(id) + "/manifest.json";
  auto text = read_file(path);
  if (!text) return text.error();
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded()) return config(path, "not valid JSON");
  auto m = manifest_from_json(j, path);
  if (m && m->version != id) return config(path, fmt::format("records version {}, its directory says {}", m->version, id));
  return m;
}

Status Store::write(const Manifest& m, const std::string& dropped_jsonl) const {
  const std::string dir = version_dir(m.version);
  if (Status st = make_dirs(dir); !st) return st;
  if (m.step == "filter")
    if (Status st = write_file_atomic(dir + "/dropped.jsonl", dropped_jsonl); !st) return st;
  // The manifest last: a version exists once its manifest does.
  return write_file_atomic(dir + "/manifest.json", to_json(m).dump(2) + "\n");
}

Expected<Manifest> Store::add_raw(const std::vector<std::string>& paths) const {
  if (paths.empty()) return Error{ErrorKind::kUsage, "no inputs"};
  Manifest m;
  json desc = {{"step", "raw"}, {"inputs", json::array()}};
  for (const auto& p : paths) {
    auto in = describe_input(p);
    if (!in) return in.error();
    desc["inputs"].push_back({{"name", fs::path(in->path).filename().string()}, {"kind", in->kind}, {"xxh3", in->xxh3}});
    m.inputs.push_back(std::move(*in));
  }
  m.version = version_id(desc);
  m.step = "raw";
  if (has(m.version)) {
    auto old = read(m.version);
    if (old) {
      bool same = old->inputs.size() == m.inputs.size();
      for (std::size_t i = 0; same && i < m.inputs.size(); ++i) same = old->inputs[i].path == m.inputs[i].path;
      if (same) return old;
    }
  }
  Malformed bad;
  std::uint64_t samples = 0;
  std::vector<std::uint64_t> rows;
  if (Status st = for_each_sample(m.inputs, false, bad, [&](Sample&) -> Status { ++samples; return {}; }, &rows); !st) return st.error();
  m.counts = {{"samples", samples}, {"malformed", bad.count}, {"rows", rows}};
  m.created = utc_iso_now();
  if (Status st = write(m); !st) return st.error();
  return m;
}

Expected<Manifest> Store::resolve(const std::vector<std::string>& sources) const {
  if (sources.size() == 1 && is_version_id(sources[0])) return read(sources[0]);
  for (const auto& s : sources)
    if (is_version_id(s)) return Error{ErrorKind::kUsage, fmt::format("{}: give one version, or input paths, not both", s)};
  return add_raw(sources);
}

Expected<std::vector<Manifest>> lineage(const Store& store, const std::string& id) {
  std::vector<Manifest> out;
  std::set<std::string> seen;
  std::string cur = id;
  while (!cur.empty()) {
    if (!seen.insert(cur).second) return Error{ErrorKind::kConfig, fmt::format("{}: the lineage of {} loops", store.dir(), id)};
    auto m = store.read(cur);
    if (!m) {
      if (out.empty()) return m.error();
      return Error{m.error().kind, fmt::format("{} (an ancestor of {})", m.error().message, id)};
    }
    cur = m->parent;
    out.push_back(std::move(*m));
  }
  return out;
}

Expected<std::set<std::pair<std::size_t, std::uint64_t>>> dropped_rows(const Store& store, const Manifest& m) {
  // Drops along the lineage, so a filtered version's samples are its raw
  // samples minus what each filter step removed.
  std::set<std::pair<std::size_t, std::uint64_t>> dropped;
  if (m.step == "raw") return dropped;
  auto chain = lineage(store, m.version);
  if (!chain) return chain.error();
  for (const auto& v : *chain) {
    if (v.step != "filter") continue;
    auto d = read_dropped(store, v.version);
    if (!d) return d.error();
    for (const auto& [in, row, id, rule] : *d) dropped.emplace(in, row);
  }
  return dropped;
}

Expected<VersionSamples> load_samples(const Store& store, const Manifest& m, bool with_text, bool strict) {
  VersionSamples vs;
  auto drops = dropped_rows(store, m);
  if (!drops) return drops.error();
  const auto& dropped = *drops;
  Status st = for_each_sample(m.inputs, strict, vs.malformed,
                              [&](Sample& s) -> Status {
                                if (dropped.count({s.input, s.row})) return {};
                                Sample c;
                                c.input = s.input;
                                c.row = s.row;
                                c.id = s.id;
                                if (with_text) c.text = std::move(s.text);
                                vs.samples.push_back(std::move(c));
                                return {};
                              },
                              &vs.rows);
  if (!st) return st.error();
  return vs;
}

Expected<Diff> diff(const Store& store, const std::string& a, const std::string& b) {
  auto ma = store.read(a);
  if (!ma) return ma.error();
  auto mb = store.read(b);
  if (!mb) return mb.error();
  auto sa = load_samples(store, *ma, false, false);
  if (!sa) return sa.error();
  auto sb = load_samples(store, *mb, false, false);
  if (!sb) return sb.error();
  Diff d;
  d.a = a;
  d.b = b;
  d.a_samples = sa->samples.size();
  d.b_samples = sb->samples.size();
  std::set<std::string> ia, ib;
  for (const auto& s : sa->samples) ia.insert(s.id);
  for (const auto& s : sb->samples) ib.insert(s.id);
  for (const auto& s : sb->samples)
    if (!ia.count(s.id)) d.added.push_back(s.id);
  std::unordered_map<std::string, std::string> rule_of;
  auto chain = lineage(store, b);
  if (!chain) return chain.error();
  for (const auto& v : *chain) {
    if (v.version == a) break;
    if (v.step != "filter") continue;
    auto dr = read_dropped(store, v.version);
    if (!dr) return dr.error();
    for (const auto& [in, row, id, rule] : *dr) rule_of.emplace(id, rule);
  }
  for (const auto& s : sa->samples) {
    if (ib.count(s.id)) continue;
    d.removed.push_back(s.id);
    auto r = rule_of.find(s.id);
    ++d.removed_by_rule[r == rule_of.end() ? std::string("other") : r->second];
  }
  return d;
}

json to_json(const Diff& d, std::size_t limit) {
  auto cut = [&](const std::vector<std::string>& v) {
    return std::vector<std::string>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(std::min(limit, v.size())));
  };
  return {{"schema", "pacer.data.diff/1"}, {"a", d.a}, {"b", d.b}, {"a_samples", d.a_samples}, {"b_samples", d.b_samples},
          {"added", d.added.size()},      {"removed", d.removed.size()}, {"removed_by_rule", d.removed_by_rule},
          {"added_ids", cut(d.added)},     {"removed_ids", cut(d.removed)}};
}

Expected<std::uint64_t> export_samples(const Store& store, const Manifest& m, const std::string& out) {
  auto vs = load_samples(store, m, true, false);
  if (!vs) return vs.error();
  Members member(m.inputs.size());
  for (std::size_t i = 0; i < m.inputs.size(); ++i) member[i].assign(vs->rows[i] + 2, false);
  for (const auto& s : vs->samples) member[s.input][s.row] = true;
  auto w = AtomicFileWriter::create(out);
  if (!w) return w.error();
  std::uint64_t n = 0;
  std::size_t next = 0;
  for (std::size_t i = 0; i < m.inputs.size(); ++i) {
    const Input& in = m.inputs[i];
    if (in.kind == "jsonl") {
      // The original line, so every field of the sample travels on.
      std::ifstream f(in.path, std::ios::binary);
      if (!f) return Error{ErrorKind::kIo, fmt::format("{}: cannot open", in.path)};
      std::string line;
      std::uint64_t row = 0;
      while (std::getline(f, line)) {
        ++row;
        if (row < member[i].size() && member[i][row]) {
          if (!line.empty() && line.back() == '\r') line.pop_back();
          line += '\n';
          if (Status st = w->write(line.data(), line.size()); !st) return st.error();
          ++n;
        }
      }
      while (next < vs->samples.size() && vs->samples[next].input == i) ++next;
    } else {
      for (; next < vs->samples.size() && vs->samples[next].input == i; ++next) {
        const auto& s = vs->samples[next];
        const std::string line = json{{"id", s.id}, {"text", s.text}}.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
        if (Status st = w->write(line.data(), line.size()); !st) return st.error();
        ++n;
      }
    }
  }
  if (Status st = w->commit(); !st) return st.error();
  return n;
}

std::string column_path(const Input& in, const std::string& name, const std::string& version) {
  if (in.kind == "jsonl") return in.path + ".scores/" + name + "-" + version + ".jsonl";
  return (fs::path(in.path).parent_path() / "scores" / (name + "-" + version + "-" + in.xxh3 + ".jsonl")).string();
}

Expected<Column> write_column_text(const std::vector<Input>& inputs, const std::string& name, const std::string& version,
                                   const std::vector<std::string>& texts, json source) {
  Column c;
  c.name = name;
  c.version = version;
  c.source = std::move(source);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::string path = column_path(inputs[i], name, version);
    if (Status st = make_dirs(fs::path(path).parent_path().string()); !st) return st.error();
    if (Status st = write_file_atomic(path, texts[i]); !st) return st.error();
    c.files.push_back(path);
    c.xxh3.push_back(fmt::format("{:016x}", XXH3_64bits(texts[i].data(), texts[i].size())));
  }
  return c;
}

Expected<Column> write_column(const std::vector<Input>& inputs, const std::string& name, const std::string& version,
                              const std::vector<std::vector<json>>& values, json source) {
  std::vector<std::string> texts(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i)
    for (const auto& v : values[i]) {
      texts[i] += v.dump(-1, ' ', false, json::error_handler_t::replace);
      texts[i] += '\n';
    }
  return write_column_text(inputs, name, version, texts, std::move(source));
}

Expected<std::vector<std::vector<json>>> read_column(const Column& c) {
  std::vector<std::vector<json>> out;
  for (std::size_t i = 0; i < c.files.size(); ++i) {
    auto text = read_file(c.files[i]);
    if (!text) return Error{text.error().kind, fmt::format("column {}: {}", c.name, text.error().message)};
    if (fmt::format("{:016x}", XXH3_64bits(text->data(), text->size())) != c.xxh3[i])
      return Error{ErrorKind::kConfig, fmt::format("{}: column {} changed since version {} wrote it (checksum differs; rerun that step)", c.files[i],
                                                   c.name, c.version)};
    std::vector<json> col;
    std::size_t pos = 0, line = 0;
    while (pos < text->size()) {
      std::size_t end = text->find('\n', pos);
      if (end == std::string::npos) end = text->size();
      ++line;
      json v = json::parse(text->begin() + static_cast<std::ptrdiff_t>(pos), text->begin() + static_cast<std::ptrdiff_t>(end), nullptr, false);
      if (v.is_discarded()) return config(fmt::format("{}:{}", c.files[i], line), "not a JSON value");
      col.push_back(std::move(v));
      pos = end + 1;
    }
    out.push_back(std::move(col));
  }
  return out;
}

Status check_column_name(const std::string& name) {
  static const std::set<std::string> kKeywords = {"and", "or", "not", "true", "false", "null"};
  bool ok = !name.empty() && name.size() <= 64 && (std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_');
  for (char c : name) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
  if (!ok || kKeywords.count(name))
    return Error{ErrorKind::kUsage, fmt::format("'{}' is not a column name (letters, digits and _, not starting with a digit, not a keyword)", name)};
  return {};
}

}  // namespace pacer::curate
