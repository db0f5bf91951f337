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
  if (!j.is_object() || j.value("schema", std::string()) != "pacer.vet/1")
    return config_error(fmt::format("{}: key 'schema': expected \"pacer.vet/1\" (a `pacer vet --json` report)", path));
  if (!j.contains("checks") || !j["checks"].is_array())
    return config_error(fmt::format("{}: key 'checks': expected an array", path));
  // The unit each figure must be reported in; a report in another unit is refused rather than misread.
  static const std::map<std::string, std::string> kUnits = {
      {"gpu.gemm_bf16", "TFLOP/s"},      {"gpu.hbm_bandwidth", "GB/s"}, {"gpu.nccl_busbw", "GB/s"},
      {"link.network_busbw", "GB/s"},    {"storage.write", "MB/s"},     {"memory.bandwidth", "GB/s"},
      {"cpu.flops", "GFLOP/s"}};
  Calibration c;
  c.source = path;
  for (const auto& check : j["checks"]) {
    if (!check.is_object()) continue;
    const std::string name = check.value("name", std::string());
    auto unit = kUnits.find(name);
    if (unit == kUnits.end()) continue;
    const std::string status = check.value("status", std::string());
    if (status == "skip" || status == "error") continue;
    if (!check.contains("value") || !check["value"].is_number()) continue;
    if (check.value("unit", std::string()) != unit->second)
      return config_error(fmt::format("{}: check '{}': unit '{}', expected '{}'", path, name,
                                      check.value("unit", std::string()), unit->second));
    const double v = check["value"].get<double>();
    if (!(v > 0)) continue;
    auto [it, fresh] = c.figures.emplace(name, v);
    if (!fresh) it->second = std::min(it->second, v);
  }
  return c;
}

std::optional<double> figure(const Calibration& c, const std::string& check) {
  auto it = c.figures.find(check);
  if (it == c.figures.end()) return std::nullopt;
  return it->second;
}

}  // namespace pacer::plan
