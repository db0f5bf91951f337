#include "pacer/core/stats.hpp"

#include <algorithm>
#include <cmath>

namespace pacer {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double young_interval(double save_cost_s, double mtbf_s) {
  if (!(save_cost_s > 0) || !(mtbf_s > 0)) return 0;
  return std::sqrt(2 * save_cost_s * mtbf_s);
}

double optimal_interval(double save_cost_s, double mtbf_s) {
  if (!(save_cost_s > 0) || !(mtbf_s > 0)) return 0;
  if (save_cost_s >= 2 * mtbf_s) return mtbf_s;
  const double x = save_cost_s / (2 * mtbf_s);
  return std::sqrt(2 * save_cost_s * mtbf_s) * (1 + std::sqrt(x) / 3 + x / 9) - save_cost_s;
}

Expected<double> busbw_factor(std::string_view c, int n) {
  const double nd = n;
  if (c == "all_reduce") return 2.0 * (nd - 1) / nd;
  if (c == "reduce_scatter" || c == "all_gather" || c == "all_to_all") return (nd - 1) / nd;
  if (c == "broadcast") return 1.0;
  return Error{ErrorKind::kUsage, "unknown collective '" + std::string(c) +
                                      "' (expected one of all_reduce, reduce_scatter, all_gather, broadcast, all_to_all)"};
}

}  // namespace pacer
