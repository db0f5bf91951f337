// Amdahl, Karp-Flatt and the fit of measured scaling points.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Beyond this multiple of the largest measured count a prediction rests more on the model than on data.
constexpr double kFarFactor = 4.0;

Error usage(std::string m) { return Error{ErrorKind::kUsage, std::move(m)}; }

// Efficiency predicted by the model with serial fraction f at k times the base count.
double model_efficiency(ScalingMode mode, double f, double k) {
  if (mode == ScalingMode::kStrong) return amdahl_speedup(f, k) / k;
  return 1 - f * (1 - 1 / k);  // Gustafson: scaled speedup k - f (k - 1), divided by k
}

}  // namespace

double amdahl_speedup(double f, double n) { return 1.0 / (f + (1.0 - f) / n); }

double karp_flatt(double speedup, double n) {
  if (n <= 1) return kNaN;
  return (1.0 / speedup - 1.0 / n) / (1.0 - 1.0 / n);
}

Expected<AmdahlReport> amdahl(std::optional<double> serial_fraction, std::optional<double> measured_speedup, double n) {
  if (!(n >= 1) || !std::isfinite(n)) return usage(fmt::format("--gpus {}: expected a count of at least 1", n));
  if (serial_fraction.has_value() == measured_speedup.has_value())
    return usage("give either --serial-fraction or --speedup");
  AmdahlReport r;
  r.n = n;
  if (serial_fraction) {
    if (!(*serial_fraction >= 0 && *serial_fraction <= 1))
      return usage(fmt::format("--serial-fraction {}: expected a fraction in [0, 1]", *serial_fraction));
    r.serial_fraction = *serial_fraction;
  } else {
    if (!(*measured_speedup > 0)) return usage(fmt::format("--speedup {}: expected a positive speedup", *measured_speedup));
    if (n <= 1) return usage("--speedup needs --gpus greater than 1");
    if (*measured_speedup > n)
      return usage(fmt::format("--speedup {} on {} GPUs is superlinear: no serial fraction explains it", *measured_speedup, n));
    r.serial_fraction = karp_flatt(*measured_speedup, n);
  }
  const double f = r.serial_fraction;
  r.speedup = amdahl_speedup(f, n);
  r.efficiency = r.speedup / n;
  r.max_speedup = f > 0 ? 1.0 / f : kInf;
  r.n_for_half_efficiency = f > 0 ? 1.0 + 1.0 / f : kInf;
  return r;
}

Expected<std::vector<ScalingPoint>> read_scaling_csv(const std::string& path) {
  auto t = read_csv(path);
  if (!t) return t.error();
  auto gpus_col = t->required_column("gpus");
  if (!gpus_col) return gpus_col.error();
  const int g = *gpus_col, thr = t->column("throughput"), st = t->column("step_time_s");
  if ((thr < 0) == (st < 0))
    return Error{ErrorKind::kConfig, fmt::format("{}: expected exactly one of the columns 'throughput' and 'step_time_s'", path)};
  std::vector<ScalingPoint> pts;
  for (const auto& row : t->rows) {
    auto gpus = t->number(row, g);
    if (!gpus) return gpus.error();
    auto v = t->number(row, thr >= 0 ? thr : st);
    if (!v) return v.error();
    if (*gpus < 1 || std::floor(*gpus) != *gpus)
      return Error{ErrorKind::kConfig, fmt::format("{}:{}: column 'gpus': {} is not a positive whole count", path, row.line, *gpus)};
    if (!(*v > 0))
      return Error{ErrorKind::kConfig, fmt::format("{}:{}: column '{}': {} must be positive", path, row.line,
                                                   t->header[thr >= 0 ? thr : st], *v)};
    ScalingPoint p;
    p.gpus = *gpus;
    p.line = row.line;
    (thr >= 0 ? p.throughput : p.step_time_s) = *v;
    pts.push_back(p);
  }
  return pts;
}

Expected<ScalingReport> analyse_scaling(std::vector<ScalingPoint> pts, ScalingMode mode, const std::vector<double>& predict_at) {
  std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.gpus < b.gpus; });
  if (pts.size() < 2 || pts.front().gpus == pts.back().gpus)
    return Error{ErrorKind::kUsage, "scaling needs points at two or more GPU counts"};
  ScalingReport r;
  r.mode = mode;
  const ScalingPoint base = pts.front();
  const bool by_time = base.throughput == 0;
  // Regress y = f x through the origin, with x = 1 - 1/k and y the loss the model attributes to f:
  // strong: 1/S - 1/k (Amdahl), weak: 1 - E (Gustafson).
  double sxy = 0, sxx = 0;
  for (auto& p : pts) {
    const double k = p.gpus / base.gpus;
    // Speedup over the base count for the same total work (strong) or per-GPU work (weak).
    const double ratio = by_time ? base.step_time_s / p.step_time_s : p.throughput / base.throughput;
    if (mode == ScalingMode::kStrong || !by_time) p.efficiency = ratio / k;
    else p.efficiency = ratio;  // weak scaling by step time: ideal is a constant step time
    p.karp_flatt = k > 1 ? karp_flatt(p.efficiency * k, k) : kNaN;
    if (k <= 1) continue;
    const double x = 1 - 1 / k;
    const double y = mode == ScalingMode::kStrong ? 1 / (p.efficiency * k) - 1 / k : 1 - p.efficiency;
    sxy += x * y;
    sxx += x * x;
  }
  r.serial_fraction = sxx > 0 ? sxy / sxx : 0;
  double ss = 0, ss_eff = 0;
  int m = 0;
  for (const auto& p : pts) {
    const double k = p.gpus / base.gpus;
    if (k <= 1) continue;
    const double x = 1 - 1 / k;
    const double y = mode == ScalingMode::kStrong ? 1 / (p.efficiency * k) - 1 / k : 1 - p.efficiency;
    ss += (y - r.serial_fraction * x) * (y - r.serial_fraction * x);
    const double e = model_efficiency(mode, r.serial_fraction, k) - p.efficiency;
    ss_eff += e * e;
    ++m;
  }
  r.serial_fraction_stderr = m >= 2 ? std::sqrt(ss / (m - 1) / sxx) : kNaN;
  r.rms_residual = m > 0 ? std::sqrt(ss_eff / m) : 0;
  r.points = pts;
  if (r.serial_fraction < 0)
    r.warnings.push_back("the points scale better than linearly (negative serial fraction): check the measurements");
  for (const auto& p : pts)
    if (p.efficiency > 1.05)
      r.warnings.push_back(fmt::format("line {}: efficiency {:.0f}% is superlinear (caches, or a slow base point)", p.line,
                                       100 * p.efficiency));

  std::vector<double> targets = predict_at;
  if (targets.empty())
    for (double f : {2.0, 4.0, 8.0}) targets.push_back(pts.back().gpus * f);
  const double top = pts.back().gpus;
  for (double n : targets) {
    if (!(n >= 1)) return Error{ErrorKind::kUsage, fmt::format("--predict {}: expected a GPU count of at least 1", n)};
    ScalingPrediction pr;
    pr.gpus = n;
    const double k = n / base.gpus;
    const double f = std::max(0.0, r.serial_fraction);
    pr.efficiency = model_efficiency(mode, f, k);
    if (std::isnan(r.serial_fraction_stderr)) {
      pr.efficiency_low = pr.efficiency_high = kNaN;
    } else {
      pr.efficiency_low = model_efficiency(mode, std::min(1.0, f + 2 * r.serial_fraction_stderr), k);
      pr.efficiency_high = model_efficiency(mode, std::max(0.0, f - 2 * r.serial_fraction_stderr), k);
    }
    pr.extrapolated_far = n > kFarFactor * top;
    if (pr.extrapolated_far)
      r.warnings.push_back(fmt::format("{} GPUs is {:.0f}x the largest measured count ({}): the prediction rests on the model, "
                                       "not on data; measure nearer before buying",
                                       n, n / top, top));
    r.predictions.push_back(pr);
  }
  if (m < 2) r.warnings.push_back("two GPU counts fit the model exactly: no uncertainty can be given; measure a third");
  return r;
}

}  // namespace pacer::plan
