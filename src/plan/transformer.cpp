// Transformer arithmetic: parameters, activation memory (Korthikanti et al. 2022), FLOPs (Narayanan et al.
// 2021), communication volumes and an analytical step-time model. Formulas are derived in docs/plan.md.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

Error usage(std::string m) { return Error{ErrorKind::kUsage, std::move(m)}; }

double ffn_of(const Model& m) { return m.ffn > 0 ? m.ffn : 4.0 * m.hidden; }
double expert_ffn_of(const Model& m) { return m.expert_ffn > 0 ? m.expert_ffn : ffn_of(m); }
int microbatches_of(const Parallel& p) {
  const int global = p.global_batch > 0 ? p.global_batch : p.micro_batch * p.dp;
  return global / (p.micro_batch * p.dp);
}
int global_of(const Parallel& p) { return p.global_batch > 0 ? p.global_batch : p.micro_batch * p.dp; }

bool is_moe(const Model& m) { return m.experts > 0; }
// Layers on the most loaded pipeline stage. Uneven stages (Llama 3: one layer fewer on the first and the
// last, which also hold the embedding and the output layer) give every chunk ceil(l / (p v)) layers at most.
double stage_layers(const Model& m, const Parallel& p) {
  if (!p.uneven_stages) return double(m.layers) / p.pp;
  const long chunks = long(p.pp) * p.interleave;
  return double((m.layers + chunks - 1) / chunks * p.interleave);
}
int kv_heads_of(const Model& m) { return m.kv_heads > 0 ? m.kv_heads : m.heads; }
double head_dim(const Model& m) { return double(m.hidden) / m.heads; }
// Width of K (and of V) on one GPU times tp: with fewer kv-heads than tp ranks each rank keeps a copy of one.
double kv_width_sharded(const Model& m, int tp) { return std::max(kv_heads_of(m), tp) * head_dim(m); }
// Tokens of one sequence on one GPU: context parallelism splits the sequence.
double local_seq(const Model& m, const Parallel& p) { return double(m.seq) / p.cp; }
// Layers with an MoE MLP and layers with a dense one.
double moe_layers(const Model& m) { return is_moe(m) ? m.layers - m.dense_layers : 0; }
double dense_layers(const Model& m) { return m.layers - moe_layers(m); }
// Expert slots each token fills in the GEMMs: top_k, padded by the capacity factor when tokens are dropped.
double routed_slots(const Model& m, bool hardware) {
  return m.top_k * (hardware && m.capacity_factor > 0 ? m.capacity_factor : 1.0);
}

// Weights of one MLP of width f (gate, up and down for SwiGLU; up and down otherwise), with its biases.
double mlp_params(const Model& m, double f) {
  const double h = m.hidden;
  return (m.gated_mlp ? 3 : 2) * h * f + (m.biases ? (m.gated_mlp ? 2 : 1) * f + h : 0);
}
double mlp_matrix_params(const Model& m, double f) { return (m.gated_mlp ? 3 : 2) * double(m.hidden) * f; }
// Attention projections (Q and output h x h, K and V h x kv-width) with biases, and the layer's two norms.
double attention_params(const Model& m) {
  const double h = m.hidden, kv = kv_heads_of(m) * head_dim(m);
  return 2 * h * h + 2 * h * kv + (m.biases ? 2 * h + 2 * kv : 0) + 2 * (m.rms_norm ? 1 : 2) * h;
}
double attention_matrix_params(const Model& m, int tp) {
  const double h = m.hidden;
  return 2 * h * h + 2 * h * kv_width_sharded(m, tp);
}
double expert_params(const Model& m) { return m.experts * mlp_params(m, expert_ffn_of(m)); }
// Parameters of one layer outside the routed experts: attention, norms, the dense MLP or router and shared experts.
double layer_dense_params(const Model& m, bool moe_layer) {
  if (!moe_layer) return attention_params(m) + mlp_params(m, ffn_of(m));
  return attention_params(m) + double(m.hidden) * m.experts + m.shared_experts * mlp_params(m, expert_ffn_of(m));
}
double embedding_params(const Model& m) {
  const double h = m.hidden;
  return padded_vocab(m) * h * (m.tied_embeddings ? 1 : 2) + (m.learned_positions ? double(m.seq) * h : 0);
}

// Matrix FLOPs of one layer's forward pass for one micro-batch on one GPU, split into the dense
// projections and the attention core (QK^T and attention over V), averaged over dense and MoE layers.
struct LayerFlops {
  double dense = 0, attention = 0;
};
// Matrix weights one token multiplies in a layer of each kind, per tp rank times tp.
double token_matrix_params(const Model& m, int tp, bool moe_layer, bool hardware) {
  const double attn = attention_matrix_params(m, tp);
  if (!moe_layer) return attn + mlp_matrix_params(m, ffn_of(m));
  return attn + double(m.hidden) * m.experts +
         (routed_slots(m, hardware) + m.shared_experts) * mlp_matrix_params(m, expert_ffn_of(m));
}
double mean_token_matrix_params(const Model& m, int tp, bool hardware) {
  return (dense_layers(m) * token_matrix_params(m, tp, false, hardware) +
          moe_layers(m) * token_matrix_params(m, tp, true, hardware)) / m.layers;
}
LayerFlops layer_forward_flops(const Model& m, const Parallel& p) {
  const double b = p.micro_batch, sl = local_seq(m, p), s = m.seq, h = m.hidden, t = p.tp;
  // Each context-parallel rank has s/cp queries against the causal keys of the whole sequence: 1/cp of the core.
  return {2 * b * sl * mean_token_matrix_params(m, p.tp, true) / t, 4 * b * sl * s * h / t};
}

// Elements of the attention score matrices of one micro-batch on one GPU.
double attention_scores(const Model& m, const Parallel& p) {
  return double(m.heads) * local_seq(m, p) * m.seq * p.micro_batch / p.tp;
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
// fused scale-mask-softmax (2) and its dropout (2.5) over the attention scores, bias-GeLU (2; SwiGLU reads
// two inputs: 3). An MoE layer also permutes its tokens to the experts and back (a read and a write each way).
// A fused attention kernel does its softmax and dropout inside, on scores that never reach memory.
struct LayerTraffic {
  double dense = 0, attention = 0;
};
LayerTraffic layer_forward_traffic(const Model& m, const Parallel& p) {
  const double b = p.micro_batch, sl = local_seq(m, p), h = m.hidden, t = p.tp;
  const double n = b * sl * h / (p.sequence_parallel ? t : 1);  // replicated unless sequence parallel
  const double scores = attention_scores(m, p);
  const double act = m.gated_mlp ? 1.5 : 1.0;
  const double dense_mlp = b * sl * ffn_of(m) * act / t;
  const double moe_mlp = b * sl * expert_ffn_of(m) * act * (routed_slots(m, true) + m.shared_experts) / t +
                         2 * routed_slots(m, true) * n;  // permute and unpermute
  const double mlp = (dense_layers(m) * dense_mlp + moe_layers(m) * moe_mlp) / m.layers;
  return {p.act_bytes * (11 * n + 2 * mlp), p.flash_attention ? 0 : p.act_bytes * 4.5 * scores};
}

// Everything the step and comm reports share, per GPU of the slowest pipeline stage.
struct Traffic {
  double tp_collectives_per_mb = 0;  // all-reduce equivalents per micro-batch over the stage's layers
  double tp_buffer_bytes = 0;        // size of each
  double pp_bytes_per_mb = 0;        // one direction, one boundary
  double dp_dense_bytes = 0;         // gradients one GPU reduces over dp * cp ranks
  double dp_expert_bytes = 0;        // expert gradients, reduced over dp * cp / ep ranks
  double dp_factor = 1;              // 1.5 under ZeRO-3: weights are gathered again for backward
  double cp_kv_bytes = 0;            // this rank's keys and values: one ring step, or its share of an all-gather
  double cp_steps_per_mb = 0;        // ring steps per micro-batch over the stage's layers (forward + backward)
  double cp_gathers_per_mb = 0;      // all-gathers of K and V and reduce-scatters of their gradients, likewise
  double ep_a2a_bytes = 0;           // one all-to-all: the tokens this GPU sends to experts (before (ep-1)/ep)
  double ep_a2a_per_mb = 0;          // all-to-alls per micro-batch over the stage's layers
};
Traffic traffic(const Model& m, const Parallel& p) {
  Traffic tr;
  const double layers = stage_layers(m, p);
  const bool full = p.recompute == Recompute::kFull;
  // Forward: two all-reduces (or all-gather + reduce-scatter pairs, the same volume with sequence
  // parallelism); backward two more; a full recomputation repeats the forward ones.
  double per_layer = 4 + (full ? 2 : 0);
  // Sequence parallelism stores the QKV and MLP inputs sharded and all-gathers them again in backward
  // for the weight gradients (Korthikanti et al. 2022 §4.2.3): two all-gathers, one all-reduce's worth.
  if (p.sequence_parallel && !full) per_layer += 1;
  const double tokens = double(p.micro_batch) * local_seq(m, p);
  tr.tp_collectives_per_mb = p.tp > 1 ? per_layer * layers : 0;
  tr.tp_buffer_bytes = tokens * m.hidden * p.act_bytes;
  // Megatron scatters the boundary activation over the tensor-parallel ranks before sending it (with
  // sequence parallelism it is already split).
  tr.pp_bytes_per_mb = p.pp > 1 ? tokens * m.hidden * p.act_bytes / p.tp : 0;
  const double expert = expert_parameters_per_gpu(m, p);
  const double dense = parameters_per_gpu(m, p) - expert;
  tr.dp_dense_bytes = p.dp * p.cp > 1 ? dense * p.grad_bytes : 0;
  tr.dp_expert_bytes = p.dp * p.cp / p.ep > 1 ? expert * p.grad_bytes : 0;
  tr.dp_factor = p.zero_stage >= 3 ? 1.5 : 1.0;
  if (p.cp > 1) {
    tr.cp_kv_bytes = 2 * tokens * kv_width_sharded(m, p.tp) / p.tp * p.act_bytes;
    if (p.cp_comm == CpComm::kRing) {
      // Ring attention: cp - 1 steps pass K and V on in forward; backward passes them again with their
      // gradients (two per step); a full recomputation repeats the forward ring.
      tr.cp_steps_per_mb = (p.cp - 1) * (1 + 2 + (full ? 1 : 0)) * layers;
    } else {
      // All-gather: K and V gathered once before the forward attention (and kept for backward), their
      // gradients reduce-scattered after the backward one; a full recomputation gathers them again.
      tr.cp_gathers_per_mb = (2 + (full ? 1 : 0)) * layers;
    }
  }
  if (is_moe(m) && p.ep > 1) {
    // Dispatch and combine in forward, their gradients in backward, again under full recomputation; each
    // tensor-parallel rank sends its 1/tp of the tokens (sequence parallel), top_k copies of each.
    tr.ep_a2a_bytes = tokens / p.tp * routed_slots(m, true) * m.hidden * p.act_bytes;
    tr.ep_a2a_per_mb = (4 + (full ? 2 : 0)) * layers * moe_layers(m) / m.layers;
  }
  return tr;
}

// Groups laid out tp first, then cp, then ep (Megatron's rank order): inside one node they use NVLink.
bool in_node(const Hardware& hw, long ranks) { return ranks <= hw.gpus_per_node; }

double alltoall_time_s(double bytes, int n, double gbps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return (n - 1) * latency_s + double(n - 1) / n * bytes / (gbps * 1e9);
}

double ep_time_per_mb(const Traffic& tr, const Parallel& p, const Hardware& hw) {
  if (tr.ep_a2a_per_mb <= 0) return 0;
  const bool local = in_node(hw, long(p.tp) * p.cp * p.ep);
  return tr.ep_a2a_per_mb * alltoall_time_s(tr.ep_a2a_bytes, p.ep, local ? hw.tp_gbps : hw.dp_gbps,
                                            local ? hw.tp_latency_s : hw.dp_latency_s);
}

double cp_step_time(const Traffic& tr, const Parallel& p, const Hardware& hw) {
  if (tr.cp_steps_per_mb <= 0) return 0;
  const bool local = in_node(hw, long(p.tp) * p.cp);
  return local ? hw.tp_latency_s + tr.cp_kv_bytes / (hw.tp_gbps * 1e9) : hw.dp_latency_s + tr.cp_kv_bytes / (hw.dp_gbps * 1e9);
}

// One all-gather of every rank's K and V (or reduce-scatter of their gradients) over the cp group.
double cp_gather_time(const Traffic& tr, const Parallel& p, const Hardware& hw) {
  if (tr.cp_gathers_per_mb <= 0) return 0;
  const bool local = in_node(hw, long(p.tp) * p.cp);
  return allgather_time_s(p.cp * tr.cp_kv_bytes, p.cp, local ? hw.tp_gbps : hw.dp_gbps,
                          local ? hw.tp_latency_s : hw.dp_latency_s);
}

// Context-parallel communication of one micro-batch over the stage's layers, before any overlap.
double cp_time_per_mb(const Traffic& tr, const Parallel& p, const Hardware& hw) {
  return tr.cp_steps_per_mb * cp_step_time(tr, p, hw) + tr.cp_gathers_per_mb * cp_gather_time(tr, p, hw);
}

double dp_time(const Traffic& tr, const Parallel& p, const Hardware& hw) {
  return tr.dp_factor * (allreduce_time_s(tr.dp_dense_bytes, p.dp * p.cp, hw.dp_gbps, hw.dp_latency_s) +
                         allreduce_time_s(tr.dp_expert_bytes, p.dp * p.cp / p.ep, hw.dp_gbps, hw.dp_latency_s));
}

// Tensor-parallel communication of one micro-batch over the stage's layers that the GEMMs do not hide. Without
// overlap, all of it. With it (sequence parallel), each all-gather or reduce-scatter runs beside one GEMM of the same
// layer: forward, the gather before QKV and FC1 and the scatter after the projection and FC2; backward, the mirror
// images on the data-gradient GEMMs, and sequence parallelism's re-gathers of the QKV and FC1 inputs beside their
// weight-gradient GEMMs (as large as the forward ones); a full recomputation repeats the forward four. The tensor moves
// in tp pieces, one per rank, each beside its share of the GEMM: the first piece of a gather (the last of a scatter)
// has no GEMM to hide behind, and a collective longer than its GEMM shows the excess:
//   exposed = c/t + (t - 1)/t * max(0, c - g).
double tp_exposed_per_mb(const Model& m, const Parallel& p, const Traffic& tr, const Hardware& hw) {
  if (tr.tp_collectives_per_mb <= 0) return 0;
  const double all_reduce = allreduce_time_s(tr.tp_buffer_bytes, p.tp, hw.tp_gbps, hw.tp_latency_s);
  if (!p.tp_comm_overlap) return tr.tp_collectives_per_mb * all_reduce;
  const double c = allgather_time_s(tr.tp_buffer_bytes, p.tp, hw.tp_gbps, hw.tp_latency_s);
  const double t = p.tp, h = m.hidden, rate = hw.gemm_tflops * 1e12;
  const double tokens = double(p.micro_batch) * local_seq(m, p);
  // Matrix weights per token of each GEMM on one rank, averaged over dense and MoE layers.
  const double qkv = h * (h + 2 * kv_width_sharded(m, p.tp)) / t, proj = h * h / t;
  const double up = (m.gated_mlp ? 2 : 1) * h / t, down = h / t;  // per unit of MLP width
  const double width = (dense_layers(m) * ffn_of(m) +
                        moe_layers(m) * expert_ffn_of(m) * (routed_slots(m, true) + m.shared_experts)) / m.layers;
  auto exposed = [&](double weights) {
    const double g = 2 * tokens * weights / rate;
    return c / t + (t - 1) / t * std::max(0.0, c - g);
  };
  const double forward = exposed(qkv) + exposed(proj) + exposed(up * width) + exposed(down * width);
  const bool full = p.recompute == Recompute::kFull;
  double per_layer = forward + forward + (full ? forward : 0);  // the backward mirror, the recomputed forward
  if (!full) per_layer += exposed(qkv) + exposed(up * width);    // the re-gathers beside the weight gradients
  return per_layer * stage_layers(m, p);
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
                         {m.vocab, "--vocab"}, {m.vocab_multiple, "--vocab-multiple"}, {p.tp, "--tp"}, {p.pp, "--pp"},
                         {p.dp, "--dp"}, {p.cp, "--cp"}, {p.ep, "--ep"}, {p.micro_batch, "--micro-batch"},
                         {p.interleave, "--interleave"}})
    if (Status s = positive(v, name); !s) return s;
  for (auto [v, name] : {std::pair{m.ffn, "--ffn"}, {m.kv_heads, "--kv-heads"}, {m.experts, "--experts"},
                         {m.expert_ffn, "--expert-ffn"}, {m.shared_experts, "--shared-experts"},
                         {m.dense_layers, "--dense-layers"}, {p.global_batch, "--global-batch"}})
    if (v < 0) return usage(fmt::format("{} {}: expected a positive number", name, v));
  // Products of two of these are formed in int, and 4 x hidden is cast back to one: keep every factor small
  // enough that none overflows (far above any real model or machine).
  for (auto [v, name, limit] : {std::tuple{m.layers, "--layers", 1 << 20}, {m.heads, "--heads", 1 << 20},
                                {m.kv_heads, "--kv-heads", 1 << 20}, {p.tp, "--tp", 1 << 15}, {p.pp, "--pp", 1 << 15},
                                {p.cp, "--cp", 1 << 15}, {p.ep, "--ep", 1 << 15}, {p.interleave, "--interleave", 1 << 15},
                                {m.experts, "--experts", 1 << 20}, {m.top_k, "--top-k", 1 << 20},
                                {m.hidden, "--hidden", 1 << 26}, {m.ffn, "--ffn", 1 << 28},
                                {m.expert_ffn, "--expert-ffn", 1 << 28}, {m.seq, "--seq", 1 << 28},
                                {m.vocab_multiple, "--vocab-multiple", 1 << 20}})
    if (v > limit) return usage(fmt::format("{} {}: too large (at most {})", name, v, limit));
  if (long(p.micro_batch) * p.dp > (1L << 30) || long(p.tp) * p.pp * p.cp * p.dp > (1L << 30))
    return usage("--micro-batch x --dp or the GPU count is too large");
  if (m.hidden % m.heads) return usage(fmt::format("--heads {} does not divide --hidden {}", m.heads, m.hidden));
  const int kv = kv_heads_of(m);
  if (kv > m.heads) return usage(fmt::format("--kv-heads {} is more than --heads {}", kv, m.heads));
  if (m.heads % kv) return usage(fmt::format("--kv-heads {} does not divide --heads {}", kv, m.heads));
  if (p.tp > m.heads) return usage(fmt::format("--tp {} is larger than --heads {}: a rank would have no head", p.tp, m.heads));
  if (m.heads % p.tp) return usage(fmt::format("--tp {} does not divide --heads {}", p.tp, m.heads));
  if (kv % p.tp && p.tp % kv)
    return usage(fmt::format("--tp {} neither divides --kv-heads {} nor is a multiple of it", p.tp, kv));
  if (int(ffn_of(m)) % p.tp) return usage(fmt::format("--tp {} does not divide the MLP width {}", p.tp, int(ffn_of(m))));
  if (p.pp * p.interleave > m.layers)
    return usage(fmt::format("--pp {} x --interleave {} is more stages than --layers {}", p.pp, p.interleave, m.layers));
  if (!p.uneven_stages && m.layers % (p.pp * p.interleave))
    return usage(fmt::format("--pp {} x --interleave {} does not divide --layers {} (--uneven-stages allows it)", p.pp, p.interleave, m.layers));
  if (p.uneven_stages && p.pp == 1) return usage("--uneven-stages needs --pp greater than 1");
  if (p.interleave > 1 && p.pp == 1) return usage("--interleave needs --pp greater than 1");
  if (p.sequence_parallel && p.tp == 1) return usage("--sequence-parallel needs --tp greater than 1");
  if (p.tp_comm_overlap && p.tp > 1 && !p.sequence_parallel)
    return usage("--tp-overlap needs --sequence-parallel (it overlaps the all-gathers and reduce-scatters of sequence parallelism)");
  if (p.sequence_parallel && m.seq % (p.tp * p.cp)) return usage(fmt::format("--tp {} x --cp {} does not divide --seq {}", p.tp, p.cp, m.seq));
  if (p.cp > 1 && !p.flash_attention) return usage("--cp needs --flash-attention (ring attention runs a fused kernel per block)");
  if (p.cp > 1 && m.seq % (2 * p.cp))
    return usage(fmt::format("--cp {} needs --seq {} to split into 2 x cp equal chunks (causal load balancing)", p.cp, m.seq));
  if (global_of(p) % (p.micro_batch * p.dp))
    return usage(fmt::format("--micro-batch {} x --dp {} does not divide --global-batch {}", p.micro_batch, p.dp, global_of(p)));
  if (p.interleave > 1 && microbatches_of(p) % p.pp)
    return usage(fmt::format("the interleaved schedule needs micro-batches per step ({}) to be a multiple of --pp {}",
                             microbatches_of(p), p.pp));
  if (is_moe(m)) {
    if (m.top_k < 1 || m.top_k > m.experts)
      return usage(fmt::format("--top-k {}: expected 1 to --experts {}", m.top_k, m.experts));
    if (m.experts % p.ep) return usage(fmt::format("--experts {} is not divisible by --ep {}", m.experts, p.ep));
    if (p.dp % p.ep) return usage(fmt::format("--ep {} does not divide --dp {} (expert parallelism is carved out of data parallelism)", p.ep, p.dp));
    if (m.dense_layers >= m.layers)
      return usage(fmt::format("--dense-layers {} leaves no MoE layer of --layers {}", m.dense_layers, m.layers));
    if (int(expert_ffn_of(m)) % p.tp)
      return usage(fmt::format("--tp {} does not divide the expert MLP width {}", p.tp, int(expert_ffn_of(m))));
    if (!(m.capacity_factor >= 0) || m.capacity_factor > 64)
      return usage(fmt::format("--capacity-factor {}: expected 0 (dropless) or a factor up to 64", m.capacity_factor));
  } else {
    if (p.ep > 1) return usage("--ep needs --experts");
    if (m.shared_experts || m.dense_layers || m.expert_ffn || m.capacity_factor > 0)
      return usage("--shared-experts, --dense-layers, --expert-ffn and --capacity-factor need --experts");
  }
  if (p.flash_attention && p.act_bytes > 2)
    return usage("--flash-attention needs 16- or 8-bit activations (--precision bf16, fp16 or fp8)");
  if (p.zero_stage < 0 || p.zero_stage > 3) return usage(fmt::format("--zero {}: expected 0, 1, 2 or 3", p.zero_stage));
  if (p.act_bytes < 1 || p.grad_bytes < 1) return usage("precisions must be positive byte counts");
  return {};
}

double padded_vocab(const Model& m) {
  const long mult = std::max(1, m.vocab_multiple);
  return double((long(m.vocab) + mult - 1) / mult * mult);
}

double parameter_count(const Model& m) {
  const double h = m.hidden;
  const double layers = dense_layers(m) * layer_dense_params(m, false) +
                        moe_layers(m) * (layer_dense_params(m, true) + expert_params(m));
  return layers + embedding_params(m) + (m.rms_norm ? 1 : 2) * h;
}

double active_parameter_count(const Model& m) {
  if (!is_moe(m)) return parameter_count(m);
  return parameter_count(m) - moe_layers(m) * (m.experts - m.top_k) * mlp_params(m, expert_ffn_of(m));
}

double expert_parameters_per_gpu(const Model& m, const Parallel& p) {
  return moe_layers(m) / m.layers * stage_layers(m, p) * expert_params(m) / (double(p.tp) * p.ep);
}

double parameters_per_gpu(const Model& m, const Parallel& p) {
  const double h = m.hidden;
  const double dense = (dense_layers(m) * layer_dense_params(m, false) + moe_layers(m) * layer_dense_params(m, true)) /
                       m.layers * stage_layers(m, p);
  // The word embedding (or, untied, the output layer of the last stage: as large) is split over tp; learned
  // positions are replicated.
  return dense / p.tp + padded_vocab(m) * h / p.tp + (m.learned_positions ? double(m.seq) * h : 0) +
         expert_parameters_per_gpu(m, p);
}

namespace {

std::vector<ActivationTensor> activations(const Model& m, const Parallel& p, bool moe_layer) {
  const double b = p.micro_batch, s = local_seq(m, p), h = m.hidden, t = p.tp, a = m.heads;
  const double sbh = s * b * h;
  const double kv = kv_width_sharded(m, p.tp);
  const double rep = p.sequence_parallel ? t : 1;  // tensors outside the tensor-parallel regions
  if (p.recompute == Recompute::kFull) return {{"layer_input", 2 * sbh / rep}};
  std::vector<ActivationTensor> v = {
      {"ln1.input", 2 * sbh / rep},
      {"attn.qkv_input", 2 * sbh / rep},
      {"attn.q_k", 2 * s * b * (h + kv) / t},
      {"attn.v", 2 * s * b * kv / t},
      {"attn.proj_input", 2 * sbh / t},
  };
  if (m.dropout) v.push_back({"attn.dropout_mask", sbh / rep});
  v.push_back({"ln2.input", 2 * sbh / rep});
  v.push_back({"mlp.fc1_input", 2 * sbh / rep});
  auto mlp = [&](const std::string& prefix, double width) {
    // SwiGLU keeps both halves of the first projection (gate and up) and the product.
    if (m.gated_mlp) v.push_back({prefix + ".swiglu_input", 4 * s * b * width / t});
    else v.push_back({prefix + ".gelu_input", 2 * s * b * width / t});
    v.push_back({prefix + ".fc2_input", 2 * s * b * width / t});
  };
  if (!moe_layer) {
    mlp("mlp", ffn_of(m));
  } else {
    const double slots = routed_slots(m, true);
    // The router's fp32 logits, then each routed copy of a token: its permuted input, the expert's MLP.
    v.push_back({"moe.router_logits", 4 * s * b * m.experts / rep});
    v.push_back({"moe.expert_input", 2 * sbh * slots / rep});
    mlp("moe.experts", expert_ffn_of(m) * slots);
    if (m.shared_experts) mlp("moe.shared", expert_ffn_of(m) * m.shared_experts);
  }
  if (m.dropout) v.push_back({"mlp.dropout_mask", sbh / rep});
  // An all-gather of K and V keeps the other ranks' keys and values for the backward attention.
  if (p.cp > 1 && p.cp_comm == CpComm::kAllGather)
    v.push_back({"attn.kv_gathered", 2 * 2 * (double(m.seq) - s) * b * kv / t});
  if (p.flash_attention) {
    // The fused kernel keeps one fp32 log-sum-exp per row of scores for its backward, nothing of size s^2;
    // under selective recomputation the core is re-run in backward and keeps not even that.
    if (p.recompute == Recompute::kNone) v.push_back({"attn.softmax_lse", 4 * a * s * b / t});
  } else if (p.recompute == Recompute::kNone) {
    // The attention core: what selective recomputation gives back.
    const double scores = a * s * double(m.seq) * b / t;
    v.push_back({"attn.softmax_output", 2 * scores});
    if (m.dropout) {
      v.push_back({"attn.softmax_dropout_mask", scores});
      v.push_back({"attn.softmax_dropout_output", 2 * scores});
    }
  }
  return v;
}

double sum_bytes(const std::vector<ActivationTensor>& v) {
  double sum = 0;
  for (const auto& t : v) sum += t.bytes;
  return sum;
}

}  // namespace

std::vector<ActivationTensor> layer_activations(const Model& m, const Parallel& p) { return activations(m, p, is_moe(m)); }

double layer_activation_bytes(const Model& m, const Parallel& p) {
  return (dense_layers(m) * sum_bytes(activations(m, p, false)) + moe_layers(m) * sum_bytes(activations(m, p, true))) /
         m.layers;
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
  const double expert = expert_parameters_per_gpu(m, p);
  // The gradients kept are the ones reduced: one precision for both, so memory and comm agree. ZeRO shards
  // over the ranks that hold the same weights: dp x cp, and dp x cp / ep for the experts.
  const ModelStates dense = model_state_bytes(r.parameters - expert, p.dp * p.cp, p.zero_stage, p.grad_bytes);
  const ModelStates experts = model_state_bytes(expert, std::max(1, p.dp * p.cp / p.ep), p.zero_stage, p.grad_bytes);
  r.weight_bytes = dense.weight_bytes + experts.weight_bytes;
  r.gradient_bytes = dense.gradient_bytes + experts.gradient_bytes;
  r.optimizer_bytes = dense.optimizer_bytes + experts.optimizer_bytes;
  r.activation_bytes_per_layer = layer_activation_bytes(m, p);
  r.stage_layers = stage_layers(m, p);
  const int mbs = microbatches_of(p);
  // 1F1B: the first stage runs p forwards before its first backward; interleaving adds (p-1)/(p v).
  double in_flight = std::min(mbs, p.pp);
  if (p.interleave > 1) in_flight *= 1 + double(p.pp - 1) / (double(p.pp) * p.interleave);
  r.in_flight_microbatches = in_flight;
  const double embedding_dropout_mask =
      m.dropout ? local_seq(m, p) * p.micro_batch * m.hidden / (p.sequence_parallel ? p.tp : 1) : 0;
  r.activation_bytes = (r.activation_bytes_per_layer * stage_layers(m, p) + embedding_dropout_mask) * in_flight;
  r.total_bytes = r.weight_bytes + r.gradient_bytes + r.optimizer_bytes + r.activation_bytes;
  return r;
}

FlopCount step_flops(const Model& m, const Parallel& p) {
  const double B = global_of(p), s = m.seq, h = m.hidden, l = m.layers, V = padded_vocab(m);
  // Per sequence per layer; the model count routes each token to top_k experts, the hardware count also
  // runs the padding of a capacity factor.
  const double dense_model = 2 * s * mean_token_matrix_params(m, 1, false);
  const double dense_hw = 2 * s * mean_token_matrix_params(m, 1, true);
  const double attention = 4 * s * s * h;
  const double logits = 2 * s * h * V;
  FlopCount c;
  // The papers' convention: the attention core counted whole, even where a causal mask makes half of it
  // unnecessary.
  c.model_flops = 3 * B * (l * (dense_model + attention) + logits);
  // What the GPUs execute: recomputation included, and only the blocks a fused kernel runs.
  const Passes ps = passes_of(m, p);
  c.hardware_flops = B * (l * (ps.dense * dense_hw + ps.attention * ps.attention_share * attention) + 3 * logits);
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
  if (need_compute && !(hw.gemm_tflops > 0)) return usage("--gemm-tflops: give the measured GEMM throughput (or --gpu NAME, or --from-vet with gpu.gemm_bf16)");
  if (need_compute && !(hw.hbm_gbps > 0)) return usage("--hbm-gbps: give the device memory bandwidth (or --gpu NAME, or --from-vet with gpu.hbm_bandwidth)");
  if (hw.gpus_per_node < 1) return usage("--gpus-per-node: expected a positive count");
  const bool uses_nvlink = p.tp > 1 || (p.cp > 1 && in_node(hw, long(p.tp) * p.cp)) ||
                           (p.ep > 1 && in_node(hw, long(p.tp) * p.cp * p.ep));
  if (uses_nvlink && !(hw.tp_gbps > 0)) return usage("--tp-gbps: give the tensor-parallel link bandwidth (or --gpu NAME, or --from-vet with gpu.nccl_busbw)");
  if ((p.pp > 1 || p.dp > 1 || p.cp > 1 || p.ep > 1) && !(hw.dp_gbps > 0))
    return usage("--dp-gbps: give the network bandwidth per GPU (or --gpu NAME, or --from-vet with network.busbw_gbps)");
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
  r.dp_bytes = tr.dp_factor * (2.0 * (p.dp * p.cp - 1) / (p.dp * p.cp) * tr.dp_dense_bytes +
                               (tr.dp_expert_bytes > 0 ? 2.0 * (p.dp * p.cp / p.ep - 1) / (p.dp * p.cp / p.ep) * tr.dp_expert_bytes : 0));
  r.dp_time_s = dp_time(tr, p, hw);
  r.cp_bytes = mbs * (tr.cp_steps_per_mb + tr.cp_gathers_per_mb * (p.cp - 1)) * tr.cp_kv_bytes;
  r.cp_time_s = mbs * cp_time_per_mb(tr, p, hw);
  r.ep_bytes = tr.ep_a2a_per_mb * mbs * tr.ep_a2a_bytes * (p.ep - 1) / p.ep;
  r.ep_time_s = mbs * ep_time_per_mb(tr, p, hw);
  const LayerFlops lf = layer_forward_flops(m, p);
  // Gradients are final only in the last micro-batch's backward: that is all the reduction can hide behind.
  // Backward with what recomputation repeats during it: everything but the forward pass.
  const Passes ps = passes_of(m, p);
  r.backward_flops =
      ((ps.dense - 1) * lf.dense + (ps.attention - 1) * ps.attention_share * lf.attention) * stage_layers(m, p);
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
  const double layers = stage_layers(m, p);
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
        p.act_bytes * (2 * attention_scores(m, p) + 4 * double(p.micro_batch) * local_seq(m, p) * m.hidden / p.tp);
    attention_time = std::max(lf.attention / flop_rate, attention_bytes / mem_rate);
  }
  const double layer_gemm = ps.dense * lf.dense / flop_rate + ps.attention * attention_time;
  const double layer_mem = (ps.dense * lt.dense + ps.attention * lt.attention) / mem_rate;
  // The output layer and the cross entropy over fp32 logits: the slowest stage is the last one.
  const double logits = double(p.micro_batch) * local_seq(m, p) * padded_vocab(m) / p.tp;
  const double head_gemm = 3 * 2 * logits * m.hidden / flop_rate;
  const double head_mem = 2 * 3 * 4 * logits / mem_rate;
  const double tp_per_mb = tp_exposed_per_mb(m, p, tr, hw);
  // Ring attention sends the next block's keys and values while the current block computes: only what the
  // attention blocks of the same pass cannot cover shows (forward: one block per step; backward: two passes).
  // An all-gather completes before the attention that needs it starts: all of it shows.
  double cp_per_mb = 0;
  if (tr.cp_steps_per_mb > 0) {
    const double step_comm = cp_step_time(tr, p, hw);
    const double block = attention_time / p.cp;  // one of the cp blocks of a pass
    const double per_layer = tr.cp_steps_per_mb / layers;  // steps per layer and micro-batch
    cp_per_mb = layers * per_layer * std::max(0.0, step_comm - block);
  } else if (tr.cp_gathers_per_mb > 0) {
    cp_per_mb = cp_time_per_mb(tr, p, hw);
  }
  const double ep_per_mb = ep_time_per_mb(tr, p, hw);

  StepReport r;
  r.microbatches = mbs;
  r.gemm_s = mbs * (layers * layer_gemm + head_gemm);
  r.elementwise_s = mbs * (layers * layer_mem + head_mem);
  r.tp_comm_s = mbs * tp_per_mb;
  r.cp_comm_s = mbs * cp_per_mb;
  r.ep_comm_s = mbs * ep_per_mb;
  const double per_mb = layers * (layer_gemm + layer_mem) + head_gemm + head_mem + tp_per_mb + cp_per_mb + ep_per_mb;
  r.bubble_s = double(p.pp - 1) / p.interleave * per_mb;
  r.pp_comm_s = pp_comm_time(tr, p, mbs, hw);
  double dp = dp_time(tr, p, hw);
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
  const double expert = expert_parameters_per_gpu(m, p);
  const double shard = p.zero_stage >= 1
                           ? (parameters_per_gpu(m, p) - expert) / (p.dp * p.cp) + expert / std::max(1, p.dp * p.cp / p.ep)
                           : parameters_per_gpu(m, p);
  const double optimizer_bytes = 4 + 28 + 6 + (p.grad_bytes < 4 ? p.grad_bytes + 4 : 0);
  r.optimizer_s = optimizer_bytes * shard / mem_rate;
  r.step_s = r.gemm_s + r.elementwise_s + r.tp_comm_s + r.cp_comm_s + r.ep_comm_s + r.bubble_s + r.pp_comm_s +
             r.dp_comm_s + r.optimizer_s;
  const double gpus = double(p.tp) * p.pp * p.cp * p.dp;
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
