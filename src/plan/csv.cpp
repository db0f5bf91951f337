// CSV and vet-report readers for pacer plan: the only input parsing the planner does.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

std::string trim(std::string s) {
  auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  std::istringstream in(line);
  while (std::getline(in, cell, ',')) cells.push_back(trim(cell));
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

Error config_error(std::string message) { return Error{ErrorKind::kConfig, std::move(message)}; }

}  // namespace

int CsvTable::column(const std::string& name) const {
  for (std::size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return static_cast<int>(i);
  return -1;
}

Expected<int> CsvTable::required_column(const std::string& name) const {
  const int c = column(name);
  if (c < 0) return config_error(fmt::format("{}: no '{}' column in the header", path, name));
  return c;
}

Expected<double> CsvTable::number(const CsvRow& row, int col) const {
  const std::string& cell = row.cells.at(static_cast<std::size_t>(col));
  double v = 0;
  const char* end = cell.data() + cell.size();
  auto [ptr, ec] = std::from_chars(cell.data(), end, v);
  if (cell.empty() || ec != std::errc() || ptr != end || !std::isfinite(v))
    return config_error(fmt::format("{}:{}: column '{}': '{}' is not a number", path, row.line, header[col], cell));
  return v;
}

Expected<CsvTable> parse_csv(const std::string& text, const std::string& path) {
  CsvTable t;
  t.path = path;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string stripped = trim(line);
    if (stripped.empty() || stripped[0] == '#') continue;
    if (stripped.find('"') != std::string::npos)
      return config_error(fmt::format("{}:{}: quoted cells are not supported", path, n));
    auto cells = split(stripped);
    if (t.header.empty()) {
      for (auto& c : cells) {
        std::transform(c.begin(), c.end(), c.begin(), [](unsigned char ch) { return std::tolower(ch); });
        if (c.empty()) return config_error(fmt::format("{}:{}: empty column name in the header", path, n));
      }
      t.header = std::move(cells);
      continue;
    }
    if (cells.size() != t.header.size())
      return config_error(fmt::format("{}:{}: {} cells, the header has {}", path, n, cells.size(), t.header.size()));
    t.rows.push_back(CsvRow{n, std::move(cells)});
  }
  if (t.header.empty()) return config_error(fmt::format("{}: no header line", path));
  if (t.rows.empty()) return config_error(fmt::format("{}: no data rows", path));
  return t;
}

Expected<CsvTable> read_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return config_error(fmt::format("{}: cannot open", path));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_csv(text.str(), path);
}

Expected<Calibration> read_vet_report(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return config_error(fmt::format("{}: cannot open", path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return config_error(fmt::format("{}: not JSON: {}", path, e.what()));
  }
  const std::string schema = j.is_object() ? j.value("schema", std::string()) : std::string();
  if (schema != "pacer.vet/1" && schema != "pacer.vet.cluster/1")
    return config_error(fmt::format("{}: key 'schema': expected \"pacer.vet/1\" or \"pacer.vet.cluster/1\" (a `pacer vet --json` or `pacer vet --cluster --json` report)", path));
  // The unit each figure must be reported in; a report in another unit is refused rather than misread.
  static const std::map<std::string, std::string> kUnits = {
      {"gpu.gemm_bf16", "TFLOP/s"}, {"gpu.hbm_bandwidth", "GB/s"}, {"gpu.nccl_busbw", "GB/s"},
      {"storage.write", "MB/s"},    {"memory.bandwidth", "GB/s"},  {"cpu.flops", "GFLOP/s"}};
  Calibration c;
  c.source = path;
  auto take = [&](const std::string& name, double v) {
    if (!(v > 0)) return;
    auto [it, fresh] = c.figures.emplace(name, v);
    if (!fresh) it->second = std::min(it->second, v);  // the slowest GPU or node sets the pace
  };
  auto read_checks = [&](const nlohmann::json& checks, const std::string& where) -> Status {
    if (!checks.is_array()) return config_error(fmt::format("{}: key '{}': expected an array", path, where));
    for (const auto& check : checks) {
      if (!check.is_object()) continue;
      const std::string name = check.value("name", std::string());
      auto unit = kUnits.find(name);
      if (unit == kUnits.end()) continue;
      const std::string status = check.value("status", std::string());
      if (status == "skip" || status == "error") continue;
      if (!check.contains("value") || !check["value"].is_number()) continue;
      if (check.value("unit", std::string()) != unit->second)
        return config_error(fmt::format("{}: check '{}': unit '{}', expected '{}'", path, name, check.value("unit", std::string()), unit->second));
      take(name, check["value"].get<double>());
    }
    return {};
  };
  if (schema == "pacer.vet/1") {
    if (!j.contains("checks")) return config_error(fmt::format("{}: key 'checks': expected an array", path));
    if (Status st = read_checks(j["checks"], "checks"); !st) return st.error();
    return c;
  }
  // A cluster report: every node's checks, and the all-reduce across nodes
  // (NCCL's when it ran, else MPI's) as the data-parallel network figure.
  if (j.contains("nodes") && j["nodes"].is_array())
    for (const auto& n : j["nodes"])
      if (n.is_object() && n.contains("report") && n["report"].is_object() && n["report"].contains("checks"))
        if (Status st = read_checks(n["report"]["checks"], "nodes[].report.checks"); !st) return st.error();
  for (const char* kind : {"nccl", "allreduce"}) {
    const auto& net = j.contains("network") ? j["network"] : nlohmann::json();
    if (!net.is_object() || !net.contains(kind) || !net[kind].is_object()) continue;
    const auto& a = net[kind];
    const std::string status = a.value("status", std::string());
    if ((status == "pass" || status == "warn") && a.contains("busbw_gbps") && a["busbw_gbps"].is_number()) {
      take("network.busbw_gbps", a["busbw_gbps"].get<double>());
      break;
    }
  }
  return c;
}

std::optional<double> figure(const Calibration& c, const std::string& check) {
  auto it = c.figures.find(check);
  if (it == c.figures.end()) return std::nullopt;
  return it->second;
}

}  // namespace pacer::plan
