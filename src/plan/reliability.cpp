// Checkpoint intervals and the odds of failure over a campaign.
#include <fmt/format.h>

#include <cmath>

#include "pacer/core/stats.hpp"
#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

// First-order share of wall time lost with checkpoints every `interval` seconds: the saves themselves,
// plus per failure half an interval of work redone and the restart.
double lost_fraction(double interval, const CkptInput& in) {
  return in.save_cost_s / interval + (interval / 2 + in.restart_cost_s) / in.mtbf_s;
}

}  // namespace

double job_mtbf_s(double node_mtbf_s, int nodes) { return nodes > 0 ? node_mtbf_s / nodes : 0; }

Expected<CkptReport> plan_ckpt(const CkptInput& in) {
  auto bad = [](const char* what, double v) {
    return Error{ErrorKind::kUsage, fmt::format("{} {}: expected a positive duration", what, v)};
  };
  if (!(in.save_cost_s > 0)) return bad("--save-cost", in.save_cost_s);
  if (!(in.mtbf_s > 0)) return bad("--mtbf", in.mtbf_s);
  if (in.restart_cost_s < 0) return bad("--restart-cost", in.restart_cost_s);
  if (in.campaign_s < 0) return bad("--campaign", in.campaign_s);
  if (in.current_interval_s < 0) return bad("--interval", in.current_interval_s);
  if (in.write_time_s < 0) return bad("--write-time", in.write_time_s);
  CkptReport r;
  // One definition of the optimum for the whole of pacer: core's, which checkpoint uses too.
  r.young_interval_s = pacer::young_interval(in.save_cost_s, in.mtbf_s);
  r.daly_interval_s = pacer::optimal_interval(in.save_cost_s, in.mtbf_s);
  r.interval_s = std::max(r.daly_interval_s, in.write_time_s);
  r.lost_fraction = std::min(1.0, lost_fraction(r.interval_s, in));
  if (in.current_interval_s > 0) r.lost_fraction_current = std::min(1.0, lost_fraction(in.current_interval_s, in));
  r.expected_failures = in.campaign_s / in.mtbf_s;
  r.p_any_failure = 1 - std::exp(-r.expected_failures);
  return r;
}

}  // namespace pacer::plan
