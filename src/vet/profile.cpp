#include "pacer/vet/profile.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include <filesystem>
#include <toml++/toml.h>

#include "builtin_profiles.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/units.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

using nlohmann::json;

// Every error points at file:line:column, like a compiler.
Error at(const std::string& source, const toml::node& node, const std::string& message) {
  const auto& b = node.source().begin;
  return Error{ErrorKind::kConfig, fmt::format("{}:{}:{}: {}", source, b.line, b.column, message)};
}

const ParamSpec* find_param(const std::vector<ParamSpec>& params, const std::string& key) {
  for (const auto& p : params)
    if (p.key == key) return &p;
  return nullptr;
}

// Parameters that may be set in a section: a probe's section, or the table of
// the first check of a probe without one.
std::vector<ParamSpec> params_for_section(const std::string& section) {
  std::vector<ParamSpec> out;
  for (const auto& p : all_probes()) {
    const std::string s = p.section.empty() ? p.checks.front().name : p.section;
    if (s == section) out.insert(out.end(), p.params.begin(), p.params.end());
  }
  return out;
}

Expected<json> convert_param(const std::string& source, const std::string& table, const ParamSpec& spec,
                             const toml::node& node) {
  const std::string where = fmt::format("'{}' in [{}]", spec.key, table);
  switch (spec.type) {
    case ParamType::kDuration: {
      if (auto v = node.value<double>(); v && node.is_number()) {
        if (!std::isfinite(*v)) return at(source, node, where + " must be a finite duration, not " + fmt::format("{}", *v));
        if (*v < 0) return at(source, node, where + " must not be negative");
        return json(*v);
      }
      if (auto s = node.value<std::string>()) {
        auto d = parse_duration(*s);
        if (!d) return at(source, node, fmt::format("{}: {}", where, d.error().message));
        return json(*d);
      }
      return at(source, node, where + " must be a duration such as \"2s\" or \"500ms\"");
    }
    case ParamType::kSize: {
      if (auto v = node.value<int64_t>(); v && node.is_integer()) {
        if (*v < 0) return at(source, node, where + " must not be negative");
        return json(static_cast<std::uint64_t>(*v));
      }
      if (auto s = node.value<std::string>()) {
        auto b = parse_size(*s);
        if (!b) return at(source, node, fmt::format("{}: {}", where, b.error().message));
        return json(*b);
      }
      return at(source, node, where + " must be a size such as \"256MiB\" or a byte count");
    }
    case ParamType::kInteger:
      if (auto v = node.value<int64_t>(); v && node.is_integer() && *v >= 0) return json(*v);
      return at(source, node, where + " must be a non-negative integer");
    case ParamType::kNumber:
      if (node.is_number() && std::isfinite(*node.value<double>())) return json(*node.value<double>());
      return at(source, node, where + " must be a finite number");
    case ParamType::kString:
      if (auto s = node.value<std::string>()) return json(*s);
      return at(source, node, where + " must be a string");
  }
  return at(source, node, where + ": unsupported type");
}

Expected<std::optional<double>> convert_timeout(const std::string& source, const std::string& table, const toml::node& node) {
  ParamSpec spec{"timeout", ParamType::kDuration, {}, {}, ""};
  auto v = convert_param(source, table, spec, node);
  if (!v) return v.error();
  if (v->get<double>() <= 0) return at(source, node, fmt::format("'timeout' in [{}] must be positive", table));
  return std::optional<double>(v->get<double>());
}

Expected<std::vector<std::string>> string_list(const std::string& source, const std::string& what, const toml::node& node) {
  const toml::array* arr = node.as_array();
  if (!arr) return at(source, node, what + " must be an array of strings");
  std::vector<std::string> out;
  for (const auto& el : *arr) {
    auto s = el.value<std::string>();
    if (!s) return at(source, el, what + " must contain only strings");
    out.push_back(*s);
  }
  return out;
}

// Parameters (and `timeout`) of one [section] or [section.quick] table.
Status parse_params(const std::string& source, const std::string& table, const toml::table& t,
                    const std::vector<ParamSpec>& specs, json& out, std::optional<double>* timeout,
                    const std::function<bool(const std::string&, const toml::node&, Status&)>& other) {
  for (const auto& [k, node] : t) {
    const std::string key(k.str());
    if (key == "timeout" && timeout) {
      auto v = convert_timeout(source, table, node);
      if (!v) return v.error();
      *timeout = *v;
      continue;
    }
    if (const ParamSpec* spec = find_param(specs, key)) {
      auto v = convert_param(source, table, *spec, node);
      if (!v) return v.error();
      out[key] = *v;
      continue;
    }
    Status st;
    if (other && other(key, node, st)) {
      if (!st) return st;
      continue;
    }
    std::string known;
    for (const auto& s : specs) known += (known.empty() ? "" : ", ") + s.key;
    return at(source, node, fmt::format("unknown key '{}' in [{}]{}", key, table,
                                        known.empty() ? "" : fmt::format(" (parameters here: {})", known)));
  }
  return {};
}

Status parse_check(const std::string& source, const std::string& name, const toml::table& t, json& layer) {
  const CheckSpec* spec = find_check(name);
  const ProbeSpec* probe = probe_of_check(name);
  if (!spec || !probe) return at(source, t, fmt::format("unknown check '{}' (pacer vet --list shows the names)", name));
  const std::string table = fmt::format("checks.\"{}\"", name);
  const bool owns_params = probe->section.empty() && probe->checks.front().name == name;
  const std::vector<ParamSpec> specs = owns_params ? probe->params : std::vector<ParamSpec>{};
  json cfg = json::object();
  json normal = json::object();
  json quick = json::object();
  std::optional<double> timeout, quick_timeout;

  auto other = [&](const std::string& key, const toml::node& node, Status& st) -> bool {
    if (key == "enabled") {
      if (!node.is_boolean()) st = at(source, node, fmt::format("'enabled' in [{}] must be true or false", table));
      else cfg["enabled"] = *node.value<bool>();
      return true;
    }
    if (key == "fail_below" || key == "warn_below" || key == "fail_above" || key == "warn_above") {
      if (spec->kind != ValueKind::kNumber)
        st = at(source, node, fmt::format("'{}' does not apply to text check '{}' (use pass/warn lists)", key, name));
      else if (!node.is_number())
        st = at(source, node, fmt::format("'{}' in [{}] must be a number ({})", key, table, spec->unit));
      // nan compares false with everything: every value would pass.
      else if (!std::isfinite(*node.value<double>()))
        st = at(source, node, fmt::format("'{}' in [{}] must be a finite number, not {}", key, table, *node.value<double>()));
      else cfg[key] = *node.value<double>();
      return true;
    }
    if (key == "pass" || key == "warn") {
      if (spec->kind != ValueKind::kText) {
        st = at(source, node, fmt::format("'{}' lists apply to text checks; '{}' is numeric (use {}_below/{}_above)", key, name, key == "pass" ? "fail" : "warn", key == "pass" ? "fail" : "warn"));
        return true;
      }
      auto list = string_list(source, fmt::format("'{}' in [{}]", key, table), node);
      if (!list) st = list.error();
      else cfg[key] = *list;
      return true;
    }
    if (key == "quick") {
      const toml::table* q = node.as_table();
      if (!q) {
        st = at(source, node, fmt::format("'quick' in [{}] must be a table", table));
        return true;
      }
      st = parse_params(source, table + ".quick", *q, specs, quick, &quick_timeout, nullptr);
      return true;
    }
    return false;
  };
  if (Status st = parse_params(source, table, t, specs, normal, &timeout, other); !st) return st;

  if (timeout) cfg["timeout"] = *timeout;
  if (quick_timeout) cfg["quick_timeout"] = *quick_timeout;
  layer["checks"][name] = cfg;
  if (!normal.empty() || !quick.empty()) {
    layer["params"][name]["normal"] = normal;
    layer["params"][name]["quick"] = quick;
  }
  return {};
}

// [cluster]: thresholds of the comparisons between nodes.
Status parse_cluster(const std::string& source, const toml::node& node, json& d) {
  const toml::table* t = node.as_table();
  if (!t) return at(source, node, "[cluster] must be a table");
  static const char* kKeys[] = {"outlier_warn", "outlier_fail", "outlier_floor", "outlier_min_nodes",
                                "link_warn_ratio", "link_fail_ratio"};
  for (const auto& [k, n] : *t) {
    const std::string key(k.str());
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys))
      return at(source, n, fmt::format("unknown key '{}' in [cluster] ({})", key, fmt::join(kKeys, ", ")));
    auto v = n.value<double>();
    if (!v || !n.is_number() || !std::isfinite(*v) || *v < 0)
      return at(source, n, fmt::format("'{}' in [cluster] must be a finite non-negative number", key));
    if (key.starts_with("link_") && *v > 1) return at(source, n, fmt::format("'{}' in [cluster] must be in [0, 1]", key));
    // Becomes an unsigned count: a fraction or a value beyond it (or NaN) would not convert.
    if (key == "outlier_min_nodes" && !(*v >= 0 && *v <= 4294967295.0 && std::floor(*v) == *v))
      return at(source, n, "'outlier_min_nodes' in [cluster] must be a whole number of nodes");
    d["cluster"][key] = *v;
  }
  return {};
}

struct Layer {
  json data = json::object();
  std::string inherits = "default";
};

Expected<Layer> parse_layer(std::string_view text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    return Error{ErrorKind::kConfig, fmt::format("{}:{}:{}: {}", source, b.line, b.column, e.description())};
  }
  Layer layer;
  json& d = layer.data;
  for (const auto& [k, node] : root) {
    const std::string key(k.str());
    if (key == "name" || key == "description" || key == "inherits") {
      auto s = node.value<std::string>();
      if (!s) return at(source, node, fmt::format("'{}' must be a string", key));
      if (key == "inherits") layer.inherits = *s;
      else d[key] = *s;
    } else if (key == "baseline") {
      const toml::table* t = node.as_table();
      if (!t) return at(source, node, "[baseline] must be a table");
      for (const auto& [bk, bn] : *t) {
        const std::string bkey(bk.str());
        if (bkey != "fail_ratio" && bkey != "warn_ratio")
          return at(source, bn, fmt::format("unknown key '{}' in [baseline] (fail_ratio, warn_ratio)", bkey));
        auto v = bn.value<double>();
        if (!v || !bn.is_number() || !(*v > 0 && *v <= 1))  // false for nan too
          return at(source, bn, fmt::format("'{}' in [baseline] must be a number in (0, 1]", bkey));
        d["baseline"][bkey] = *v;
      }
    } else if (key == "storage") {
      const toml::table* t = node.as_table();
      if (!t) return at(source, node, "[storage] must be a table");
      const auto specs = params_for_section("storage");
      json normal = json::object();
      json quick = json::object();
      auto other = [&](const std::string& sk, const toml::node& sn, Status& st) -> bool {
        if (sk == "paths") {
          auto list = string_list(source, "'paths' in [storage]", sn);
          if (!list) st = list.error();
          else d["storage_paths"] = *list;
          return true;
        }
        if (sk == "quick") {
          const toml::table* q = sn.as_table();
          if (!q) st = at(source, sn, "'quick' in [storage] must be a table");
          else st = parse_params(source, "storage.quick", *q, specs, quick, nullptr, nullptr);
          return true;
        }
        return false;
      };
      if (Status st = parse_params(source, "storage", *t, specs, normal, nullptr, other); !st) return st.error();
      d["params"]["storage"]["normal"] = normal;
      d["params"]["storage"]["quick"] = quick;
    } else if (key == "cluster") {
      if (Status st = parse_cluster(source, node, d); !st) return st.error();
    } else if (key == "checks") {
      const toml::table* t = node.as_table();
      if (!t) return at(source, node, "[checks] must be a table of check tables");
      for (const auto& [ck, cn] : *t) {
        const toml::table* ct = cn.as_table();
        if (!ct) return at(source, cn, fmt::format("[checks.\"{}\"] must be a table", ck.str()));
        if (Status st = parse_check(source, std::string(ck.str()), *ct, d); !st) return st.error();
      }
    } else {
      return at(source, node, fmt::format("unknown key '{}' (name, description, inherits, baseline, storage, cluster, checks)", key));
    }
  }
  return layer;
}

// Objects merge key by key; anything else is replaced by the later layer.
void merge(json& base, const json& over) {
  for (auto it = over.begin(); it != over.end(); ++it) {
    if (it->is_object() && base.contains(it.key()) && base[it.key()].is_object()) merge(base[it.key()], *it);
    else base[it.key()] = *it;
  }
}

const BuiltinProfile* find_builtin(const std::string& name) {
  for (const auto& b : builtin_profiles())
    if (name == b.name) return &b;
  return nullptr;
}

bool looks_like_path(const std::string& s) {
  return s.find('/') != std::string::npos || s.ends_with(".toml");
}

// Resolves a chain of `inherits` into merged data, base first.
Status load_chain(const std::string& name_or_path, const std::string& relative_to, json& merged,
                  std::vector<std::string>& sources, int depth) {
  if (depth > 8) return Error{ErrorKind::kConfig, fmt::format("profile '{}': inherits nests too deep (a cycle?)", name_or_path)};
  std::string text;
  std::string source;
  if (const BuiltinProfile* b = looks_like_path(name_or_path) ? nullptr : find_builtin(name_or_path)) {
    text = b->text;
    source = std::string("builtin:") + b->name;
  } else if (looks_like_path(name_or_path) || std::filesystem::exists(name_or_path)) {
    std::filesystem::path p(name_or_path);
    if (p.is_relative() && !relative_to.empty()) p = std::filesystem::path(relative_to) / p;
    auto t = read_file(p.string());
    if (!t) return Error{ErrorKind::kConfig, fmt::format("profile {}", t.error().message)};
    text = std::move(*t);
    source = p.string();
  } else {
    std::string names;
    for (const auto& n : builtin_profile_names()) names += (names.empty() ? "" : ", ") + n;
    return Error{ErrorKind::kUsage, fmt::format("unknown profile '{}': not a built-in ({}) nor a file", name_or_path, names)};
  }
  auto layer = parse_layer(text, source);
  if (!layer) return layer.error();
  // The built-in default is the root of every chain.
  if (source != "builtin:default" && layer->inherits != "none") {
    const std::string dir = source.starts_with("builtin:") ? "" : std::filesystem::path(source).parent_path().string();
    if (Status st = load_chain(layer->inherits, dir, merged, sources, depth + 1); !st) return st;
  }
  merge(merged, layer->data);
  sources.push_back(source);
  return {};
}

Profile build(const json& d, std::vector<std::string> sources) {
  Profile p;
  p.name = d.value("name", "unnamed");
  p.description = d.value("description", "");
  p.sources = std::move(sources);
  if (d.contains("baseline")) {
    p.baseline_fail_ratio = d["baseline"].value("fail_ratio", p.baseline_fail_ratio);
    p.baseline_warn_ratio = d["baseline"].value("warn_ratio", p.baseline_warn_ratio);
  }
  if (d.contains("storage_paths")) p.storage_paths = d["storage_paths"].get<std::vector<std::string>>();
  if (d.contains("checks")) {
    for (auto it = d["checks"].begin(); it != d["checks"].end(); ++it) {
      CheckConfig c;
      const json& j = *it;
      c.enabled = j.value("enabled", true);
      auto opt = [&](const char* k) { return j.contains(k) ? std::optional<double>(j[k].get<double>()) : std::nullopt; };
      c.fail_below = opt("fail_below");
      c.warn_below = opt("warn_below");
      c.fail_above = opt("fail_above");
      c.warn_above = opt("warn_above");
      c.timeout_s = opt("timeout");
      c.quick_timeout_s = opt("quick_timeout");
      if (j.contains("pass")) c.pass = j["pass"].get<std::vector<std::string>>();
      if (j.contains("warn")) c.warn = j["warn"].get<std::vector<std::string>>();
      p.checks[it.key()] = c;
    }
  }
  if (d.contains("cluster")) {
    const json& c = d["cluster"];
    p.cluster.outlier_warn = c.value("outlier_warn", p.cluster.outlier_warn);
    p.cluster.outlier_fail = c.value("outlier_fail", p.cluster.outlier_fail);
    p.cluster.outlier_floor = c.value("outlier_floor", p.cluster.outlier_floor);
    p.cluster.outlier_min_nodes = static_cast<unsigned>(c.value("outlier_min_nodes", double(p.cluster.outlier_min_nodes)));
    p.cluster.link_warn_ratio = c.value("link_warn_ratio", p.cluster.link_warn_ratio);
    p.cluster.link_fail_ratio = c.value("link_fail_ratio", p.cluster.link_fail_ratio);
  }
  if (d.contains("params")) p.params = d["params"];
  return p;
}

}  // namespace

std::vector<std::string> builtin_profile_names() {
  std::vector<std::string> names;
  for (const auto& b : builtin_profiles()) names.emplace_back(b.name);
  return names;
}

Expected<Profile> load_profile(const std::string& name_or_path) {
  json merged = json::object();
  std::vector<std::string> sources;
  if (Status st = load_chain(name_or_path, "", merged, sources, 0); !st) return st.error();
  return build(merged, std::move(sources));
}

Expected<Profile> parse_profile(std::string_view text, const std::string& source) {
  auto layer = parse_layer(text, source);
  if (!layer) return layer.error();
  json merged = json::object();
  std::vector<std::string> sources;
  if (layer->inherits != "none") {
    const std::string dir = std::filesystem::path(source).parent_path().string();
    if (Status st = load_chain(layer->inherits, dir, merged, sources, 1); !st) return st.error();
  }
  merge(merged, layer->data);
  sources.push_back(source);
  return build(merged, std::move(sources));
}

json to_json(const Profile& p) {
  json checks = json::object();
  for (const auto& [name, c] : p.checks) {
    json j = {{"enabled", c.enabled}};
    if (c.fail_below) j["fail_below"] = *c.fail_below;
    if (c.warn_below) j["warn_below"] = *c.warn_below;
    if (c.fail_above) j["fail_above"] = *c.fail_above;
    if (c.warn_above) j["warn_above"] = *c.warn_above;
    if (!c.pass.empty()) j["pass"] = c.pass;
    if (!c.warn.empty()) j["warn"] = c.warn;
    if (c.timeout_s) j["timeout_s"] = *c.timeout_s;
    checks[name] = j;
  }
  return {{"name", p.name},
          {"description", p.description},
          {"sources", p.sources},
          {"baseline", {{"fail_ratio", p.baseline_fail_ratio}, {"warn_ratio", p.baseline_warn_ratio}}},
          {"storage_paths", p.storage_paths},
          {"cluster", {{"outlier_warn", p.cluster.outlier_warn}, {"outlier_fail", p.cluster.outlier_fail},
                       {"outlier_floor", p.cluster.outlier_floor}, {"outlier_min_nodes", p.cluster.outlier_min_nodes},
                       {"link_warn_ratio", p.cluster.link_warn_ratio}, {"link_fail_ratio", p.cluster.link_fail_ratio}}},
          {"checks", checks},
          {"params", p.params}};
}

}  // namespace pacer::vet
