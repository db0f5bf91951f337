// pacer::comm without MPI: formulas, the fit, the tune model, bf16, and the reducer on one rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "pacer/comm.hpp"
#include "pacer/core/stats.hpp"

namespace pacer::comm {
namespace {

// core holds the one formula; comm bench, vet and hw all use it.
TEST(CommBusbw, FactorsAsNcclTests) {
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("all_reduce", 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("reduce_scatter", 4), 0.75);
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("all_gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("all_to_all", 2), 0.5);
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("broadcast", 16), 1.0);
  EXPECT_DOUBLE_EQ(*pacer::busbw_factor("all_reduce", 1), 0.0);
  EXPECT_FALSE(pacer::busbw_factor("allreduce", 2).has_value());
}

TEST(CommFit, RecoversAlphaBetaExactly) {
  std::vector<double> x, y;
  for (double b = 8; b <= (1 << 26); b *= 4) x.push_back(b), y.push_back(5e-6 + b / 20e9);
  auto f = fit_alpha_beta(x, y);
  ASSERT_TRUE(f.has_value());
  EXPECT_NEAR(f->alpha_s, 5e-6, 1e-12);
  EXPECT_NEAR(1.0 / f->beta_s_per_byte, 20e9, 1e3);
  EXPECT_NEAR(f->r2, 1.0, 1e-9);
  EXPECT_EQ(f->points, x.size());
}

TEST(CommFit, NoisyDataHasLowerR2AndNonNegativeAlpha) {
  // Superlinear times would give a negative intercept: constrained to 0.
  std::vector<double> x = {1e5, 1e6, 1e7}, y = {1e-5, 3e-4, 1e-2};
  auto f = fit_alpha_beta(x, y);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->alpha_s, 0.0);
  EXPECT_GT(f->beta_s_per_byte, 0.0);
  EXPECT_LT(f->r2, 0.99);
  EXPECT_FALSE(fit_alpha_beta({1e3, 1e3}, {1e-5, 2e-5}).has_value());
  EXPECT_FALSE(fit_alpha_beta({1e3}, {1e-5}).has_value());
}

TuneInput input(double elements, double backward_s) {
  TuneInput in;
  in.all_reduce.alpha_s = 1e-4;
  in.all_reduce.beta_s_per_byte = 1e-9;  // 1 GB/s
  in.elements = elements;
  in.dtype = DType::kF32;
  in.backward_s = backward_s;
  in.ranks = 8;
  return in;
}

TEST(CommTune, OneBucketExposesEverything) {
  const auto in = input(25e6, 0.5);  // 100 MB: 0.1 s + 100 us
  const auto s = simulate(in, 1e9, 1e9);
  EXPECT_EQ(s.buckets, 1u);
  EXPECT_NEAR(s.comm_s, 0.1001, 1e-9);
  EXPECT_NEAR(s.exposed_s, s.comm_s, 1e-12);
  EXPECT_NEAR(s.hidden_fraction, 0.0, 1e-12);
}

TEST(CommTune, EqualBucketsLeaveTheLastOneExposedWhenComputeDominates) {
  // 4 buckets of 25 MB, each ready every 0.125 s and taking 25.1 ms: only
  // the last, ready at the end of backward, is exposed.
  const auto in = input(25e6, 0.5);
  const auto s = simulate(in, 25e6, 25e6);
  EXPECT_EQ(s.buckets, 4u);
  EXPECT_NEAR(s.exposed_s, 1e-4 + 25e6 * 1e-9, 1e-9);
  // Communication-bound: buckets queue, exposed = total comm - what fits.
  const auto slow = simulate(input(25e6, 0.01), 25e6, 25e6);
  EXPECT_NEAR(slow.exposed_s, 0.0025 + 4 * 0.0251 - 0.01, 1e-9);
}

TEST(CommTune, RecommendsBucketsThatBeatOneMessageAndReportsFrameworkUnits) {
  const auto r = tune(input(1e9, 5.0));  // 4 GB of fp32 over 1 GB/s: 4 s comm, 5 s backward
  ASSERT_TRUE(r.has_value());
  EXPECT_NEAR(r->single_all_reduce_s, 4.0001, 1e-6);
  EXPECT_LT(r->best.exposed_s, 0.5);
  EXPECT_GT(r->best.hidden_fraction, 0.85);
  ASSERT_EQ(r->settings.size(), 3u);
  EXPECT_EQ(r->settings[0].option, "bucket_cap_mb");
  EXPECT_EQ(r->settings[0].default_value, 25);
  EXPECT_EQ(r->settings[1].option, "--ddp-bucket-size");
  EXPECT_EQ(r->settings[1].default_value, 40e6);
  // Elements, not bytes: the recommended bucket in bytes / 4.
  EXPECT_EQ(r->settings[2].recommended, std::round(r->best.bucket_bytes / 4));
  for (const auto& f : r->settings) EXPECT_LE(f.at_recommended.exposed_s, f.at_default.exposed_s + 1e-9);
  EXPECT_FALSE(tune(input(0, 1)).has_value());
}

TEST(CommTune, KeepsTheDefaultWhenItExposesNoMore) {
  // Backward far shorter than one message: one bucket is best, and DeepSpeed's
  // default (5e8 elements) is that same single bucket for a 25e6-element model.
  auto in = input(25e6, 1e-6);
  in.all_reduce.alpha_s = 1.0;  // per-message cost dominates: fewer buckets win
  const auto r = tune(in);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->best.buckets, 1u);
  const auto& ds = r->settings[2];
  EXPECT_EQ(ds.recommended, ds.default_value);
  EXPECT_EQ(ds.at_recommended.buckets, 1u);
  EXPECT_DOUBLE_EQ(ds.at_recommended.exposed_s, ds.at_default.exposed_s);
}

TEST(CommBf16, RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(from_bf16(0x3f80), 1.0f);
  EXPECT_EQ(from_bf16(to_bf16(3.0f)), 3.0f);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties go to even (1.0).
  EXPECT_EQ(from_bf16(to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(from_bf16(to_bf16(1.0f + 3.0f / 256)), 1.015625f);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::nanf("")))));
}

TEST(CommBench, JsonRoundTripAndSchemaCheck) {
  auto c = single_rank_collectives();
  BenchOptions o;
  o.min_bytes = 8;
  o.max_bytes = 4096;
  o.iters = 2;
  o.warmup = 0;
  auto r = run_bench(*c, o);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_TRUE(r->ok());
  ASSERT_EQ(r->collectives.size(), 5u);
  const auto j = to_json(*r);
  EXPECT_EQ(j["schema"], kBenchSchema);
  auto back = bench_from_json(j, "x.json");
  ASSERT_TRUE(back.has_value()) << back.error().message;
  EXPECT_EQ(back->collectives[0].points.size(), r->collectives[0].points.size());
  EXPECT_EQ(back->collectives[0].fit.beta_s_per_byte, r->collectives[0].fit.beta_s_per_byte);
  auto bad = bench_from_json(nlohmann::json{{"schema", "other/1"}}, "y.json");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("y.json"), std::string::npos);
}

TEST(CommReducer, FirstBucketIsSmallerAndLargeGradientsGetTheirOwn) {
  auto c = single_rank_collectives();
  ReducerOptions o;
  o.bucket_bytes = 400;        // 100 floats
  o.first_bucket_bytes = 40;   // 10 floats
  GradientReducer r(*c, o);
  for (std::size_t n : {4, 4, 4, 50, 60, 500, 10}) (void)r.add(n);
  ASSERT_TRUE(r.seal());
  const std::vector<std::pair<std::size_t, std::size_t>> want = {{0, 3}, {3, 5}, {5, 6}, {6, 7}};
  EXPECT_EQ(r.bucket_ranges(), want);
  EXPECT_EQ(r.total_count(), 632u);
  EXPECT_EQ(r.gradient(3) - r.flat(), 12);
}

TEST(CommReducer, RejectsMisuse) {
  auto c = single_rank_collectives();
  GradientReducer r(*c, ReducerOptions{});
  (void)r.add(3);
  (void)r.add(5);
  EXPECT_FALSE(r.mark_ready(0));  // before seal
  ASSERT_TRUE(r.seal());
  EXPECT_FALSE(r.add(1).has_value());
  EXPECT_FALSE(r.mark_ready(2));
  ASSERT_TRUE(r.mark_ready(0));
  EXPECT_FALSE(r.mark_ready(0));
  auto st = r.finish();
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("gradient 1"), std::string::npos);
}

TEST(CommReducer, TopKErrorFeedbackEventuallySendsEverything) {
  // One rank, a constant gradient 1..8, ratio 1/4: two components a step;
  // error feedback lets the small ones grow until they are sent too.
  auto c = single_rank_collectives();
  ReducerOptions o;
  o.compression = Compression::kTopK;
  o.top_k_ratio = 0.25;
  o.bucket_bytes = 1 << 20;
  GradientReducer r(*c, o);
  (void)r.add(8);
  ASSERT_TRUE(r.seal());
  std::vector<float> sent(8, 0.0f);
  const int steps = 16;
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < 8; ++i) r.gradient(0)[i] = float(i + 1);
    ASSERT_TRUE(r.mark_ready(0));
    ASSERT_TRUE(r.finish());
    int nonzero = 0;
    for (int i = 0; i < 8; ++i) sent[i] += r.flat()[i], nonzero += r.flat()[i] != 0.0f;
    EXPECT_EQ(nonzero, 2);
  }
  for (int i = 0; i < 8; ++i) {
    EXPECT_GT(sent[i], 0.0f) << "component " << i << " never sent";
    EXPECT_LE(sent[i], float(steps * (i + 1))) << "component " << i << " sent more than produced";
  }
  // Exactly what was accumulated when sent: 16 steps of 1..8 minus what is held back.
  EXPECT_EQ(sent[0], 14.0f);
  EXPECT_EQ(sent[7], 128.0f);
}

}  // namespace
}  // namespace pacer::comm
