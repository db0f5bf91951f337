// Robust outlier scores, and their use among one node's GPUs.
#include "outliers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "pacer/core/stats.hpp"
#include "pacer/core/units.hpp"
#include "probes.hpp"

namespace pacer::vet {

namespace {

bool is_gpu_target(const std::string& t) {
  return t.size() > 3 && t.starts_with("gpu") && std::all_of(t.begin() + 3, t.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

RobustScale robust_scale(const std::vector<double>& values, double floor) {
  RobustScale s;
  s.median = median(values);
  std::vector<double> dev;
  for (double v : values) dev.push_back(std::fabs(v - s.median));
  s.mad = median(dev);
  // 1.4826 MAD estimates the standard deviation of normal data; the floor
  // keeps identical peers (MAD 0) from flagging differences of a few percent.
  s.sigma = std::max(1.4826 * s.mad, floor * std::fabs(s.median));
  return s;
}

void judge_gpu_outliers(std::vector<CheckResult>& checks, const ClusterConfig& cfg) {
  std::map<std::string, std::vector<CheckResult*>> by_check;
  for (auto& c : checks) {
    // A non-finite value has failed already and would poison the median.
    if (!c.value || !std::isfinite(*c.value) || !is_gpu_target(c.target) || c.status == CheckStatus::kSkip ||
        c.status == CheckStatus::kError)
      continue;
    const CheckSpec* spec = find_check(c.name);
    // Only throughput: a warmer or busier GPU is not a slower one. The
    // sustained clock is the lowest of many samples, which dips briefly on
    // healthy GPUs: too noisy to compare GPUs by.
    if (spec && spec->direction == Direction::kHigher && c.name != "gpu.sustained_clock") by_check[c.name].push_back(&c);
  }
  for (auto& [name, list] : by_check) {
    if (list.size() < std::max(3u, cfg.outlier_min_nodes)) continue;
    std::vector<double> values;
    for (const auto* c : list) values.push_back(*c->value);
    const RobustScale s = robust_scale(values, cfg.outlier_floor);
    if (!(s.sigma > 0)) continue;
    for (auto* c : list) {
      const double z = (*c->value - s.median) / s.sigma;
      const CheckStatus st = z < -cfg.outlier_fail ? CheckStatus::kFail : z < -cfg.outlier_warn ? CheckStatus::kWarn : CheckStatus::kPass;
      if (st == CheckStatus::kPass) continue;
      const std::string why = fmt::format("outlier: {:.0f}% of the median of the node's {} GPUs ({} {}; z {:.1f})",
                                          100 * *c->value / s.median, list.size(), format_number(s.median), c->unit, z);
      c->reason = c->reason.empty() || c->status == CheckStatus::kPass ? why : c->reason + "; " + why;
      c->status = worse(c->status, st);
    }
  }
}

}  // namespace pacer::vet
