// pacer plan search: every layout of a transformer on a number of GPUs, those that fit in memory ranked by the
// step-time model of transformer.cpp. Pure enumeration: the model is cheap (microseconds a layout), so
// nothing is pruned by heuristics that could hide the best one.
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

Error usage(std::string m) { return Error{ErrorKind::kUsage, std::move(m)}; }

std::vector<int> or_default(const std::vector<int>& given, std::vector<int> fallback) {
  return given.empty() ? fallback : given;
}

std::vector<int> powers_of_two(int up_to) {
  std::vector<int> v;
  for (int x = 1; x <= up_to; x *= 2) v.push_back(x);
  return v;
}

std::vector<int> divisors(int n) {
  std::vector<int> v;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) v.push_back(d);
  return v;
}

int rank(Recompute r) { return r == Recompute::kNone ? 0 : r == Recompute::kSelective ? 1 : 2; }

// The parts of the step that grew from `best` to `c`, largest first; the name says which choice caused it.
std::vector<std::pair<std::string, double>> losses(const Candidate& c, const Candidate& best) {
  const StepReport &a = c.step, &b = best.step;
  const bool more_recompute = rank(c.layout.recompute) > rank(best.layout.recompute);
  std::vector<std::pair<std::string, double>> v = {
      {"pipeline bubble", a.bubble_s - b.bubble_s},
      {"tensor-parallel comm", a.tp_comm_s - b.tp_comm_s},
      {"pipeline send/recv", a.pp_comm_s - b.pp_comm_s},
      {"context-parallel comm", a.cp_comm_s - b.cp_comm_s},
      {"expert all-to-all", a.ep_comm_s - b.ep_comm_s},
      {"data-parallel comm", a.dp_comm_s - b.dp_comm_s},
      {more_recompute ? "recomputation" : "GEMM", a.gemm_s - b.gemm_s},
      {"memory-bound kernels", a.elementwise_s - b.elementwise_s},
      {"optimizer", a.optimizer_s - b.optimizer_s},
  };
  v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& x) { return !(x.second > 1e-6 * b.step_s); }), v.end());
  std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (v.size() > 3) v.resize(3);
  return v;
}

}  // namespace

Expected<SearchReport> search_layouts(const Model& m, const Parallel& base, const Hardware& hw, const SearchSpace& space) {
  if (space.gpus < 1) return usage(fmt::format("--gpus {}: expected a positive count", space.gpus));
  if (space.gpus > (1 << 24)) return usage(fmt::format("--gpus {}: too many", space.gpus));
  if (space.global_batch < 1) return usage(fmt::format("--global-batch {}: expected a positive number", space.global_batch));
  if (!(space.memory_bytes > 0)) return usage("--gpu-memory: give the memory of one GPU (or --gpu NAME)");
  if (!(space.margin_bytes >= 0) || space.margin_bytes >= space.memory_bytes)
    return usage("--memory-margin: must leave some of --gpu-memory");
  if (space.top < 1 || space.top > 1000) return usage(fmt::format("--top {}: expected 1 to 1000", space.top));
  if (m.layers < 1 || m.heads < 1) return usage("give the model (--model NAME, or --layers, --hidden, --heads, --seq, --vocab)");
  {
    // The model itself, before any layout: its errors are the user's, not the search's.
    Parallel probe = base;
    probe.tp = probe.pp = probe.dp = probe.cp = probe.ep = probe.micro_batch = probe.interleave = 1;
    probe.global_batch = 0;
    // The layout's own switches, which the enumeration sets per layout, would be refused on one GPU.
    probe.uneven_stages = probe.sequence_parallel = false;
    if (Status s = validate(m, probe); !s) return s.error();
  }
  const auto tps = or_default(space.tp, powers_of_two(std::min(hw.gpus_per_node, m.heads)));
  const auto cps = or_default(space.cp, base.flash_attention ? std::vector<int>{1, 2, 4, 8, 16, 32} : std::vector<int>{1});
  // Every stage count up to the layers (at most 128): those that do not divide the layers get uneven stages.
  std::vector<int> all_pp;
  for (int x = 1; x <= std::min(m.layers, 128); ++x) all_pp.push_back(x);
  const auto pps = or_default(space.pp, all_pp);
  // Expert parallelism over the powers of two that divide the experts, and all of them: what frameworks run,
  // and few enough that an expert count with many divisors cannot blow the enumeration up.
  std::vector<int> ep_default{1};
  if (m.experts > 0) {
    ep_default.clear();
    for (int d : divisors(m.experts))
      if ((d & (d - 1)) == 0 || d == m.experts) ep_default.push_back(d);
  }
  const auto eps = or_default(space.ep, ep_default);
  const auto mbs = or_default(space.micro_batch, {1, 2, 4, 8});
  const auto vs = or_default(space.interleave, {1, 2, 3, 4, 5, 6, 8, 10});
  const auto rcs = space.recompute.empty() ? std::vector<Recompute>{Recompute::kNone, Recompute::kSelective, Recompute::kFull}
                                           : space.recompute;
  const double capacity = space.memory_bytes - space.margin_bytes;
  // Ties (layouts the model cannot tell apart) keep a stable, simple order: fewer pipeline stages, then less tp.
  auto faster = [](const Candidate& a, const Candidate& b) {
    if (a.step.step_s != b.step.step_s) return a.step.step_s < b.step.step_s;
    if (a.layout.pp != b.layout.pp) return a.layout.pp < b.layout.pp;
    if (a.layout.tp != b.layout.tp) return a.layout.tp < b.layout.tp;
    return a.memory.total_bytes < b.memory.total_bytes;
  };
  const std::size_t keep = static_cast<std::size_t>(space.top);

  SearchReport r;
  r.best_memory_bytes = std::numeric_limits<double>::infinity();
  std::string first_refusal;  // why the first layout that failed validate() did
  std::vector<Candidate> fitting;
  for (int tp : tps)
    for (int cp : cps)
      for (int pp : pps) {
        const long model_parallel = long(tp) * cp * pp;
        if (model_parallel > space.gpus || space.gpus % model_parallel) continue;
        const int dp = int(space.gpus / model_parallel);
        if (space.global_batch % dp) continue;
        for (int ep : eps) {  // validate() refuses an ep that does not divide the experts and dp, with the reason
          for (int mb : mbs) {
            if (space.global_batch % (long(mb) * dp)) continue;
            for (int v : vs) {
              if (v > 1 && pp == 1) continue;
              for (Recompute rc : rcs) {
                const std::vector<int> zeros = or_default(space.zero_stage, pp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0, 1, 2, 3});
                for (int zero : zeros) {
                  Parallel p = base;
                  p.tp = tp;
                  p.cp = cp;
                  p.pp = pp;
                  p.dp = dp;
                  p.ep = ep;
                  p.micro_batch = mb;
                  p.global_batch = space.global_batch;
                  p.interleave = v;
                  p.uneven_stages = pp > 1 && m.layers % (pp * v) != 0;
                  p.recompute = rc;
                  p.zero_stage = zero;
                  // Megatron-Core's advice and the model's finding alike: with tp > 1 sequence parallelism only saves.
                  p.sequence_parallel = tp > 1;
                  if (Status valid = validate(m, p); !valid) {
                    if (first_refusal.empty()) first_refusal = valid.error().message;
                    continue;
                  }
                  ++r.evaluated;
                  const MemoryReport mem = estimate_memory(m, p);
                  r.best_memory_bytes = std::min(r.best_memory_bytes, mem.total_bytes);
                  if (mem.total_bytes > capacity) continue;
                  auto step = estimate_step(m, p, hw);
                  if (!step) return step.error();  // a missing hardware figure: every layout would fail
                  fitting.push_back(Candidate{p, *step, mem, {}});
                  ++r.fitting;
                  // Only the best `top` are kept: memory stays bounded whatever the enumeration's size.
                  if (fitting.size() >= 4 * keep + 1024) {
                    std::nth_element(fitting.begin(), fitting.begin() + static_cast<long>(keep), fitting.end(), faster);
                    fitting.resize(keep);
                  }
                }
              }
            }
          }
        }
      }
  // Not a single layout is valid (a dimension fixed to a value no layout can take): the user's error, with its reason.
  if (r.evaluated == 0) {
    if (first_refusal.empty())
      return usage(fmt::format("no tp x pp x cp layout divides --gpus {} with a data-parallel size that divides --global-batch {}",
                               space.gpus, space.global_batch));
    return usage(fmt::format("no layout of {} GPUs is valid: {}", space.gpus, first_refusal));
  }
  const std::size_t n = std::min(fitting.size(), keep);
  std::partial_sort(fitting.begin(), fitting.begin() + static_cast<long>(n), fitting.end(), faster);
  fitting.resize(n);
  for (std::size_t i = 1; i < fitting.size(); ++i) fitting[i].losses = losses(fitting[i], fitting[0]);
  r.top = std::move(fitting);
  return r;
}

}  // namespace pacer::plan
