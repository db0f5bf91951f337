// pacer plan memory, comm and step: closed forms and hand-computed cases, and impossible configurations.
#include <gtest/gtest.h>

#include <cmath>

#include "pacer/plan.hpp"
#include "test_util.hpp"

namespace pacer::plan {
namespace {

using test::contains;

// The 22B model of Korthikanti et al. 2022, Table 3.
Model gpt22b() { return Model{48, 6144, 64, 2048, 51200, 0}; }

Parallel tp8() {
  Parallel p;
  p.tp = 8;
  p.micro_batch = 4;
  return p;
}

TEST(PlanMemory, TensorInventoryMatchesKorthikantiTable2) {
  const Model m = gpt22b();
  const double s = m.seq, h = m.hidden, a = m.heads;
  for (int b : {1, 4}) {
    for (int t : {1, 2, 8}) {
      Parallel p;
      p.tp = t;
      p.micro_batch = b;
      const double sbh = s * b * h;
      // No parallelism: sbh (34 + 5as/h); tensor parallel: sbh (10 + 24/t + 5as/(ht)).
      EXPECT_NEAR(layer_activation_bytes(m, p), sbh * (10 + 24.0 / t + 5 * a * s / (h * t)), 1e-6 * sbh) << "t=" << t;
      p.recompute = Recompute::kSelective;
      EXPECT_NEAR(layer_activation_bytes(m, p), sbh * (10 + 24.0 / t), 1e-6 * sbh);
      p.recompute = Recompute::kFull;
      EXPECT_NEAR(layer_activation_bytes(m, p), 2 * sbh, 1e-6 * sbh);
      if (t == 1) continue;
      p.sequence_parallel = true;
      p.recompute = Recompute::kNone;
      EXPECT_NEAR(layer_activation_bytes(m, p), sbh / t * (34 + 5 * a * s / h), 1e-6 * sbh);
      p.recompute = Recompute::kSelective;
      EXPECT_NEAR(layer_activation_bytes(m, p), 34 * sbh / t, 1e-6 * sbh);
    }
  }
  Parallel none;
  none.micro_batch = 1;
  EXPECT_NEAR(layer_activation_bytes(m, none), s * h * (34 + 5 * a * s / h), 1e-3);
}

TEST(PlanMemory, ParameterCountClosedForm) {
  const Model m = gpt22b();
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  // 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)) plus the final layer norm.
  EXPECT_NEAR(parameter_count(m), 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)) + 2 * h, 1);
  Model wide = m;
  wide.ffn = 8 * m.hidden;  // MLP width doubles: 8 h^2 more per layer, plus the wider bias
  EXPECT_NEAR(parameter_count(wide) - parameter_count(m), l * (8 * h * h + 4 * h), 1);
}

TEST(PlanMemory, ZeroStagesShardTheModelStates) {
  // Rajbhandari et al. 2020: 16 bytes per parameter unsharded; stage 1 shards the 12 optimizer bytes, 2 the
  // gradients too, 3 everything.
  const double psi = 1e9;
  for (int z = 0; z <= 3; ++z) {
    const auto st = model_state_bytes(psi, 8, z, 2);
    EXPECT_DOUBLE_EQ(st.optimizer_bytes, 12 * psi / (z >= 1 ? 8 : 1));
    EXPECT_DOUBLE_EQ(st.gradient_bytes, 2 * psi / (z >= 2 ? 8 : 1));
    EXPECT_DOUBLE_EQ(st.weight_bytes, 2 * psi / (z >= 3 ? 8 : 1));
  }
}

// 4 layers, h 1024, 16 heads, s 1024, V 32000; micro-batch 2, tp 2, pp 2.
Model small() { return Model{4, 1024, 16, 1024, 32000, 0}; }
Parallel small_layout(int dp, int global_batch) {
  Parallel p;
  p.tp = 2;
  p.pp = 2;
  p.dp = dp;
  p.micro_batch = 2;
  p.global_batch = global_batch;
  return p;
}

TEST(PlanMemory, HandComputedSmallModel) {
  // 8 micro-batches, 1F1B.
  const Model m = small();
  Parallel p = small_layout(1, 16);
  const auto r = estimate_memory(m, p);
  const double layer = 12.0 * 1024 * 1024 + 13 * 1024;
  const double params = 2 * layer / 2 + 32000.0 * 1024 / 2 + 1024.0 * 1024;
  EXPECT_NEAR(r.parameters, params, 1e-6);
  // Megatron keeps fp32 main gradients by default: 2 + 4 + 12 bytes per parameter.
  EXPECT_NEAR(r.weight_bytes + r.gradient_bytes + r.optimizer_bytes, 18 * params, 1e-3);
  p.grad_bytes = 2;
  EXPECT_NEAR(estimate_memory(m, p).gradient_bytes, 2 * params, 1e-3);
  p.grad_bytes = 4;
  const double sbh = 1024.0 * 2 * 1024;
  const double per_layer = sbh * (10 + 24.0 / 2 + 5.0 * 16 * 1024 / (1024 * 2));
  EXPECT_NEAR(r.activation_bytes_per_layer, per_layer, 1e-3);
  EXPECT_DOUBLE_EQ(r.in_flight_microbatches, 2);  // the first of two stages holds two micro-batches
  EXPECT_NEAR(r.activation_bytes, (2 * per_layer + sbh) * 2, 1e-3);  // + the embedding dropout mask
  p.interleave = 2;
  EXPECT_DOUBLE_EQ(estimate_memory(m, p).in_flight_microbatches, 2 * (1 + 1.0 / 4));
}

TEST(PlanFlops, NarayananAndKorthikantiFormulas) {
  const Model m{128, 25600, 160, 2048, 51200, 0};  // the 1T model
  Parallel p;
  p.tp = 8;
  p.pp = 64;
  p.dp = 6;
  p.global_batch = 3072;
  const double B = 3072, s = 2048, l = 128, h = 25600, V = 51200;
  p.recompute = Recompute::kFull;
  const auto f = step_flops(m, p);
  EXPECT_NEAR(f.model_flops / (72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))), 1, 1e-12);
  EXPECT_NEAR(f.hardware_flops / (96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))), 1, 1e-12);
  p.recompute = Recompute::kSelective;
  EXPECT_NEAR(step_flops(m, p).hardware_flops - f.model_flops, B * l * 4 * s * s * h, 1e6);
}

TEST(PlanComm, RingCollectivesAndVolumes) {
  // 1 GB over 4 GPUs at 100 GB/s, 10 us per step: 2 x 3 x 10 us + 2 x 3/4 x 10 ms.
  EXPECT_NEAR(allreduce_time_s(1e9, 4, 100, 10e-6), 60e-6 + 15e-3, 1e-12);
  EXPECT_NEAR(allgather_time_s(1e9, 4, 100, 10e-6), 30e-6 + 7.5e-3, 1e-12);
  EXPECT_EQ(allreduce_time_s(1e9, 1, 100, 10e-6), 0);

  const Model m = small();
  Parallel p = small_layout(4, 64);  // 8 micro-batches per pipeline
  Hardware hw;
  hw.tp_gbps = 200;
  hw.dp_gbps = 20;
  hw.tp_latency_s = hw.dp_latency_s = 0;
  auto r = estimate_comm(m, p, hw);
  ASSERT_TRUE(r) << r.error().message;
  const double act = 2.0 * 1024 * 1024 * 2;  // b s h x 2 bytes
  EXPECT_NEAR(r->tp_bytes, 8 * 2 * 4 * 2.0 * 1 / 2 * act, 1e-3);  // 8 mbs x 2 layers x 4 all-reduces
  EXPECT_NEAR(r->tp_time_s, r->tp_bytes / 200e9, 1e-12);
  EXPECT_NEAR(r->pp_bytes, 2 * 8 * act / 2, 1e-3);                // scattered over tp
  EXPECT_NEAR(r->dp_bytes, 2.0 * 3 / 4 * parameters_per_gpu(m, p) * 4, 1e-3);  // fp32 gradients
  EXPECT_NEAR(r->dp_time_s, r->dp_bytes / 20e9, 1e-12);
  // What can hide the reduction: the backward of the last micro-batch (2 layers on this stage).
  hw.gemm_tflops = 100;
  auto h = estimate_comm(m, p, hw);
  const double fwd = (24.0 * 2 * 1024 * 1024 * 1024 + 4.0 * 2 * 1024 * 1024 * 1024) / 2;  // per layer, / tp
  EXPECT_NEAR(h->backward_flops, 2 * 2 * fwd, 1);
  EXPECT_NEAR(h->dp_hide_flops, h->dp_time_s * 100e12, 1);
  EXPECT_NEAR(h->dp_hidden_fraction, std::min(1.0, h->backward_flops / 100e12 / h->dp_time_s), 1e-12);
  EXPECT_LT(h->dp_hidden_fraction, 1);
  p.zero_stage = 3;
  EXPECT_NEAR(estimate_comm(m, p, hw)->dp_bytes, 1.5 * r->dp_bytes, 1e-3);
  p.zero_stage = 0;
  p.recompute = Recompute::kFull;
  EXPECT_NEAR(estimate_comm(m, p, hw)->tp_bytes, 1.5 * r->tp_bytes, 1e-3);  // the recomputed forward
}

// One GPU, two layers, two micro-batches of 4 sequences; 100 TFLOP/s and 1000 GB/s (a 100 FLOP/byte balance).
struct SingleGpu {
  Model m{2, 1024, 16, 512, 1000, 0};
  Parallel p;
  Hardware hw;
  SingleGpu() {
    p.micro_batch = 4;
    p.global_batch = 8;
    hw.gemm_tflops = 100;
    hw.hbm_gbps = 1000;
  }
};

TEST(PlanStep, SingleGpuHandComputed) {
  SingleGpu g;
  const Model& m = g.m;
  Parallel& p = g.p;
  Hardware& hw = g.hw;
  hw.peak_tflops = 200;
  auto r = estimate_step(m, p, hw);
  ASSERT_TRUE(r) << r.error().message;
  const double b = 4, s = 512, h = 1024, V = 1000, a = 16;
  const double dense = 24 * b * s * h * h;
  // The attention core (head size 64) is below the 100 FLOP/byte balance of this device: it runs at
  // memory speed, writing and reading the a s^2 b scores and reading and writing q, k, v and the context.
  const double attention_flops = 4 * b * s * s * h;
  const double attention_bytes = 2 * (2 * a * s * s * b + 4 * b * s * h);
  ASSERT_GT(attention_bytes / 1000e9, attention_flops / 100e12);
  EXPECT_EQ(r->microbatches, 2);
  EXPECT_NEAR(r->gemm_s, 2 * (2 * 3 * (dense / 100e12 + attention_bytes / 1000e9) + 3 * 2 * b * s * h * V / 100e12), 1e-15);
  EXPECT_EQ(r->tp_comm_s, 0);
  EXPECT_EQ(r->bubble_s, 0);
  EXPECT_EQ(r->dp_comm_s, 0);
  // Gradient norm 4, Adam 28, 16-bit weights from fp32 ones 6 bytes per parameter.
  EXPECT_NEAR(r->optimizer_s, 38 * parameters_per_gpu(m, p) / 1000e9, 1e-15);
  // Gradients reduced in 16 bits are copied into fp32 ones first.
  p.grad_bytes = 2;
  EXPECT_NEAR(estimate_step(m, p, hw)->optimizer_s, 44 * parameters_per_gpu(m, p) / 1000e9, 1e-15);
  p.grad_bytes = 4;
  // With memory 100 times faster the attention core is compute-bound again: FLOPs over the GEMM rate.
  hw.hbm_gbps = 100e3;
  EXPECT_NEAR(estimate_step(m, p, hw)->gemm_s,
              2 * (2 * 3 * (dense + attention_flops) + 3 * 2 * b * s * h * V) / 100e12, 1e-15);
  hw.hbm_gbps = 1000;
  EXPECT_NEAR(r->step_s, r->gemm_s + r->elementwise_s + r->optimizer_s, 1e-15);
  EXPECT_NEAR(r->mfu, step_flops(m, p).model_flops / r->step_s / 200e12, 1e-12);
  EXPECT_LT(r->mfu, 0.5);  // cannot beat gemm_tflops / peak
}

TEST(PlanStep, PipelineBubbleAndRecomputation) {
  const Model m{8, 1024, 16, 512, 1000, 0};
  Parallel p;
  p.pp = 4;
  p.global_batch = 8;
  Hardware hw;
  hw.gemm_tflops = 100;
  hw.hbm_gbps = 1000;
  hw.dp_gbps = 10;
  auto r = estimate_step(m, p, hw);
  ASSERT_TRUE(r);
  // (P - 1) / M of the compute: 3/8.
  EXPECT_NEAR(r->bubble_s, 3.0 / 8 * (r->gemm_s + r->elementwise_s), 1e-12);
  p.interleave = 2;
  EXPECT_NEAR(estimate_step(m, p, hw)->bubble_s, r->bubble_s / 2, 1e-12);
  p.interleave = 1;
  p.recompute = Recompute::kFull;
  EXPECT_GT(estimate_step(m, p, hw)->gemm_s, r->gemm_s * 1.25);
}

TEST(PlanStep, PipelineSendsScatterThenGather) {
  const Model m{8, 1024, 16, 512, 1000, 0};
  Parallel p;
  p.tp = 4;
  p.pp = 2;
  p.interleave = 2;
  p.micro_batch = 2;
  p.global_batch = 8;  // 4 micro-batches
  Hardware hw;
  hw.gemm_tflops = 100;
  hw.hbm_gbps = 1000;
  hw.tp_gbps = 200;
  hw.dp_gbps = 20;
  auto r = estimate_step(m, p, hw);
  ASSERT_TRUE(r) << r.error().message;
  // Per micro-batch and chunk, an activation forward and a gradient back; each goes over the network as
  // t pieces of b s h / t (10 us + bytes / 20 GB/s), then the receiving group all-gathers it (3 x 5 us + 3/4 x
  // b s h / 200 GB/s).
  const double act = 2.0 * 512 * 1024 * 2;
  const double hop = 10e-6 + act / 4 / 20e9 + 3 * 5e-6 + 0.75 * act / 200e9;
  EXPECT_NEAR(r->pp_comm_s, 2 * 4 * 2 * hop, 1e-12);
  // Sequence parallelism: each rank already holds its 1/t of the sequence; nothing to gather.
  p.sequence_parallel = true;
  EXPECT_NEAR(estimate_step(m, p, hw)->pp_comm_s, 2 * 4 * 2 * (10e-6 + act / 4 / 20e9), 1e-12);
}

TEST(PlanStep, AttentionCoreBytesAreSplitByTensorParallelism) {
  // Head size 64, memory-bound: the attention core's time is its bytes over HBM bandwidth, and every term
  // (scores and q, k, v, context) is divided by t. Sixteen heads over t = 4: four per GPU.
  const Model m{1, 1024, 16, 512, 1000, 0};
  Parallel p;
  p.tp = 4;
  p.micro_batch = 2;
  Hardware hw;
  hw.gemm_tflops = 100;
  hw.hbm_gbps = 1000;
  hw.tp_gbps = 200;
  auto r = estimate_step(m, p, hw);
  ASSERT_TRUE(r) << r.error().message;
  const double b = 2, s = 512, h = 1024, V = 1000, a = 16, t = 4;
  const double dense = 24 * b * s * h * h / t;
  const double attention_bytes = 2 * (2 * a * s * s * b / t + 4 * b * s * h / t);
  ASSERT_GT(attention_bytes / 1000e9, 4 * b * s * s * h / t / 100e12);
  EXPECT_NEAR(r->gemm_s, 3 * (dense / 100e12 + attention_bytes / 1000e9) + 3 * 2 * b * s * h * V / t / 100e12, 1e-15);
}

TEST(PlanStep, FusedAttention) {
  SingleGpu g;
  const Model& m = g.m;
  Parallel& p = g.p;
  Hardware& hw = g.hw;
  auto unfused = estimate_step(m, p, hw);
  p.flash_attention = true;
  auto fused = estimate_step(m, p, hw);
  ASSERT_TRUE(unfused && fused);
  const double b = 4, s = 512, h = 1024, V = 1000, a = 16;
  const double dense = 24 * b * s * h * h, head = 3 * 2 * b * s * h * V;
  // Causal: of the 4 s/128 = 4 block rows the kernel runs 4 x 5 / 2 = 10 of 16 blocks. Forward 1 pass,
  // backward 2.5 (five GEMMs against the forward's two).
  const double attention = 10.0 / 16 * 4 * b * s * s * h;
  EXPECT_NEAR(fused->gemm_s, 2 * (2 * (3 * dense + 3.5 * attention) + head) / 100e12, 1e-15);
  // Softmax and dropout over the scores run inside the kernel: 4.5 two-byte passes per score, 3 passes.
  EXPECT_NEAR(unfused->elementwise_s - fused->elementwise_s, 2 * 2 * 3 * (2 * 4.5 * a * s * s * b) / 1000e9, 1e-15);
  // Compute-bound whatever the memory: a slower HBM changes only the memory-bound kernels.
  hw.hbm_gbps = 10;
  EXPECT_NEAR(estimate_step(m, p, hw)->gemm_s, fused->gemm_s, 1e-15);
  hw.hbm_gbps = 1000;
  // A measured kernel rate replaces the GEMM rate for the core alone.
  hw.attention_tflops = 40;
  EXPECT_NEAR(estimate_step(m, p, hw)->gemm_s, 2 * (2 * (3 * dense / 100e12 + 3.5 * attention / 40e12) + head / 100e12), 1e-15);
  hw.attention_tflops = 0;
  // Selective recomputation (Megatron-Core checkpoints the core whatever its kernel) runs the fused forward
  // once more; full recomputation repeats the whole forward.
  p.recompute = Recompute::kSelective;
  EXPECT_NEAR(estimate_step(m, p, hw)->gemm_s, 2 * (2 * (3 * dense + 4.5 * attention) + head) / 100e12, 1e-15);
  p.recompute = Recompute::kFull;
  EXPECT_NEAR(estimate_step(m, p, hw)->gemm_s, 2 * (2 * (4 * dense + 4.5 * attention) + head) / 100e12, 1e-15);
  // Model FLOPs keep the papers' convention (the whole core, forward and backward); hardware FLOPs are what
  // runs: for 8 sequences and 2 layers, full recomputation's extra dense forward and 4.5 passes over 10/16
  // of the core.
  const FlopCount f = step_flops(m, p);
  const double core = 4.0 * s * s * h, dense_seq = 24.0 * s * h * h;
  EXPECT_NEAR(f.model_flops, 8 * (2 * 3 * (dense_seq + core) + 3 * 2 * s * h * V), 1e3);
  EXPECT_NEAR(f.hardware_flops, 8 * (2 * (4 * dense_seq + 4.5 * 10.0 / 16 * core) + 3 * 2 * s * h * V), 1e3);
  p.recompute = Recompute::kNone;
  EXPECT_NEAR(step_flops(m, p).hardware_flops, 8 * (2 * (3 * dense_seq + 3.5 * 10.0 / 16 * core) + 3 * 2 * s * h * V), 1e3);
}

TEST(PlanMemory, FusedAttentionStoresNoScores) {
  const Model m = gpt22b();
  Parallel p = tp8();
  p.flash_attention = true;
  double lse = 0, scores = 0;
  for (const auto& t : layer_activations(m, p)) {
    if (t.name == "attn.softmax_lse") lse = t.bytes;
    if (t.name.rfind("attn.softmax_", 0) == 0 && t.name != "attn.softmax_lse") scores += t.bytes;
  }
  EXPECT_EQ(scores, 0);
  EXPECT_DOUBLE_EQ(lse, 4.0 * 64 * 2048 * p.micro_batch / 8);  // fp32 per row of scores
  // Otherwise what selective recomputation keeps; with it, the re-run core keeps not even the log-sum-exp.
  Parallel sel = tp8();
  sel.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, p), layer_activation_bytes(m, sel) + lse);
  sel.flash_attention = true;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, sel), layer_activation_bytes(m, p) - lse);
  p.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, p), 2.0 * 2048 * p.micro_batch * 6144);  // the layer input only
}

TEST(PlanConfig, ImpossibleConfigurations) {
  const Model m = gpt22b();
  auto msg = [&](Parallel p, Model mm) { return validate(mm, p).error().message; };
  Parallel p = tp8();
  EXPECT_TRUE(validate(m, p));
  p.tp = 7;
  EXPECT_TRUE(contains(msg(p, m), "--tp 7 does not divide --heads 64"));
  p = tp8();
  p.pp = 96;
  EXPECT_TRUE(contains(msg(p, m), "more stages than --layers"));
  p.pp = 5;
  EXPECT_TRUE(contains(msg(p, m), "does not divide --layers 48"));
  p = tp8();
  p.dp = 3;
  p.global_batch = 16;
  EXPECT_TRUE(contains(msg(p, m), "does not divide --global-batch 16"));
  p = tp8();
  p.zero_stage = 4;
  EXPECT_TRUE(contains(msg(p, m), "--zero 4"));
  p = tp8();
  p.tp = 1;
  p.sequence_parallel = true;
  EXPECT_TRUE(contains(msg(p, m), "--sequence-parallel"));
  p = tp8();
  p.micro_batch = 0;
  EXPECT_TRUE(contains(msg(p, m), "--micro-batch 0"));
  Model neg = m;
  neg.hidden = -6144;
  EXPECT_TRUE(contains(msg(tp8(), neg), "--hidden"));
  p = tp8();
  p.pp = 2;
  p.interleave = 2;
  p.global_batch = 12;  // 3 micro-batches: not a multiple of pp for the interleaved schedule
  EXPECT_TRUE(contains(msg(p, m), "multiple of --pp"));
  p = tp8();
  p.flash_attention = true;
  p.act_bytes = 4;
  EXPECT_TRUE(contains(msg(p, m), "--flash-attention needs 16- or 8-bit activations"));
  Hardware none;
  auto step = estimate_step(m, tp8(), none);
  ASSERT_FALSE(step);
  EXPECT_TRUE(contains(step.error().message, "--gemm-tflops"));
  EXPECT_EQ(step.error().kind, ErrorKind::kUsage);
  Hardware compute;
  compute.gemm_tflops = 100;
  compute.hbm_gbps = 1000;
  compute.attention_tflops = 50;
  auto unfused = estimate_step(m, Parallel{}, compute);
  ASSERT_FALSE(unfused);
  EXPECT_TRUE(contains(unfused.error().message, "--attention-tflops is the rate of --flash-attention's kernel"));
  compute.attention_tflops = 0;
  EXPECT_TRUE(contains(estimate_step(m, tp8(), compute).error().message, "--tp-gbps"));
}

}  // namespace
}  // namespace pacer::plan
