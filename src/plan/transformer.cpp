// Transformer arithmetic: parameters, activation memory (Korthikanti et al. 2022), FLOPs (Narayanan et al.
// 2021), communication volumes and an analytical step-time model. Formulas are derived in docs/plan.md.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

Error usage(std::string m) { return Error{ErrorKind::kUsage, std::move(m)}; }

double ffn_of(const Model& m) { return m.ffn > 0 ? m.ffn : 4.0 * m.hidden; }
int microbatches_of(const Parallel& p) {
  const int global = p.global_batch > 0 ? p.global_batch : p.micro_batch * p.dp;
  return global / (p.micro_batch * p.dp);
}
int global_of(const Parallel& p) { return p.global_batch > 0 ? p.global_batch : p.micro_batch * p.dp; }

double layer_params(const Model& m) {
  const double h = m.hidden, f = ffn_of(m);
  // QKV and output projection with biases, two MLP matrices with biases, two layer norms.
  return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h;
}

// Matrix FLOPs of one layer's forward pass for one micro-batch on one GPU, split into the dense
// projections and the attention core (QK^T and attention over V).
struct LayerFlops {
  double dense = 0, attention = 0;
};
LayerFlops layer_forward_flops(const Model& m, const Parallel& p) {
  const double b = p.micro_batch, s = m.seq, h = m.hidden, f = ffn_of(m), t = p.tp;
  return {(2 * b * s * h * 3 * h + 2 * b * s * h * h + 4 * b * s * h * f) / t, 4 * b * s * s * h / t};
}

// Elements of the attention score matrices of one micro-batch on one GPU.
double attention_scores(const Model& m, const Parallel& p) {
  return double(m.heads) * m.seq * m.seq * p.micro_batch / p.tp;
}

// Forward-pass equivalents each part of a layer runs per micro-batch: forward 1, backward 2 (input and
// weight gradients), plus what recomputation repeats of the forward. A fused attention kernel's backward
// runs five GEMMs against the forward's two (the scores again, then dV, dP, dQ, dK): 2.5; Megatron-Core's
// selective recomputation checkpoints the core whatever its kernel, so it runs the fused forward once more.
// The fused kernel also skips the score blocks above the causal diagonal: of n = s/128 block rows it runs
// n(n+1)/2 of n^2 blocks.
struct Passes {
  double dense = 3, attention = 3;
  double attention_share = 1;  // of the 4bs^2h/t core FLOPs actually run
};
Passes passes_of(const Model& m, const Parallel& p) {
  Passes ps;
  const bool full = p.recompute == Recompute::kFull, selective = p.recompute == Recompute::kSelective;
  if (full) ps.dense = 4;
  ps.attention = (p.flash_attention ? 3.5 : 3) + (full || selective ? 1 : 0);
  if (p.flash_attention) {
    constexpr double kBlock = 128;
    ps.attention_share = std::min(1.0, 0.5 * (1 + kBlock / m.seq));
  }
  return ps;
}

// Bytes the memory-bound kernels of one layer's forward pass move on one GPU (reads plus writes):
// layer norms (2 per element each), bias-dropout-residual (3.5: two reads, one write, a 1-byte mask),
// fused scale-mask-softmax (2) and its dropout (2.5) over the attention scores, bias-GeLU (2). A fused
// attention kernel does its softmax and dropout inside, on scores that never reach memory.
struct LayerTraffic {
  double dense = 0, attention = 0;
};
LayerTraffic layer_forward_traffic(const Model& m, const Parallel& p) {
  const double b = p.micro_batch, s = m.seq, h = m.hidden, f = ffn_of(m), t = p.tp;
  const double n = b * s * h / (p.sequence_parallel ? t : 1);  // replicated unless sequence parallel
  const double scores = attention_scores(m, p);
  const double mlp = b * s * f / t;
  return {p.act_bytes * (11 * n + 2 * mlp), p.flash_attention ? 0 : p.act_bytes * 4.5 * scores};
}

// Everything the step and comm reports share, per GPU of the slowest pipeline stage.
struct Traffic {
  double tp_collectives_per_mb = 0;  // all-reduce equivalents per micro-batch over the stage's layers
  double tp_buffer_bytes = 0;        // size of each
  double pp_bytes_per_mb = 0;        // one direction, one boundary
  double dp_buffer_bytes = 0;        // gradients one GPU reduces
  double dp_factor = 1;              // 1.5 under ZeRO-3: weights are gathered again for backward
};
Traffic traffic(const Model& m, const Parallel& p) {
  Traffic tr;
  const double layers = double(m.layers) / p.pp;
  // Forward: two all-reduces (or all-gather + reduce-scatter pairs, the same volume with sequence
  // parallelism); backward two more; a full recomputation repeats the forward ones.
  double per_layer = 4 + (p.recompute == Recompute::kFull ? 2 : 0);
  // Sequence parallelism stores the QKV and MLP inputs sharded and all-gathers them again in backward
  // for the weight gradients (Korthikanti et al. 2022 §4.2.3): two all-gathers, one all-reduce's worth.
  if (p.sequence_parallel && p.recompute != Recompute::kFull) per_layer += 1;
  tr.tp_collectives_per_mb = p.tp > 1 ? per_layer * layers : 0;
  tr.tp_buffer_bytes = double(p.micro_batch) * m.seq * m.hidden * p.act_bytes;
  // Megatron scatters the boundary activation over the tensor-parallel ranks before sending it (with
  // sequence parallelism it is already split).
  tr.pp_bytes_per_mb = p.pp > 1 ? double(p.micro_batch) * m.seq * m.hidden * p.act_bytes / p.tp : 0;
  tr.dp_buffer_bytes = p.dp > 1 ? parameters_per_gpu(m, p) * p.grad_bytes : 0;
  tr.dp_factor = p.zero_stage >= 3 ? 1.5 : 1.0;
  return tr;
}

double pp_comm_time(const Traffic& tr, const Parallel& p, int microbatches, const Hardware& hw) {
  if (p.pp <= 1) return 0;
  // Each micro-batch crosses each of the device's chunk boundaries forward (activation) and back (gradient).
  // Without sequence parallelism every tensor-parallel rank holds the whole tensor: each sends a 1/t piece
  // and the receiving group all-gathers them over its own links. With it the tensor is already split by
  // sequence, and each rank sends and keeps its own part.
  double hop = hw.dp_latency_s + tr.pp_bytes_per_mb / (hw.dp_gbps * 1e9);
  if (!p.sequence_parallel) hop += allgather_time_s(tr.pp_bytes_per_mb * p.tp, p.tp, hw.tp_gbps, hw.tp_latency_s);
  return 2.0 * microbatches * p.interleave * hop;
}

}  // namespace

Status validate(const Model& m, const Parallel& p) {
  auto positive = [](int v, const char* name) -> Status {
    if (v < 1) return usage(fmt::format("{} {}: expected a positive number", name, v));
    return {};
  };
  for (auto [v, name] : {std::pair{m.layers, "--layers"}, {m.hidden, "--hidden"}, {m.heads, "--heads"}, {m.seq, "--seq"},
                         {m.vocab, "--vocab"}, {p.tp, "--tp"}, {p.pp, "--pp"}, {p.dp, "--dp"},
                         {p.micro_batch, "--micro-batch"}, {p.interleave, "--interleave"}})
    if (Status s = positive(v, name); !s) return s;
  if (m.ffn < 0) return usage(fmt::format("--ffn {}: expected a positive number", m.ffn));
  if (p.global_batch < 0) return usage(fmt::format("--global-batch {}: expected a positive number", p.global_batch));
  if (m.hidden % m.heads) return usage(fmt::format("--heads {} does not divide --hidden {}", m.heads, m.hidden));
  if (m.heads % p.tp) return usage(fmt::format("--tp {} does not divide --heads {}", p.tp, m.heads));
  if (int(ffn_of(m)) % p.tp) return usage(fmt::format("--tp {} does not divide the MLP width {}", p.tp, int(ffn_of(m))));
  if (p.pp * p.interleave > m.layers)
    return usage(fmt::format("--pp {} x --interleave {} is more stages than --layers {}", p.pp, p.interleave, m.layers));
  if (m.layers % (p.pp * p.interleave))
    return usage(fmt::format("--pp {} x --interleave {} does not divide --layers {}", p.pp, p.interleave, m.layers));
  if (p.interleave > 1 && p.pp == 1) return usage("--interleave needs --pp greater than 1");
  if (p.sequence_parallel && p.tp == 1) return usage("--sequence-parallel needs --tp greater than 1");
  if (p.sequence_parallel && m.seq % p.tp) return usage(fmt::format("--tp {} does not divide --seq {}", p.tp, m.seq));
  if (global_of(p) % (p.micro_batch * p.dp))
    return usage(fmt::format("--micro-batch {} x --dp {} does not divide --global-batch {}", p.micro_batch, p.dp, global_of(p)));
  if (p.interleave > 1 && microbatches_of(p) % p.pp)
    return usage(fmt::format("the interleaved schedule needs micro-batches per step ({}) to be a multiple of --pp {}",
                             microbatches_of(p), p.pp));
  if (p.flash_attention && p.act_bytes > 2)
    return usage("--flash-attention needs 16- or 8-bit activations (--precision bf16, fp16 or fp8)");
  if (p.zero_stage < 0 || p.zero_stage > 3) return usage(fmt::format("--zero {}: expected 0, 1, 2 or 3", p.zero_stage));
  if (p.act_bytes < 1 || p.grad_bytes < 1) return usage("precisions must be positive byte counts");
  return {};
}

double parameter_count(const Model& m) {
  const double h = m.hidden;
  return m.layers * layer_params(m) + (double(m.vocab) + m.seq) * h + 2 * h;
}

double parameters_per_gpu(const Model& m, const Parallel& p) {
  const double h = m.hidden;
  return double(m.layers) / p.pp * layer_params(m) / p.tp + double(m.vocab) * h / p.tp + double(m.seq) * h;
}

std::vector<ActivationTensor> layer_activations(const Model& m, const Parallel& p) {
  const double b = p.micro_batch, s = m.seq, h = m.hidden, f = ffn_of(m), t = p.tp, a = m.heads;
  const double sbh = s * b * h;
  const double rep = p.sequence_parallel ? t : 1;  // tensors outside the tensor-parallel regions
  if (p.recompute == Recompute::kFull) return {{"layer_input", 2 * sbh / rep}};
  std::vector<ActivationTensor> v = {
      {"ln1.input", 2 * sbh / rep},
      {"attn.qkv_input", 2 * sbh / rep},
      {"attn.q_k", 4 * sbh / t},
      {"attn.v", 2 * sbh / t},
      {"attn.proj_input", 2 * sbh / t},
      {"attn.dropout_mask", sbh / rep},
      {"ln2.input", 2 * sbh / rep},
      {"mlp.fc1_input", 2 * sbh / rep},
      {"mlp.gelu_input", 2 * s * b * f / t},
      {"mlp.fc2_input", 2 * s * b * f / t},
      {"mlp.dropout_mask", sbh / rep},
  };
  if (p.flash_attention) {
    // The fused kernel keeps one fp32 log-sum-exp per row of scores for its backward, nothing of size s^2;
    // under selective recomputation the core is re-run in backward and keeps not even that.
    if (p.recompute == Recompute::kNone) v.push_back({"attn.softmax_lse", 4 * a * s * b / t});
  } else if (p.recompute == Recompute::kNone) {
    // The attention core: what selective recomputation gives back.
    v.push_back({"attn.softmax_output", 2 * a * s * s * b / t});
    v.push_back({"attn.softmax_dropout_mask", a * s * s * b / t});
    v.push_back({"attn.softmax_dropout_output", 2 * a * s * s * b / t});
  }
  return v;
}

double layer_activation_bytes(const Model& m, const Parallel& p) {
  double sum = 0;
  for (const auto& t : layer_activations(m, p)) sum += t.bytes;
  return sum;
}

ModelStates model_state_bytes(double params, int dp, int zero_stage, int grad_bytes) {
  ModelStates st;
  st.weight_bytes = 2 * params / (zero_stage >= 3 ? dp : 1);
  st.gradient_bytes = grad_bytes * params / (zero_stage >= 2 ? dp : 1);
  st.optimizer_bytes = 12 * params / (zero_stage >= 1 ? dp : 1);
  return st;
}

MemoryReport estimate_memory(const Model& m, const Parallel& p) {
  MemoryReport r;
  r.parameters = parameters_per_gpu(m, p);
  // The gradients kept are the ones reduced: one precision for both, so memory and comm agree.
  const ModelStates st = model_state_bytes(r.parameters, p.dp, p.zero_stage, p.grad_bytes);
  r.weight_bytes = st.weight_bytes;
  r.gradient_bytes = st.gradient_bytes;
  r.optimizer_bytes = st.optimizer_bytes;
  r.activation_bytes_per_layer = layer_activation_bytes(m, p);
  const int mbs = microbatches_of(p);
  // 1F1B: the first stage runs p forwards before its first backward; interleaving adds (p-1)/(p v).
  double in_flight = std::min(mbs, p.pp);
  if (p.interleave > 1) in_flight *= 1 + double(p.pp - 1) / (double(p.pp) * p.interleave);
  r.in_flight_microbatches = in_flight;
  const double embedding_dropout_mask = double(m.seq) * p.micro_batch * m.hidden / (p.sequence_parallel ? p.tp : 1);
  r.activation_bytes = (r.activation_bytes_per_layer * m.layers / p.pp + embedding_dropout_mask) * in_flight;
  r.total_bytes = r.weight_bytes + r.gradient_bytes + r.optimizer_bytes + r.activation_bytes;
  return r;
}

FlopCount step_flops(const Model& m, const Parallel& p) {
  const double B = global_of(p), s = m.seq, h = m.hidden, f = ffn_of(m), l = m.layers, V = m.vocab;
  const double dense = 2 * s * h * 3 * h + 2 * s * h * h + 4 * s * h * f;  // per sequence per layer
  const double attention = 4 * s * s * h;
  const double logits = 2 * s * h * V;
  FlopCount c;
  // The papers' convention: the attention core counted whole, even where a causal mask makes half of it
  // unnecessary.
  c.model_flops = 3 * B * (l * (dense + attention) + logits);
  // What the GPUs execute: recomputation included, and only the blocks a fused kernel runs.
  const Passes ps = passes_of(m, p);
  c.hardware_flops = B * (l * (ps.dense * dense + ps.attention * ps.attention_share * attention) + 3 * logits);
  return c;
}

double allreduce_time_s(double bytes, int n, double gbps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) * latency_s + 2.0 * (n - 1) / n * bytes / (gbps * 1e9);
}

double allgather_time_s(double bytes, int n, double gbps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return (n - 1) * latency_s + double(n - 1) / n * bytes / (gbps * 1e9);
}

namespace {

Status check_hardware(const Model& m, const Parallel& p, const Hardware& hw, bool need_compute) {
  if (Status s = validate(m, p); !s) return s;
  if (need_compute && !(hw.gemm_tflops > 0)) return usage("--gemm-tflops: give the measured GEMM throughput (or --vet with gpu.gemm_bf16)");
  if (need_compute && !(hw.hbm_gbps > 0)) return usage("--hbm-gbps: give the device memory bandwidth (or --vet with gpu.hbm_bandwidth)");
  if (p.tp > 1 && !(hw.tp_gbps > 0)) return usage("--tp-gbps: give the tensor-parallel link bandwidth (or --vet with gpu.nccl_busbw)");
  if ((p.pp > 1 || p.dp > 1) && !(hw.dp_gbps > 0))
    return usage("--dp-gbps: give the network bandwidth per GPU (or --vet with network.busbw_gbps)");
  if (hw.peak_tflops < 0 || hw.tp_latency_s < 0 || hw.dp_latency_s < 0) return usage("peaks and latencies cannot be negative");
  if (hw.attention_tflops < 0) return usage("--attention-tflops cannot be negative");
  if (hw.attention_tflops > 0 && !p.flash_attention) return usage("--attention-tflops is the rate of --flash-attention's kernel");
  return {};
}

}  // namespace

Expected<CommReport> estimate_comm(const Model& m, const Parallel& p, const Hardware& hw) {
  if (Status s = check_hardware(m, p, hw, false); !s) return s.error();
  const Traffic tr = traffic(m, p);
  const int mbs = microbatches_of(p);
  CommReport r;
  r.tp_bytes = tr.tp_collectives_per_mb * mbs * 2.0 * (p.tp - 1) / p.tp * tr.tp_buffer_bytes;
  r.tp_time_s = tr.tp_collectives_per_mb * mbs * allreduce_time_s(tr.tp_buffer_bytes, p.tp, hw.tp_gbps, hw.tp_latency_s);
  r.pp_bytes = p.pp > 1 ? 2.0 * mbs * p.interleave * tr.pp_bytes_per_mb : 0;
  r.pp_time_s = pp_comm_time(tr, p, mbs, hw);
  r.dp_bytes = tr.dp_factor * 2.0 * (p.dp - 1) / p.dp * tr.dp_buffer_bytes;
  r.dp_time_s = tr.dp_factor * allreduce_time_s(tr.dp_buffer_bytes, p.dp, hw.dp_gbps, hw.dp_latency_s);
  const LayerFlops lf = layer_forward_flops(m, p);
  // Gradients are final only in the last micro-batch's backward: that is all the reduction can hide behind.
  // Backward with what recomputation repeats during it: everything but the forward pass.
  const Passes ps = passes_of(m, p);
  r.backward_flops =
      ((ps.dense - 1) * lf.dense + (ps.attention - 1) * ps.attention_share * lf.attention) * m.layers / p.pp;
  if (hw.gemm_tflops > 0) {
    r.dp_hide_flops = r.dp_time_s * hw.gemm_tflops * 1e12;
    const double backward_s = r.backward_flops / (hw.gemm_tflops * 1e12);
    r.dp_hidden_fraction = r.dp_time_s > 0 ? std::min(1.0, backward_s / r.dp_time_s) : 1.0;
  }
  return r;
}

Expected<StepReport> estimate_step(const Model& m, const Parallel& p, const Hardware& hw) {
  if (Status s = check_hardware(m, p, hw, true); !s) return s.error();
  const Traffic tr = traffic(m, p);
  const int mbs = microbatches_of(p);
  const double layers = double(m.layers) / p.pp;
  const double flop_rate = hw.gemm_tflops * 1e12, mem_rate = hw.hbm_gbps * 1e9;
  const LayerFlops lf = layer_forward_flops(m, p);
  const LayerTraffic lt = layer_forward_traffic(m, p);
  const Passes ps = passes_of(m, p);
  double attention_time = 0;
  if (p.flash_attention) {
    // Fused: compute-bound on the blocks it runs.
    const double attention_rate = hw.attention_tflops > 0 ? hw.attention_tflops * 1e12 : flop_rate;
    attention_time = ps.attention_share * lf.attention / attention_rate;
  } else {
    // Megatron's core is a batched GEMM per head whose inner dimension is the head size: it writes and
    // reads the as^2b scores, so below the device's FLOP/byte balance it runs at memory speed (roofline).
    const double attention_bytes =
        p.act_bytes * (2 * attention_scores(m, p) + 4 * double(p.micro_batch) * m.seq * m.hidden / p.tp);
    attention_time = std::max(lf.attention / flop_rate, attention_bytes / mem_rate);
  }
  const double layer_gemm = ps.dense * lf.dense / flop_rate + ps.attention * attention_time;
  const double layer_mem = (ps.dense * lt.dense + ps.attention * lt.attention) / mem_rate;
  // The output layer and the cross entropy over fp32 logits: the slowest stage is the last one.
  const double logits = double(p.micro_batch) * m.seq * m.vocab / p.tp;
  const double head_gemm = 3 * 2 * logits * m.hidden / flop_rate;
  const double head_mem = 2 * 3 * 4 * logits / mem_rate;
  const double tp_per_mb = tr.tp_collectives_per_mb * allreduce_time_s(tr.tp_buffer_bytes, p.tp, hw.tp_gbps, hw.tp_latency_s);

  StepReport r;
  r.microbatches = mbs;
  r.gemm_s = mbs * (layers * layer_gemm + head_gemm);
  r.elementwise_s = mbs * (layers * layer_mem + head_mem);
  r.tp_comm_s = mbs * tp_per_mb;
  const double per_mb = layers * (layer_gemm + layer_mem) + head_gemm + head_mem + tp_per_mb;
  r.bubble_s = double(p.pp - 1) / p.interleave * per_mb;
  r.pp_comm_s = pp_comm_time(tr, p, mbs, hw);
  double dp = tr.dp_factor * allreduce_time_s(tr.dp_buffer_bytes, p.dp, hw.dp_gbps, hw.dp_latency_s);
  // Gradients are complete only in the last micro-batch's backward, so that is all overlap can hide.
  if (hw.overlap_dp) {
    const double forward = lf.dense / flop_rate + attention_time + (lt.dense + lt.attention) / mem_rate;
    dp = std::max(0.0, dp - layers * (layer_gemm + layer_mem - forward));
  }
  r.dp_comm_s = dp;
  // Megatron's mixed-precision step over the GPU's optimizer shard, one kernel pass each: the gradient norm
  // for clipping reads the fp32 gradients (4 bytes per parameter); Adam reads the fp32 weight, momentum,
  // variance and gradient and writes the first three (28); the 16-bit weights are then copied from the fp32
  // ones (4 + 2). Gradients reduced in fewer than 32 bits are first copied into fp32 ones (read, then 4).
  const double shard = parameters_per_gpu(m, p) / (p.zero_stage >= 1 ? p.dp : 1);
  const double optimizer_bytes = 4 + 28 + 6 + (p.grad_bytes < 4 ? p.grad_bytes + 4 : 0);
  r.optimizer_s = optimizer_bytes * shard / mem_rate;
  r.step_s = r.gemm_s + r.elementwise_s + r.tp_comm_s + r.bubble_s + r.pp_comm_s + r.dp_comm_s + r.optimizer_s;
  const double gpus = double(p.tp) * p.pp * p.dp;
  const FlopCount fc = step_flops(m, p);
  r.tokens_per_s = double(global_of(p)) * m.seq / r.step_s;
  r.model_tflops_per_gpu = fc.model_flops / r.step_s / gpus / 1e12;
  r.hardware_tflops_per_gpu = fc.hardware_flops / r.step_s / gpus / 1e12;
  if (hw.peak_tflops > 0) {
    r.mfu = r.model_tflops_per_gpu / hw.peak_tflops;
    r.hfu = r.hardware_tflops_per_gpu / hw.peak_tflops;
  }
  return r;
}

}  // namespace pacer::plan
