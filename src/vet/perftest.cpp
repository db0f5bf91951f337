#include "perftest.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "pacer/core/process.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::vet {
namespace {

std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    const std::size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

std::vector<std::string_view> lines(std::string_view text) {
  std::vector<std::string_view> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    out.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

std::optional<double> number(std::string_view s) {
  double v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v) || v < 0) return std::nullopt;
  return v;
}

// Header columns as perftest means them: "BW peak[Gb/sec]" and "99%
// percentile[usec]" are one column each although they hold a space.
std::vector<std::string> columns(std::string_view header) {
  std::vector<std::string> out;
  const auto w = words(header);
  for (std::size_t i = 0; i < w.size(); ++i) {
    std::string c(w[i]);
    if ((c == "BW" || c.ends_with("%")) && i + 1 < w.size()) c += " " + std::string(w[++i]);
    out.push_back(std::move(c));
  }
  return out;
}

// The last line of the report that says something: perftest's own error
// ("Couldn't connect to ...", "Unable to find the Infiniband/RoCE device").
std::string last_words(std::string_view report) {
  const auto ls = lines(report);
  for (auto it = ls.rbegin(); it != ls.rend(); ++it) {
    const auto w = words(*it);
    if (w.empty() || it->find("-----") != std::string_view::npos) continue;
    std::string s(*it);
    s.erase(0, s.find_first_not_of(" \t"));
    if (s.size() > 200) s = s.substr(0, 200) + "...";
    return s;
  }
  return "no output";
}

// The value in column `want` (the first whose name starts with one of them)
// of the last data row under the header that has it.
Expected<double> table_value(std::string_view report, const std::vector<std::string>& want, std::string* header_column) {
  std::optional<std::size_t> col;
  std::optional<double> value;
  for (const auto line : lines(report)) {
    const auto w = words(line);
    if (w.empty()) continue;
    if (w[0] == "#bytes") {
      const auto cols = columns(line);
      col.reset();
      for (const auto& name : want) {
        for (std::size_t i = 0; i < cols.size() && !col; ++i)
          if (cols[i].starts_with(name)) {
            col = i;
            if (header_column) *header_column = cols[i];
          }
        if (col) break;
      }
      continue;
    }
    if (!col || w.size() <= *col) continue;
    // A data row: the message size first, then numbers; warnings that
    // perftest prints between rows are skipped.
    if (!number(w[0]) || !number(w[1])) continue;
    if (auto v = number(w[*col])) value = v;
  }
  if (!value) return Error{ErrorKind::kIo, fmt::format("no result in the report: {}", last_words(report))};
  return *value;
}

}  // namespace

Expected<double> parse_perftest_bw(std::string_view report) {
  std::string column;
  auto v = table_value(report, {"BW average"}, &column);
  if (!v) return v;
  if (column.find("[Gb/sec]") == std::string::npos)
    return Error{ErrorKind::kIo, fmt::format("the report gives '{}', not Gb/sec (run with --report_gbits)", column)};
  return v;
}

Expected<double> parse_perftest_lat(std::string_view report) {
  std::string column;
  auto v = table_value(report, {"t_typical", "t_avg"}, &column);
  if (!v) return v;
  if (column.find("[usec]") == std::string::npos)
    return Error{ErrorKind::kIo, fmt::format("the report gives '{}', not microseconds", column)};
  return v;
}

std::vector<RdmaPort> active_rdma_ports(const std::string& root) {
  std::vector<RdmaPort> out;
  for (const auto& p : hw::read_ib_ports(root))
    if (p.state == "ACTIVE") out.push_back({p.device, p.port});
  return out;
}

std::string perftest_missing() {
  const char* path = std::getenv("PATH");
  std::string dirs = path && *path ? path : "/usr/bin:/bin";
  std::size_t pos = 0;
  while (pos <= dirs.size()) {
    const std::size_t end = std::min(dirs.find(':', pos), dirs.size());
    const std::string dir = dirs.substr(pos, end - pos);
    if (!dir.empty() && ::access((dir + "/ib_write_bw").c_str(), X_OK) == 0) return "";
    pos = end + 1;
  }
  return "perftest is not installed (no ib_write_bw on PATH; Debian package perftest)";
}

bool gpudirect_available(const std::string& root) {
  std::error_code ec;
  if (!std::filesystem::exists(root + "/sys/module/nvidia_peermem", ec)) return false;
  // Debian builds perftest without CUDA; its help then has no --use_cuda.
  auto help = capture_output({"ib_write_bw", "--help"}, 5);
  return help && help->output.find("use_cuda") != std::string::npos;
}

namespace {
std::vector<std::string> common_argv(const char* tool, const PerftestArgs& a) {
  std::vector<std::string> v = {tool, "-d", a.port.device, "-i", std::to_string(a.port.port), "-p", std::to_string(a.tcp_port),
                                "-F"};
  if (a.cuda_device) v.push_back(fmt::format("--use_cuda={}", *a.cuda_device));
  return v;
}
}  // namespace

std::vector<std::string> perftest_bw_argv(const PerftestArgs& a, const std::string& server_host) {
  auto v = common_argv("ib_write_bw", a);
  const long seconds = std::max(1L, std::lround(a.duration_s));
  for (const char* s : {"--report_gbits", "-q", "4", "-D"}) v.emplace_back(s);
  v.push_back(std::to_string(seconds));
  if (!server_host.empty()) v.push_back(server_host);
  return v;
}

std::vector<std::string> perftest_lat_argv(const PerftestArgs& a, const std::string& server_host) {
  auto v = common_argv("ib_write_lat", a);
  for (const char* s : {"-n", "1000"}) v.emplace_back(s);
  if (!server_host.empty()) v.push_back(server_host);
  return v;
}

}  // namespace pacer::vet
