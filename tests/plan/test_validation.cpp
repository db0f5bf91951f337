// pacer plan against published measurements (tests/plan/published.csv): each prediction within 10%, or
// exactly the miss docs/plan.md reports.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

// The A100 80GB SXM the papers ran on, from datasheets with stated efficiencies, fixed before comparing
// (docs/plan.md, "Validation"): 312 TFLOP/s dense bf16 peak, 80% of it in large GEMMs; 2039 GB/s HBM2e,
// 80% in streaming kernels; NVLink 3 all-reduce bus bandwidth 230 GB/s (nccl-tests on DGX A100);
// 8 x 200 Gb/s HDR InfiniBand per 8-GPU node, 90% of 25 GB/s per GPU.
Hardware a100() {
  Hardware hw;
  hw.peak_tflops = 312;
  hw.gemm_tflops = 0.8 * 312;
  hw.hbm_gbps = 0.8 * 2039;
  hw.tp_gbps = 230;
  hw.dp_gbps = 0.9 * 25;
  return hw;
}

constexpr double kTolerancePct = 10;

TEST(PlanValidation, PublishedFigures) {
  auto table = read_csv(PACER_PLAN_DATA "/published.csv");
  ASSERT_TRUE(table) << table.error().message;
  const auto& t = *table;
  auto text = [&](const CsvRow& r, const char* col) { return r.cells.at(t.column(col)); };
  auto number = [&](const CsvRow& r, const char* col) {
    const int c = t.column(col);
    EXPECT_GE(c, 0) << col;
    if (r.cells.at(c).empty()) return 0.0;
    auto v = t.number(r, c);
    EXPECT_TRUE(v) << v.error().message;
    return v ? *v : 0.0;
  };
  int checked = 0;
  std::printf("%-16s %-9s %-14s %-24s %12s %12s %8s\n", "source", "ref", "model", "metric", "published", "pacer", "error");
  for (const auto& row : t.rows) {
    const std::string metric = text(row, "metric");
    Model m{int(number(row, "layers")), int(number(row, "hidden")), int(number(row, "heads")), int(number(row, "seq")),
            int(number(row, "vocab")), 0};
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
    double predicted = 0;
    if (metric == "step_s" || metric == "hardware_tflops_per_gpu") {
      auto s = estimate_step(m, p, a100());
      ASSERT_TRUE(s) << "line " << row.line << ": " << s.error().message;
      predicted = metric == "step_s" ? s->step_s : s->hardware_tflops_per_gpu;
    } else if (metric == "parameters_b") {
      predicted = parameter_count(m) / 1e9;
    } else if (metric == "model_state_gb") {
      const auto st = model_state_bytes(number(row, "params"), p.dp, int(number(row, "zero")), 2);  // fp16 gradients
      predicted = (st.weight_bytes + st.gradient_bytes + st.optimizer_bytes) / 1e9;
    } else {
      FAIL() << "line " << row.line << ": unknown metric " << metric;
    }
    const double published = number(row, "published");
    const double err = 100 * (predicted / published - 1);
    std::printf("%-16s %-9s %-14s %-24s %12.4g %12.4g %+7.1f%%\n", text(row, "source").c_str(), text(row, "ref").c_str(),
                text(row, "model").c_str(), metric.c_str(), published, predicted, err);
    const std::string known = text(row, "known_error_pct");
    if (known.empty()) {
      EXPECT_LE(std::fabs(err), kTolerancePct) << "line " << row.line << ": " << text(row, "model") << " " << metric;
    } else {
      // A documented miss: the documentation must move with the model.
      EXPECT_GT(std::fabs(err), kTolerancePct) << "line " << row.line << ": now within 10%; clear known_error_pct";
      EXPECT_NEAR(err, number(row, "known_error_pct"), 0.3) << "line " << row.line << ": update docs/plan.md";
    }
    ++checked;
  }
  EXPECT_EQ(checked, 32);
}

}  // namespace
}  // namespace pacer::plan
