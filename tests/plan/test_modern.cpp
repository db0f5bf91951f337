// pacer plan for current models: grouped-query attention, SwiGLU, untied embeddings, RMSNorm, vocabulary
// padding, mixtures of experts and context parallelism (closed forms by hand), the presets, bad input, and the
// layout search.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "pacer/plan.hpp"
#include "test_util.hpp"

namespace pacer::plan {
namespace {

using test::contains;

Model llama8b() { return find_model_preset("llama3-8b")->model; }

// Round Hopper-like figures (one node of 8).
Hardware node() { return Hardware{.gemm_tflops = 700, .hbm_gbps = 4000, .tp_gbps = 300, .dp_gbps = 45}; }

TEST(PlanModern, LlamaParameterCountByHand) {
  const Model m = llama8b();
  const double h = 4096, kv = 8 * 128, f = 14336, V = 128256;
  // Q and output h x h, K and V h x 1024, gate/up/down h x f, two RMSNorm scales; untied embeddings; final norm.
  const double layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h;
  EXPECT_DOUBLE_EQ(parameter_count(m), 32 * layer + 2 * V * h + h);
  Model tied = m;
  tied.tied_embeddings = true;
  EXPECT_DOUBLE_EQ(parameter_count(m) - parameter_count(tied), V * h);
  Model mha = m;
  mha.kv_heads = 0;  // multi-head: K and V become h x h
  EXPECT_DOUBLE_EQ(parameter_count(mha) - parameter_count(m), 32 * 2 * h * (h - kv));
  Model padded = m;
  padded.vocab_multiple = 1024;  // 128256 -> 129024
  EXPECT_DOUBLE_EQ(padded_vocab(padded), 129024);
  EXPECT_DOUBLE_EQ(parameter_count(padded) - parameter_count(m), 2 * (129024 - V) * h);
}

TEST(PlanModern, GroupedQueryAttentionShrinksKeysAndValuesOnly) {
  Model m = llama8b();
  Parallel p;
  p.micro_batch = 1;
  p.flash_attention = true;
  const double s = m.seq, h = m.hidden;
  double qk = 0, v = 0;
  for (const auto& t : layer_activations(m, p)) {
    if (t.name == "attn.q_k") qk = t.bytes;
    if (t.name == "attn.v") v = t.bytes;
  }
  EXPECT_DOUBLE_EQ(qk, 2 * s * (h + 1024));
  EXPECT_DOUBLE_EQ(v, 2 * s * 1024);
  // SwiGLU keeps gate and up (4sbf) and the product (2sbf); no dropout masks in the Llama block.
  double mlp = 0;
  bool mask = false;
  for (const auto& t : layer_activations(m, p)) {
    if (t.name.rfind("mlp.", 0) == 0 && t.name != "mlp.fc1_input") mlp += t.bytes;
    if (t.name.find("dropout") != std::string::npos) mask = true;
  }
  EXPECT_DOUBLE_EQ(mlp, 6 * s * 14336);
  EXPECT_FALSE(mask);
}

TEST(PlanModern, FlopsCountSwigluAndGroupedQueryAttention) {
  const Model m = llama8b();
  Parallel p;
  p.global_batch = 1;
  const double s = m.seq, h = m.hidden, f = 14336, V = 128256, l = 32;
  const double dense = 2 * s * (2 * h * h + 2 * h * 1024 + 3 * h * f);
  EXPECT_NEAR(step_flops(m, p).model_flops, 3 * (l * (dense + 4 * s * s * h) + 2 * s * h * V), 1e3);
}

TEST(PlanModern, MixtureOfExpertsCountsExpertsAndTopK) {
  const Model m = find_model_preset("mixtral-8x7b")->model;
  const double h = 4096, f = 14336, expert = 3 * h * f;
  EXPECT_NEAR(parameter_count(m) - active_parameter_count(m), 32 * 6 * expert, 1);
  EXPECT_NEAR(active_parameter_count(m) / 1e9, 12.9, 0.05);  // Mistral AI: 12.9B per token
  Parallel p;
  p.dp = 8;
  p.global_batch = 8;
  p.ep = 8;
  // Each GPU holds one expert of each layer; the rest (attention, router, embeddings) whole.
  EXPECT_NEAR(expert_parameters_per_gpu(m, p), 32 * expert, 1);
  Parallel no_ep = p;
  no_ep.ep = 1;
  EXPECT_NEAR(parameters_per_gpu(m, no_ep) - parameters_per_gpu(m, p), 32 * 7 * expert, 1);
  // Model FLOPs route to top-2; a capacity factor pads the hardware FLOPs only.
  Model cf = m;
  cf.capacity_factor = 1.25;
  EXPECT_DOUBLE_EQ(step_flops(cf, p).model_flops, step_flops(m, p).model_flops);
  EXPECT_GT(step_flops(cf, p).hardware_flops, step_flops(m, p).hardware_flops);
  // All-to-all only with expert parallelism.
  const Hardware hw = node();
  const double tokens = 4096;
  auto c = estimate_comm(m, p, hw);
  ASSERT_TRUE(c) << c.error().message;
  // 4 all-to-alls per layer (dispatch and combine, forward and backward), 2 copies of each token, 7/8 sent away.
  EXPECT_NEAR(c->ep_bytes, 4 * 32 * tokens * 2 * h * 2 * 7.0 / 8, 1);
  EXPECT_EQ(estimate_comm(m, no_ep, hw)->ep_bytes, 0);
}

TEST(PlanModern, ContextParallelSplitsTheSequence) {
  Model m = llama8b();
  Parallel p;
  p.flash_attention = true;
  p.recompute = Recompute::kSelective;
  Parallel cp = p;
  cp.cp = 4;
  EXPECT_NEAR(layer_activation_bytes(m, cp), layer_activation_bytes(m, p) / 4, 1e-6 * layer_activation_bytes(m, p));
  const Hardware hw = node();
  auto c = estimate_comm(m, cp, hw);
  ASSERT_TRUE(c) << c.error().message;
  // K and V of 2048 tokens x 1024 wide in bf16 around the ring: 3 steps forward, twice 3 backward, 32 layers.
  EXPECT_NEAR(c->cp_bytes, 32 * 9 * 2 * 2048 * 1024 * 2.0, 1);
  // The gradients are reduced over dp x cp ranks, which hold the same weights.
  EXPECT_GT(c->dp_bytes, 0);
  auto s = estimate_step(m, cp, hw);
  ASSERT_TRUE(s) << s.error().message;
  auto s1 = estimate_step(m, p, hw);
  // A quarter of the tokens per GPU: a quarter of the matrix work on each.
  EXPECT_NEAR(s->gemm_s, s1->gemm_s / 4, 1e-9 * s1->gemm_s);
  // Within one node the ring's transfers hide behind the attention blocks; the gradient all-reduce over the
  // four context-parallel ranks is what makes the step longer than a quarter.
  EXPECT_EQ(s->cp_comm_s, 0);
  EXPECT_GT(s->dp_comm_s, 0);
}

// The Llama 3 way: K and V all-gathered before the attention and their gradients reduce-scattered after it, all of it
// on the critical path, and the other ranks' K and V kept for backward.
TEST(PlanModern, ContextParallelAllGatherIsExposedAndKept) {
  const Model m = llama8b();  // seq 8192, 8 KV heads of 128: K and V 1024 wide
  Parallel ring;
  ring.flash_attention = true;
  ring.cp = 4;
  Parallel ag = ring;
  ag.cp_comm = CpComm::kAllGather;
  const Hardware hw = node();
  const double kv = 2 * 2048 * 1024 * 2.0;  // this rank's K and V of 2048 tokens, bf16
  auto c = estimate_comm(m, ag, hw);
  ASSERT_TRUE(c) << c.error().message;
  // One all-gather and one reduce-scatter a layer, each sending this rank's K and V to the 3 others.
  EXPECT_NEAR(c->cp_bytes, 32 * 2 * 3 * kv, 1);
  const double gather = allgather_time_s(4 * kv, 4, hw.tp_gbps, hw.tp_latency_s);  // cp 4 fits in the node
  EXPECT_NEAR(c->cp_time_s, 32 * 2 * gather, 1e-12);
  auto s = estimate_step(m, ag, hw);
  auto sr = estimate_step(m, ring, hw);
  ASSERT_TRUE(s && sr);
  EXPECT_NEAR(s->cp_comm_s, 32 * 2 * gather, 1e-12);  // nothing hides it
  EXPECT_EQ(sr->cp_comm_s, 0);                        // the ring's steps hide behind the attention blocks
  EXPECT_NEAR(s->step_s - sr->step_s, s->cp_comm_s * (1 + double(ag.pp - 1) / ag.interleave), 1e-9);
  // The other three ranks' K and V, 6144 tokens, are kept for the backward attention.
  EXPECT_NEAR(layer_activation_bytes(m, ag) - layer_activation_bytes(m, ring), 2 * 2 * 6144 * 1024.0, 1e-3);
  // Under full recomputation nothing is kept and the forward gathers again.
  ag.recompute = ring.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, ag), layer_activation_bytes(m, ring));
  EXPECT_NEAR(estimate_comm(m, ag, hw)->cp_time_s, 32 * 3 * gather, 1e-12);
}

// Transformer Engine's overlap: each all-gather or reduce-scatter beside a GEMM shows one of its tp pieces when the GEMM
// is the longer, and all of itself when the GEMM takes no time.
TEST(PlanModern, TensorParallelOverlapShowsOnePieceOfEachCollective) {
  const Model m = llama8b();
  Parallel p;
  p.flash_attention = true;
  p.tp = 8;
  p.sequence_parallel = true;
  Parallel o = p;
  o.tp_comm_overlap = true;
  Hardware slow = node();
  slow.gemm_tflops = 1;  // every GEMM far longer than its collective
  EXPECT_NEAR(estimate_step(m, o, slow)->tp_comm_s, estimate_step(m, p, slow)->tp_comm_s / 8, 1e-12);
  Hardware fast = node();
  fast.gemm_tflops = 1e12;  // GEMMs that take no time hide nothing
  EXPECT_NEAR(estimate_step(m, o, fast)->tp_comm_s, estimate_step(m, p, fast)->tp_comm_s, 1e-9);
  // The comm report keeps the traffic before overlap.
  EXPECT_DOUBLE_EQ(estimate_comm(m, o, node())->tp_time_s, estimate_comm(m, p, node())->tp_time_s);
  Parallel no_sp = o;
  no_sp.sequence_parallel = false;
  Status v = validate(m, no_sp);
  ASSERT_FALSE(v);
  EXPECT_TRUE(contains(v.error().message, "--tp-overlap needs --sequence-parallel"));
}

TEST(PlanModern, BadInputNamesTheReason) {
  auto msg = [](Model m, Parallel p) {
    Status s = validate(m, p);
    EXPECT_FALSE(s);
    return s ? std::string() : s.error().message;
  };
  Model m = llama8b();
  Parallel p;
  Model bad = m;
  bad.heads = 30;  // does not divide 4096
  EXPECT_TRUE(contains(msg(bad, p), "--heads 30 does not divide --hidden 4096"));
  bad = m;
  bad.kv_heads = 5;
  EXPECT_TRUE(contains(msg(bad, p), "--kv-heads 5 does not divide --heads 32"));
  Parallel wide = p;
  wide.tp = 64;
  EXPECT_TRUE(contains(msg(m, wide), "--tp 64 is larger than --heads 32"));
  Model moe = find_model_preset("mixtral-8x7b")->model;
  Parallel ep = p;
  ep.dp = 3;
  ep.ep = 3;
  ep.global_batch = 3;
  EXPECT_TRUE(contains(msg(moe, ep), "--experts 8 is not divisible by --ep 3"));
  Parallel no_moe = p;
  no_moe.ep = 2;
  no_moe.dp = 2;
  EXPECT_TRUE(contains(msg(m, no_moe), "--ep needs --experts"));
  Parallel cp = p;
  cp.cp = 2;
  EXPECT_TRUE(contains(msg(m, cp), "--cp needs --flash-attention"));
  cp.flash_attention = true;
  Model odd = m;
  odd.seq = 8190;
  EXPECT_TRUE(contains(msg(odd, cp), "2 x cp equal chunks"));
  Model huge = m;
  huge.hidden = 1 << 30;  // 4 x hidden would not fit the int the widths are checked in
  huge.heads = 1;
  huge.kv_heads = 1;
  EXPECT_TRUE(contains(msg(huge, p), "--hidden 1073741824: too large"));
  Parallel deep = p;
  deep.pp = 1 << 16;
  deep.interleave = 1 << 16;
  EXPECT_TRUE(contains(msg(m, deep), "too large"));
  auto unknown = find_model_preset("llama9");
  ASSERT_FALSE(unknown);
  EXPECT_TRUE(contains(unknown.error().message, "llama3-70b"));
  EXPECT_EQ(unknown.error().kind, ErrorKind::kUsage);
  EXPECT_FALSE(find_gpu_preset("h300"));
}

TEST(PlanModern, UnevenStagesAreTimedByTheHeaviest) {
  const Model m = find_model_preset("llama3-405b")->model;  // 126 layers
  Parallel p;
  p.pp = 16;
  p.global_batch = 16;
  EXPECT_FALSE(validate(m, p));
  p.uneven_stages = true;
  EXPECT_TRUE(validate(m, p));
  EXPECT_DOUBLE_EQ(estimate_memory(m, p).stage_layers, 8);
  p.interleave = 4;  // 64 chunks of at most 2 layers
  EXPECT_DOUBLE_EQ(estimate_memory(m, p).stage_layers, 8);
}

TEST(PlanModern, PresetsHaveSourcesAndPositiveFigures) {
  for (const auto& p : model_presets()) {
    EXPECT_FALSE(p.source.empty()) << p.name;
    Parallel one;
    EXPECT_TRUE(validate(p.model, one)) << p.name;
  }
  for (const char* name : {"a100-80g", "h100-sxm", "h200", "gh200", "b200"}) {
    auto g = find_gpu_preset(name);
    ASSERT_TRUE(g) << name;
    EXPECT_FALSE(g->source.empty());
    EXPECT_GT(g->hw.gemm_tflops, 0);
    EXPECT_LT(g->hw.gemm_tflops, g->hw.peak_tflops);
    EXPECT_GT(g->memory_bytes, 50e9);
  }
  // One GEMM constant per generation: the Hopper parts share theirs.
  EXPECT_EQ(find_gpu_preset("h100-sxm")->hw.gemm_tflops, find_gpu_preset("gh200")->hw.gemm_tflops);
  EXPECT_EQ(find_gpu_preset("h200")->hw.gemm_tflops, find_gpu_preset("gh200")->hw.gemm_tflops);
}

SearchSpace space_for(int gpus, int batch, const GpuPreset& g) {
  SearchSpace s;
  s.gpus = gpus;
  s.global_batch = batch;
  s.memory_bytes = g.memory_bytes;
  s.margin_bytes = 0.1 * g.memory_bytes;
  s.top = 5;
  return s;
}

TEST(PlanSearch, BestIsFastestOfThoseThatFit) {
  const Model m = llama8b();
  const GpuPreset g = *find_gpu_preset("h200");
  Parallel base;
  base.flash_attention = true;
  const SearchSpace space = space_for(64, 256, g);
  auto r = search_layouts(m, base, g.hw, space);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->top.size(), 5u);
  EXPECT_GT(r->evaluated, r->fitting);
  for (std::size_t i = 0; i < r->top.size(); ++i) {
    const auto& c = r->top[i];
    EXPECT_EQ(c.layout.tp * c.layout.pp * c.layout.cp * c.layout.dp, 64);
    EXPECT_LE(c.memory.total_bytes, space.memory_bytes - space.margin_bytes);
    if (i > 0) {
      EXPECT_GE(c.step.step_s, r->top[i - 1].step.step_s);
      if (c.step.step_s > r->top[0].step.step_s) {
        EXPECT_FALSE(c.losses.empty()) << i;
      }
    }
    // Every reported layout is one estimate_step gives the same time for.
    auto again = estimate_step(m, c.layout, g.hw);
    ASSERT_TRUE(again);
    EXPECT_DOUBLE_EQ(again->step_s, c.step.step_s);
  }
  // Brute force over a fixed dimension agrees: nothing with tp 1 beats the best.
  SearchSpace tp1 = space;
  tp1.tp = {1};
  auto r1 = search_layouts(m, base, g.hw, tp1);
  ASSERT_TRUE(r1);
  if (!r1->top.empty()) {
    EXPECT_GE(r1->top[0].step.step_s, r->top[0].step.step_s);
  }
}

// The layout switches of the base (uneven stages, sequence parallelism) are the enumeration's to set: given, they do not
// make the search refuse the model.
TEST(PlanSearch, BaseLayoutSwitchesAreIgnored) {
  const GpuPreset g = *find_gpu_preset("h100-sxm");
  Parallel base;
  base.flash_attention = true;
  base.uneven_stages = true;
  base.sequence_parallel = true;
  auto r = search_layouts(find_model_preset("llama3-70b")->model, base, g.hw, space_for(64, 128, g));
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_FALSE(r->top.empty());
}

TEST(PlanSearch, NothingFitsAndBadSpaces) {
  const Model m = find_model_preset("llama3-405b")->model;
  GpuPreset g = *find_gpu_preset("a100-80g");
  Parallel base;
  base.flash_attention = true;
  auto r = search_layouts(m, base, g.hw, space_for(8, 8, g));  // 405B on one node
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(r->top.empty());
  EXPECT_GT(r->best_memory_bytes, g.memory_bytes);
  SearchSpace bad = space_for(0, 8, g);
  EXPECT_FALSE(search_layouts(m, base, g.hw, bad));
  bad = space_for(8, 8, g);
  bad.margin_bytes = bad.memory_bytes;
  EXPECT_FALSE(search_layouts(m, base, g.hw, bad));
  // A dimension fixed to a value no layout can take is refused with the reason, not reported as nothing fitting.
  SearchSpace ep3 = space_for(64, 128, g);
  ep3.ep = {3};
  auto e = search_layouts(find_model_preset("mixtral-8x7b")->model, base, g.hw, ep3);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(e.error().message, "--experts 8 is not divisible by --ep 3")) << e.error().message;
}

// The bound is 2 s for 4096 GPUs; this asserts 30 s, so that a loaded 2-core machine cannot flake it,
// and still catches a search that went exponential. The measured time is in bench/results/plan_search-*.json.
TEST(PlanSearch, FourThousandGpusIsQuick) {
  const Model m = find_model_preset("llama3-70b")->model;
  const GpuPreset g = *find_gpu_preset("h200");
  Parallel base;
  base.flash_attention = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = search_layouts(m, base, g.hw, space_for(4096, 2048, g));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_FALSE(r->top.empty());
  EXPECT_LT(s, 30.0);
}

}  // namespace
}  // namespace pacer::plan
