// pacer plan against published measurements (tests/plan/published.csv): each prediction within 10% (or a
// documented miss) and equal to the error docs/plan.md reports; and the range of GEMM rates over which every
// step time and throughput is within 10%, as documented.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

// The A100 80GB SXM the papers ran on (docs/plan.md, "Validation"). Datasheet figures with stated
// efficiencies: 2039 GB/s HBM2e, 80% in streaming kernels; NVLink 3 all-reduce bus bandwidth 230 GB/s
// (nccl-tests on DGX A100); 8 x 200 Gb/s HDR InfiniBand per 8-GPU node, 90% of 25 GB/s per GPU. The sustained
// GEMM rate is the calibrated constant: the middle of the range of rates over which every timed figure is
// within 10%, which GemmRateRangeWithinTolerance recomputes (72.4% of the 312 TFLOP/s dense peak; pacer vet
// measured 71.0-72.7% for bf16 on H200s).
constexpr double kGemmTflops = 226.0;

Hardware a100() {
  Hardware hw;
  hw.peak_tflops = 312;
  hw.gemm_tflops = kGemmTflops;
  hw.hbm_gbps = 0.8 * 2039;
  hw.tp_gbps = 230;
  hw.dp_gbps = 0.9 * 25;
  return hw;
}

constexpr double kTolerancePct = 10;

// The rows the model misses by more than the tolerance, by their `model` cell, and why (docs/plan.md, "Validation").
// They stay in the table; a row leaves this list when the model gets it within 10%, and no other row may miss.
const std::map<std::string, std::string>& documented_misses() {
  static const std::map<std::string, std::string> misses = {
      {"405B 16384 GPUs 131K",
       "+13.4%: with the paper's all-gather of K and V the model is still faster; the layout needs 107 GiB a GPU in "
       "the model, so the authors ran something the paper does not state (recomputation, offloading, other sharding), "
       "and neither the metric's count of a causal attention at 131K tokens nor the attention kernel (cuDNN: +13.4%, "
       "FlashAttention-2: -14.8%) is stated either"},
  };
  return misses;
}

struct Comparison {
  int line = 0;
  std::string source, ref, model, metric, gpu;
  double published = 0, predicted = 0, error_pct = 0;
  double documented_error_pct = 0;  // what docs/plan.md reports, one decimal
  // What the prediction was made from (timed rows).
  Model shape;
  Parallel layout;
  Hardware hw;
  double gpu_memory_bytes = 0;  // of the GPU preset (0: the A100 papers' rows)
};

// Every row of published.csv against the model on `base` hardware (per-row gradient precision and DDP).
// published.csv, read once for every comparison.
const CsvTable& published() {
  static const CsvTable table = [] {
    auto t = read_csv(PACER_PLAN_DATA "/published.csv");
    EXPECT_TRUE(t) << t.error().message;
    return t ? *t : CsvTable{};
  }();
  return table;
}

std::vector<Comparison> compare(const Hardware& base) {
  std::vector<Comparison> out;
  const CsvTable& t = published();
  auto text = [&](const CsvRow& r, const char* col) {
    const int c = t.column(col);
    EXPECT_GE(c, 0) << col;
    return c >= 0 ? r.cells.at(c) : std::string();
  };
  auto number = [&](const CsvRow& r, const char* col) {
    const std::string cell = text(r, col);
    if (cell.empty()) return 0.0;
    auto v = t.number(r, t.column(col));
    EXPECT_TRUE(v) << v.error().message;
    return v ? *v : 0.0;
  };
  for (const auto& row : t.rows) {
    Comparison c;
    c.line = row.line;
    c.source = text(row, "source");
    c.ref = text(row, "ref");
    c.model = text(row, "model");
    c.metric = text(row, "metric");
    c.documented_error_pct = number(row, "documented_error_pct");
    Model m{int(number(row, "layers")), int(number(row, "hidden")), int(number(row, "heads")), int(number(row, "seq")),
            int(number(row, "vocab")), 0};
    if (const std::string preset = text(row, "preset"); !preset.empty()) {
      auto mp = find_model_preset(preset);
      EXPECT_TRUE(mp) << "line " << row.line << ": " << mp.error().message;
      if (!mp) continue;
      const Model given = m;
      m = mp->model;
      // What the row states of the model wins over the preset.
      for (auto [field, value] : {std::pair{&Model::layers, given.layers}, {&Model::hidden, given.hidden},
                                  {&Model::heads, given.heads}, {&Model::seq, given.seq}, {&Model::vocab, given.vocab},
                                  {&Model::kv_heads, int(number(row, "kv_heads"))},
                                  {&Model::vocab_multiple, int(number(row, "vocab_multiple"))}})
        if (value > 0) m.*field = value;
    }
    c.gpu = text(row, "gpu");
    Parallel p;
    p.tp = int(number(row, "tp"));
    p.pp = int(number(row, "pp"));
    p.dp = int(number(row, "dp"));
    p.micro_batch = int(number(row, "micro_batch"));
    p.global_batch = int(number(row, "global_batch"));
    p.interleave = int(number(row, "interleave"));
    const std::string rc = text(row, "recompute");
    p.recompute = rc == "full" ? Recompute::kFull : rc == "selective" ? Recompute::kSelective : Recompute::kNone;
    p.sequence_parallel = number(row, "sequence_parallel") != 0;
    if (number(row, "grad_bytes") > 0) p.grad_bytes = int(number(row, "grad_bytes"));
    if (number(row, "cp") > 0) p.cp = int(number(row, "cp"));
    p.uneven_stages = number(row, "uneven_stages") != 0;
    p.flash_attention = number(row, "flash_attention") != 0;
    p.tp_comm_overlap = number(row, "tp_overlap") != 0;
    const std::string cp_comm = text(row, "cp_comm");
    EXPECT_TRUE(cp_comm.empty() || cp_comm == "ring" || cp_comm == "allgather") << "line " << row.line;
    p.cp_comm = cp_comm == "allgather" ? CpComm::kAllGather : CpComm::kRing;
    Hardware hw = base;
    if (!c.gpu.empty()) {
      // A GPU preset: its generation's constants, not the A100's calibrated rate.
      auto gp = find_gpu_preset(c.gpu);
      EXPECT_TRUE(gp) << "line " << row.line << ": " << gp.error().message;
      if (!gp) continue;
      hw = gp->hw;
      c.gpu_memory_bytes = gp->memory_bytes;
      // A recipe that switches cuDNN's fused attention off (NVTE_FUSED_ATTN=0) runs FlashAttention-2, which is slower
      // on Hopper: the preset's rate is cuDNN's.
      const std::string attention = text(row, "attention");
      EXPECT_TRUE(attention.empty() || attention == "flash2") << "line " << row.line;
      if (attention == "flash2") {
        EXPECT_GT(gp->flash2_attention_tflops, 0) << "line " << row.line;
        hw.attention_tflops = gp->flash2_attention_tflops;
      }
      p.zero_stage = int(number(row, "zero"));
    }
    // PyTorch's DDP and a distributed optimizer's overlap_grad_sync reduce buckets during backward; Megatron's 2021
    // "local" DDP reduces after it.
    hw.overlap_dp = text(row, "ddp") == "torch" || text(row, "ddp") == "overlap";
    if (c.metric == "step_s" || c.metric == "hardware_tflops_per_gpu" || c.metric == "model_tflops_per_gpu") {
      auto s = estimate_step(m, p, hw);
      EXPECT_TRUE(s) << "line " << row.line << ": " << s.error().message;
      if (!s) continue;
      c.shape = m;
      c.layout = p;
      c.hw = hw;
      c.predicted = c.metric == "step_s" ? s->step_s
                    : c.metric == "hardware_tflops_per_gpu" ? s->hardware_tflops_per_gpu
                                                            : s->model_tflops_per_gpu;
    } else if (c.metric == "parameters_b") {
      c.predicted = parameter_count(m) / 1e9;
    } else if (c.metric == "model_state_gb") {
      const auto st = model_state_bytes(number(row, "params"), p.dp, int(number(row, "zero")), 2);  // fp16 gradients
      c.predicted = (st.weight_bytes + st.gradient_bytes + st.optimizer_bytes) / 1e9;
    } else {
      ADD_FAILURE() << "line " << row.line << ": unknown metric " << c.metric;
      continue;
    }
    c.published = number(row, "published");
    c.error_pct = 100 * (c.predicted / c.published - 1);
    out.push_back(c);
  }
  return out;
}

bool timed(const Comparison& c) {
  return c.metric == "step_s" || c.metric == "hardware_tflops_per_gpu" || c.metric == "model_tflops_per_gpu";
}
// The rows of the A100 papers, whose GEMM rate is the calibrated constant.
bool a100_timed(const Comparison& c) { return timed(c) && c.gpu.empty(); }

TEST(PlanValidation, PublishedFigures) {
  const auto rows = compare(a100());
  std::printf("A100 GEMM rate %.1f TFLOP/s (%.1f%% of peak)\n", a100().gemm_tflops, 100 * a100().gemm_tflops / 312);
  std::printf("%-16s %-9s %-14s %-24s %12s %12s %8s\n", "source", "ref", "model", "metric", "published", "pacer", "error");
  double sum_abs = 0, max_abs = 0;
  int timed_rows = 0;
  for (const auto& c : rows) {
    std::printf("%-16s %-9s %-14s %-24s %12.4g %12.4g %+7.1f%%\n", c.source.c_str(), c.ref.c_str(), c.model.c_str(),
                c.metric.c_str(), c.published, c.predicted, c.error_pct);
    // The model presets' parameter counts against the counts their sources state.
    if (c.source == "presets") {
      EXPECT_LE(std::fabs(c.error_pct), 0.5) << "line " << c.line << ": " << c.model;
    }
    if (a100_timed(c)) {
      sum_abs += std::fabs(c.error_pct);
      max_abs = std::max(max_abs, std::fabs(c.error_pct));
      ++timed_rows;
    }
    // The documentation moves with the model: a change that moves an error must update docs/plan.md and the
    // documented_error_pct column (the half-unit of its last decimal, plus rounding slack).
    EXPECT_NEAR(c.error_pct, c.documented_error_pct, 0.06) << "line " << c.line << ": " << c.model << " " << c.metric
                                                           << ": update docs/plan.md";
    // Within the tolerance, or a documented miss; a documented miss that is no longer one leaves the list.
    if (c.source != "presets") {
      const bool listed = documented_misses().count(c.model) > 0;
      if (listed) {
        EXPECT_GT(std::fabs(c.error_pct), kTolerancePct) << "line " << c.line << ": " << c.model << " is within "
                                                         << kTolerancePct << "% now: take it off documented_misses()";
      } else {
        EXPECT_LE(std::fabs(c.error_pct), kTolerancePct) << "line " << c.line << ": " << c.model << " " << c.metric;
      }
    }
  }
  std::printf("step time and throughput (A100 papers): %d figures, mean |error| %.1f%%, max %.1f%%\n", timed_rows,
              sum_abs / timed_rows, max_abs);
  for (const auto& [model, why] : documented_misses()) std::printf("documented miss: %s: %s\n", model.c_str(), why.c_str());
  EXPECT_EQ(rows.size(), 52u);
  EXPECT_EQ(timed_rows, 18);
  EXPECT_EQ(std::count_if(rows.begin(), rows.end(), [](const Comparison& c) { return timed(c) && !c.gpu.empty(); }), 13);
}

// The sustained GEMM rate is the calibrated constant (the network and memory efficiencies are assumed, not
// calibrated). docs/plan.md gives the range of rates over which every step time and throughput stays within
// 10%; this recomputes it in 0.5 TFLOP/s steps, checks that it is one interval, and that the rate used is its
// middle, so that the documented range and the constant move with the model.
TEST(PlanValidation, GemmRateRangeWithinTolerance) {
  constexpr double kDocumentedLow = 219.5, kDocumentedHigh = 232.5;  // docs/plan.md, "Validation"
  double low = 0, high = 0;
  bool left = false, split = false;
  for (double rate = 200; rate <= 260; rate += 0.5) {
    Hardware hw = a100();
    hw.gemm_tflops = rate;
    bool all_within = true;
    for (const auto& c : compare(hw))
      if (a100_timed(c) && std::fabs(c.error_pct) > kTolerancePct) all_within = false;
    if (all_within) {
      if (left) split = true;
      if (low == 0) low = rate;
      high = rate;
    } else if (low != 0) {
      left = true;
    }
  }
  std::printf("every step time and throughput within 10%% for GEMM rates %.1f-%.1f TFLOP/s (%.1f-%.1f%% of 312)\n", low,
              high, 100 * low / 312, 100 * high / 312);
  EXPECT_FALSE(split) << "the rates that pass are not one interval";
  EXPECT_GT(low, 200) << "the sweep starts inside the range: widen it";
  EXPECT_LT(high, 260) << "the sweep ends inside the range: widen it";
  EXPECT_DOUBLE_EQ(low, kDocumentedLow) << "update docs/plan.md";
  EXPECT_DOUBLE_EQ(high, kDocumentedHigh) << "update docs/plan.md";
  EXPECT_DOUBLE_EQ(a100().gemm_tflops, (low + high) / 2) << "use the middle of the range";
}

std::string layout_text(const Parallel& p) {
  const char* rc = p.recompute == Recompute::kNone ? "none" : p.recompute == Recompute::kSelective ? "sel" : "full";
  return "tp " + std::to_string(p.tp) + " pp " + std::to_string(p.pp) + " cp " + std::to_string(p.cp) + " dp " +
         std::to_string(p.dp) + " mb " + std::to_string(p.micro_batch) + " v " + std::to_string(p.interleave) + " " + rc +
         " zero " + std::to_string(p.zero_stage);
}

// `pacer plan search` for the model, GPU, GPU count, global batch and sequence of each H100 row, against the layout the
// authors ran (docs/plan.md, "The search against the authors' layouts", prints this table). The search space holds the
// authors' layout (their interleaving depth is added where the defaults lack it), so when that layout fits the GPU in
// the model, the best the search finds can be no slower.
TEST(PlanValidation, SearchAgainstTheAuthorsLayouts) {
  int searched = 0;
  std::printf("%-26s %-44s %9s %8s | %-44s %9s %8s %7s\n", "row", "authors' layout", "memory", "step", "search's best",
              "memory", "step", "gain");
  for (const auto& c : compare(a100())) {
    if (!timed(c) || c.gpu.empty()) continue;
    const Parallel& a = c.layout;
    SearchSpace space;
    space.gpus = a.tp * a.pp * a.cp * a.dp;
    space.global_batch = a.global_batch;
    space.memory_bytes = c.gpu_memory_bytes;
    space.margin_bytes = 0.1 * c.gpu_memory_bytes;  // the CLI's default margin
    space.top = 1;
    space.interleave = {1, 2, 3, 4, 5, 6, 8, 10};
    if (std::find(space.interleave.begin(), space.interleave.end(), a.interleave) == space.interleave.end())
      space.interleave.push_back(a.interleave);
    auto r = search_layouts(c.shape, a, c.hw, space);
    ASSERT_TRUE(r) << "line " << c.line << ": " << r.error().message;
    ASSERT_FALSE(r->top.empty()) << "line " << c.line << ": nothing fits";
    ++searched;
    const auto authors = *estimate_step(c.shape, a, c.hw);
    const double authors_memory = estimate_memory(c.shape, a).total_bytes;
    const Candidate& best = r->top[0];
    std::printf("%-26s %-44s %7.1f G %7.3gs | %-44s %7.1f G %7.3gs %+6.1f%%\n", c.model.c_str(), layout_text(a).c_str(),
                authors_memory / 1073741824.0, authors.step_s, layout_text(best.layout).c_str(),
                best.memory.total_bytes / 1073741824.0, best.step.step_s, 100 * (authors.step_s / best.step.step_s - 1));
    if (authors_memory <= space.memory_bytes - space.margin_bytes) {
      EXPECT_LE(best.step.step_s, authors.step_s * (1 + 1e-12)) << "line " << c.line << ": the search missed the authors' layout";
    }
  }
  EXPECT_EQ(searched, 13);
}

}  // namespace
}  // namespace pacer::plan
