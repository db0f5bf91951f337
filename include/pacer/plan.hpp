// pacer plan: the arithmetic of a training run (scaling limits, pipeline partitions, memory, communication,
// checkpoint intervals, step time) done before the allocation is spent.
//
// Everything here is pure arithmetic on the caller's figures: no I/O except the CSV and vet-report readers,
// no global state, every function is thread-safe. Units are in the names: _s seconds, _bytes bytes,
// _flops FLOP (not per second), _tflops TFLOP/s, _gbps GB/s (1e9 bytes per second). Formulas are in
// docs/plan.md; functions that take user input return Expected and name the offending key or file:line.
// Each report's to_json is the record `pacer plan <command> --json` prints (schema pacer.plan.<command>/1);
// JSON has no infinity or NaN, so such figures are null there.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::plan {

// ---------------------------------------------------------------------------------------------------------
// CSV: a header line, then rows of comma-separated cells; '#' starts a comment line, blank lines are skipped.
// Errors name file:line (and the column).
struct CsvRow {
  int line = 0;                    // 1-based line number in the file
  std::vector<std::string> cells;  // trimmed, same count as the header
};
struct CsvTable {
  std::string path;
  std::vector<std::string> header;  // trimmed, lower-case
  std::vector<CsvRow> rows;

  // Index of `name` in the header, or -1.
  int column(const std::string& name) const;
  // Index of `name`, or an error "file: no 'name' column in the header".
  Expected<int> required_column(const std::string& name) const;
  // The cell of `row` in column `col` as a number; an error "file:line: column 'x': ..." otherwise.
  Expected<double> number(const CsvRow& row, int col) const;
};
Expected<CsvTable> read_csv(const std::string& path);
Expected<CsvTable> parse_csv(const std::string& text, const std::string& path);

// ---------------------------------------------------------------------------------------------------------
// Amdahl and Karp-Flatt.
// Speedup on n workers of a job whose serial (non-parallelisable) share is f: 1 / (f + (1 - f) / n).
double amdahl_speedup(double serial_fraction, double n);
// Serial fraction implied by a measured speedup on n workers (Karp-Flatt): (1/S - 1/n) / (1 - 1/n).
double karp_flatt(double speedup, double n);

struct AmdahlReport {
  double serial_fraction = 0;     // given, or implied by the measured speedup
  double n = 0;                   // workers the speedup is for
  double speedup = 0;             // at n
  double efficiency = 0;          // speedup / n
  double max_speedup = 0;         // 1 / f (infinite workers); +inf when f = 0
  double n_for_half_efficiency = 0;  // workers at which efficiency drops to 50%: 1 + 1/f (+inf when f = 0)
};
// Either `serial_fraction` or `measured_speedup` must be given; n >= 1.
Expected<AmdahlReport> amdahl(std::optional<double> serial_fraction, std::optional<double> measured_speedup, double n);
// from_speedup: the fraction came from a measured speedup (Karp-Flatt), not given.
nlohmann::json to_json(const AmdahlReport& r, bool from_speedup);

// ---------------------------------------------------------------------------------------------------------
// Scaling from measurements.
enum class ScalingMode { kStrong, kWeak };
struct ScalingPoint {
  double gpus = 0;
  double throughput = 0;  // work per second (higher is better); 0 when given as step time
  double step_time_s = 0; // seconds per step; 0 when given as throughput
  int line = 0;
  double efficiency = 0;  // filled by analyse_scaling, against the smallest count
  double karp_flatt = 0;  // serial fraction this point alone implies (NaN for the base point)
};
struct ScalingPrediction {
  double gpus = 0;
  double efficiency = 0;      // with the fitted fraction
  double efficiency_low = 0;  // fraction + 2 standard errors (NaN when fewer than 3 points)
  double efficiency_high = 0; // fraction - 2 standard errors
  bool extrapolated_far = false;  // more than 4x the largest measured count
};
struct ScalingReport {
  ScalingMode mode = ScalingMode::kStrong;
  std::vector<ScalingPoint> points;  // sorted by gpus
  double serial_fraction = 0;        // least-squares fit of the Amdahl (strong) or Gustafson (weak) model
  double serial_fraction_stderr = 0; // NaN with fewer than 3 points
  double rms_residual = 0;           // of the efficiency fit
  std::vector<ScalingPrediction> predictions;
  std::vector<std::string> warnings;
};
// Reads `gpus` and one of `throughput` / `step_time_s` per row. Needs two distinct GPU counts.
Expected<std::vector<ScalingPoint>> read_scaling_csv(const std::string& path);
Expected<ScalingReport> analyse_scaling(std::vector<ScalingPoint> points, ScalingMode mode,
                                        const std::vector<double>& predict_at);
// `file`: the CSV the points came from.
nlohmann::json to_json(const ScalingReport& r, const std::string& file);

// ---------------------------------------------------------------------------------------------------------
// Pipeline partitioning of measured per-layer times.
enum class Schedule { kGpipe, k1f1b, kInterleaved };
struct Layer {
  std::string name;
  double time_s = 0;        // forward + backward of one micro-batch through this layer
  double memory_bytes = 0;  // activation memory one micro-batch leaves on the GPU (0: not given)
  int line = 0;
};
struct Stage {
  int first_layer = 0;  // index into the layer list
  int layer_count = 0;
  double time_s = 0;        // per micro-batch (sum over its chunks when interleaved)
  double memory_bytes = 0;  // activation memory of the micro-batches in flight on this stage
  double in_flight = 0;     // micro-batches whose activations it holds at the peak
};
struct PipelinePlan {
  std::vector<Stage> stages;  // one per device; with interleaving each device has `chunks` chunks
  std::vector<std::vector<int>> chunk_bounds;  // per device: first layer of each chunk (interleaved only)
  double step_time_s = 0;
  double bubble_fraction = 0;  // share of the step the slowest stage waits: 1 - M * t_max / step
  double max_stage_time_s = 0;
};
struct PipelineReport {
  Schedule schedule = Schedule::k1f1b;
  int stages = 0, microbatches = 0, chunks = 1;
  PipelinePlan optimal;   // minimises the slowest stage (exact)
  PipelinePlan by_count;  // equal numbers of layers per stage (the habit)
  double gain = 0;        // by_count.step / optimal.step - 1
  bool has_memory = false;
};
// CSV columns: `time_ms` (required), `layer` and `memory_mb` (optional).
Expected<std::vector<Layer>> read_layers_csv(const std::string& path);
// Exact contiguous partition of `times` into `parts` groups minimising the largest group sum; returns
// the first index of each group. Dynamic programming, O(parts * n^2).
std::vector<int> partition_min_max(const std::vector<double>& times, int parts);
Expected<PipelineReport> plan_pipeline(const std::vector<Layer>& layers, int stages, int microbatches,
                                       Schedule schedule, int chunks);
// `file`: the CSV of the `layers` layers.
nlohmann::json to_json(const PipelineReport& r, const std::string& file, std::size_t layers);

// ---------------------------------------------------------------------------------------------------------
// Transformers. The defaults are the GPT block of Megatron-LM 2021-2022 (multi-head attention, a 4h GeLU MLP with
// biases, LayerNorm, learned position embeddings, a tied output layer, dropout); the fields after `ffn` describe
// the models trained since (Llama, Mixtral, DeepSeek-MoE), and the presets set them (model_presets()).
enum class Recompute { kNone, kSelective, kFull };
// How context parallelism moves keys and values: a ring that passes each rank's block on while the attention of
// the previous block runs (Megatron-Core, the default), or an all-gather of K and V before the attention and a
// reduce-scatter of their gradients after it (the Llama 3 paper, §3.3.2), exposed on the critical path.
enum class CpComm { kRing, kAllGather };
struct Model {
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int seq = 0;
  int vocab = 0;
  int ffn = 0;  // 0: 4 * hidden
  int kv_heads = 0;               // key/value heads: 0 = heads (multi-head), 1 multi-query, else grouped-query
  bool gated_mlp = false;         // SwiGLU: gate and up projections, each `ffn` wide, then the down projection
  bool biases = true;             // biases in the linear layers
  bool rms_norm = false;          // RMSNorm (a scale) instead of LayerNorm (a scale and a shift)
  bool learned_positions = true;  // false: rotary embeddings, no parameters
  bool tied_embeddings = true;    // false: a separate output layer of vocab x hidden
  bool dropout = true;            // dropout masks stored for backward
  int vocab_multiple = 1;         // the vocabulary is padded up to a multiple of this (Megatron: 128 x tp)
  // Mixture of experts: 0 experts is a dense model.
  int experts = 0;
  int top_k = 1;                  // experts each token is routed to
  int expert_ffn = 0;             // width of one expert's MLP; 0: ffn
  int shared_experts = 0;         // experts every token goes through (DeepSeek-MoE), each expert_ffn wide
  int dense_layers = 0;           // the first layers keep a dense MLP of width ffn (DeepSeek-MoE)
  double capacity_factor = 0;     // slots per expert over the balanced share; 0: dropless (no padding)
};
struct Parallel {
  int tp = 1, pp = 1, dp = 1;
  int cp = 1;                // context parallel: the sequence split over cp ranks
  CpComm cp_comm = CpComm::kRing;
  int ep = 1;                // expert parallel: experts split over ep ranks, carved out of dp
  int micro_batch = 1;
  int global_batch = 0;      // 0: micro_batch * dp (one micro-batch per step)
  int interleave = 1;        // virtual pipeline chunks per device
  bool uneven_stages = false;  // pp x interleave need not divide the layers: chunks take ceil(l / (pp v)) at most
  bool sequence_parallel = false;
  // Tensor-parallel collectives overlapped with the GEMMs they feed or follow (Transformer Engine's userbuffers,
  // NeMo's ub_tp_comm_overlap; needs sequence parallelism): see docs/plan.md for what still shows.
  bool tp_comm_overlap = false;
  // A fused attention kernel (FlashAttention, cuDNN): the scores never reach memory, the causal half of them
  // is skipped, and backward recomputes them. Without it, Megatron's unfused core (materialised scores).
  bool flash_attention = false;
  Recompute recompute = Recompute::kNone;
  int zero_stage = 0;        // 0-3; the distributed optimizer of Megatron is stage 1
  int act_bytes = 2;         // activations and their gradients on the wire (bf16/fp16)
  int grad_bytes = 4;        // data-parallel gradient reduction (Megatron reduces fp32 main grads)
};
// Checks that every size is positive, that heads divide hidden and kv-heads divide heads, that tp is no larger
// than the heads and divides them (and the kv-heads, or is a multiple of them), pp*interleave divides layers,
// dp*micro_batch divides global_batch, ep divides the experts and dp, cp splits the sequence into 2 cp chunks
// and has a fused attention, tp overlap has sequence parallelism. The message names the option.
Status validate(const Model& m, const Parallel& p);
// The "config" object of the memory, comm and step records: the model, its parameter count and the layout.
nlohmann::json to_json(const Model& m, const Parallel& p);

// Parameters of the whole model: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) for the default GPT block.
double parameter_count(const Model& m);
// Parameters one token goes through (for a mixture of experts: top_k + shared experts of each MoE layer).
double active_parameter_count(const Model& m);
// The vocabulary after padding to Model::vocab_multiple.
double padded_vocab(const Model& m);
// Parameters held by the GPU of the first pipeline stage (transformer layers / (tp pp) plus the
// embeddings / tp and the position embeddings; expert weights also / ep).
double parameters_per_gpu(const Model& m, const Parallel& p);
// The expert share of parameters_per_gpu: reduced and sharded over dp * cp / ep ranks, the rest over dp * cp.
double expert_parameters_per_gpu(const Model& m, const Parallel& p);

// One stored tensor of a transformer layer's forward pass, as counted by Korthikanti et al. 2022 §4.1.
struct ActivationTensor {
  std::string name;
  double bytes = 0;  // per micro-batch, per GPU
};
// What one layer stores for backward, tensor by tensor, under the recomputation, tp, sp and cp settings (an MoE
// layer for a mixture of experts); layer_activation_bytes is the mean over the model's layers.
std::vector<ActivationTensor> layer_activations(const Model& m, const Parallel& p);
double layer_activation_bytes(const Model& m, const Parallel& p);

struct MemoryReport {
  double parameters = 0;           // on the first stage's GPUs
  double weight_bytes = 0;         // 2 bytes per parameter (bf16/fp16), / dp under ZeRO-3
  double gradient_bytes = 0;       // Parallel::grad_bytes per parameter, / dp under ZeRO-2 and 3
  double optimizer_bytes = 0;      // 12 bytes (fp32 master, momentum, variance), / dp under ZeRO >= 1
  double activation_bytes_per_layer = 0;  // one micro-batch
  double stage_layers = 0;                // layers on the most loaded stage
  double in_flight_microbatches = 0;      // on the first stage at the peak of the schedule
  double activation_bytes = 0;     // first stage, schedule peak, with the embedding dropout mask
  double total_bytes = 0;
};
MemoryReport estimate_memory(const Model& m, const Parallel& p);
// With `gpu_memory_bytes`, the record also says whether the estimate fits in that much.
nlohmann::json to_json(const MemoryReport& r, const Model& m, const Parallel& p,
                       std::optional<std::uint64_t> gpu_memory_bytes = std::nullopt);
// Mixed-precision Adam model states of `params` parameters per model replica: 2 bytes of weights,
// `grad_bytes` of gradients (2 in the ZeRO paper, 4 for Megatron's fp32 main gradients) and 12 of optimizer
// state (Rajbhandari et al. 2020), partitioned over `dp` ranks as ZeRO stage `zero_stage` does.
struct ModelStates {
  double weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
};
ModelStates model_state_bytes(double params, int dp, int zero_stage, int grad_bytes);

// Matrix FLOPs of one training step for the whole job: forward, backward and what recomputation adds.
struct FlopCount {
  double model_flops = 0;     // 72 B s l h^2 (1 + s/(6h) + V/(12 l h)): forward + backward
  double hardware_flops = 0;  // model_flops plus recomputed forwards
};
FlopCount step_flops(const Model& m, const Parallel& p);

// Links and devices. Bandwidths are what a collective achieves per GPU ("bus bandwidth" in nccl-tests).
struct Hardware {
  double gemm_tflops = 0;   // sustained large-GEMM throughput of one GPU, bf16/fp16
  int gpus_per_node = 8;    // the NVLink domain: tp, cp and ep groups inside it use tp_gbps, else dp_gbps
  double attention_tflops = 0;  // a fused attention kernel's rate on the blocks it runs (0: gemm_tflops)
  double peak_tflops = 0;   // datasheet dense peak, for MFU (0: not reported)
  double hbm_gbps = 0;      // device memory bandwidth achieved by streaming kernels
  double tp_gbps = 0;       // tensor-parallel link (NVLink) bus bandwidth
  double tp_latency_s = 5e-6;
  double dp_gbps = 0;       // data- and pipeline-parallel link (network) bus bandwidth per GPU
  double dp_latency_s = 10e-6;
  bool overlap_dp = false;  // gradient reduction overlapped with backward
};

struct CommReport {
  double dp_bytes = 0;        // per GPU per step (sent), all-reduce or reduce-scatter + all-gather
  double tp_bytes = 0;        // per GPU per step
  double pp_bytes = 0;        // per GPU per step (to the next stage and back)
  double cp_bytes = 0;        // per GPU per step: keys and values (and their gradients) the context-parallel ranks exchange
  double ep_bytes = 0;        // per GPU per step: the all-to-alls that dispatch tokens to experts and combine them
  double dp_time_s = 0, tp_time_s = 0, pp_time_s = 0, cp_time_s = 0, ep_time_s = 0;  // cp: before overlap
  double dp_hide_flops = 0;   // FLOPs of backward compute needed on one GPU to hide dp_time_s
  double backward_flops = 0;  // backward FLOPs of the last micro-batch on one GPU: gradients are final only
                              // then, so it is all an overlapped reduction can hide behind
  double dp_hidden_fraction = 0;  // min(1, that backward's time / dp time) at gemm_tflops
};
// Ring collectives: all-reduce moves 2 (n-1)/n of the buffer per GPU, reduce-scatter and all-gather (n-1)/n.
double allreduce_time_s(double bytes, int n, double gbps, double latency_s);
double allgather_time_s(double bytes, int n, double gbps, double latency_s);
Expected<CommReport> estimate_comm(const Model& m, const Parallel& p, const Hardware& hw);
// hardware_sources: where each hardware figure came from ("command line", or a vet check and its report).
using HardwareSources = std::map<std::string, std::string>;
nlohmann::json to_json(const CommReport& r, const Model& m, const Parallel& p, const HardwareSources& hardware_sources);

struct StepReport {
  int microbatches = 0;          // per pipeline per step
  double gemm_s = 0;             // matrix compute on one GPU (including recomputation)
  double elementwise_s = 0;      // memory-bound kernels (norms, softmax, dropout, GeLU, residuals)
  double tp_comm_s = 0;          // not hidden behind the GEMMs (all of it without Parallel::tp_comm_overlap)
  double pp_comm_s = 0;
  double cp_comm_s = 0;          // context-parallel traffic not hidden behind the attention (all of it for all-gather)
  double ep_comm_s = 0;          // expert all-to-alls (not overlapped)
  double bubble_s = 0;
  double dp_comm_s = 0;          // exposed (after overlap)
  double optimizer_s = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  double model_tflops_per_gpu = 0;
  double hardware_tflops_per_gpu = 0;
  double mfu = 0;  // model FLOP/s per GPU / peak (0 when no peak given)
  double hfu = 0;
};
Expected<StepReport> estimate_step(const Model& m, const Parallel& p, const Hardware& hw);
nlohmann::json to_json(const StepReport& r, const Model& m, const Parallel& p, const Hardware& hw,
                       const HardwareSources& hardware_sources);

// ---------------------------------------------------------------------------------------------------------
// Checkpoint intervals and failures.
struct CkptInput {
  double save_cost_s = 0;
  double restart_cost_s = 0;   // time from a failure to training again (requeue, load, warm-up)
  double mtbf_s = 0;           // of the whole job
  double campaign_s = 0;       // 0: not reported
  double current_interval_s = 0;  // 0: not reported
  // How long a save takes to become durable once training goes on (the
  // background write); 0: not known. A save started sooner waits for the
  // last one, so the interval is never shorter.
  double write_time_s = 0;
};
struct CkptReport {
  double young_interval_s = 0;
  double daly_interval_s = 0;
  double interval_s = 0;             // the one to use: Daly's, or the write time when that is longer
  double lost_fraction = 0;          // at interval_s: save / interval + (interval / 2 + restart) / MTBF
  double lost_fraction_current = 0;  // at the current interval (0 when none given)
  double expected_failures = 0;      // over the campaign
  double p_any_failure = 0;          // 1 - exp(-campaign / MTBF)
};
// Job MTBF from a per-node MTBF and the node count (independent exponential failures).
double job_mtbf_s(double node_mtbf_s, int nodes);
Expected<CkptReport> plan_ckpt(const CkptInput& in);
// save_cost_from: how the save cost was found ("given", or the size and write rate it came from).
nlohmann::json to_json(const CkptReport& r, const CkptInput& in, const std::string& save_cost_from);

// ---------------------------------------------------------------------------------------------------------
// Calibration from `pacer vet --json` reports (schema pacer.vet/1). Figures are taken by check name:
//   gpu.gemm_bf16 (TFLOP/s)       -> Hardware::gemm_tflops
//   gpu.hbm_bandwidth (GB/s)      -> Hardware::hbm_gbps
//   gpu.nccl_busbw (GB/s)      -> Hardware::tp_gbps
//   network.busbw_gbps (GB/s)     -> Hardware::dp_gbps
//   storage.write (MB/s)          -> checkpoint write rate per node
//   memory.bandwidth, cpu.flops   -> reported, not used by the models
// With several targets (GPUs, paths) the slowest figure wins: a step goes at the pace of its slowest GPU.
// Checks whose status is skip or error, or whose value is not a number, are ignored.
struct Calibration {
  std::string source;  // path of the report
  std::map<std::string, double> figures;  // check name -> value in the unit above
};
Expected<Calibration> read_vet_report(const std::string& path);
// The figure for `check`, if the report had a usable one.
std::optional<double> figure(const Calibration& c, const std::string& check);


// ---------------------------------------------------------------------------------------------------------
// Presets: published model shapes and GPU figures by name, each number with its source (src/plan/presets.cpp,
// docs/plan.md "Presets"). The CLI applies a preset first and then every flag given, so any number can be
// overridden.
struct ModelPreset {
  std::string name;
  Model model;            // seq: the pre-training sequence length of the source
  std::string source;     // where the shape comes from
  double published_parameters = 0;  // the count the source states (0: none), for the validation test
};
struct GpuPreset {
  std::string name;
  Hardware hw;                 // gemm_tflops: the one constant of the GPU's generation (docs/plan.md)
  double memory_bytes = 0;     // device memory
  std::string source;
  // FlashAttention-2's rate on the blocks it runs, for runs that use it instead of cuDNN's fused kernel
  // (hw.attention_tflops): Transformer Engine picks it when NVTE_FUSED_ATTN=0. 0: not measured on this GPU.
  double flash2_attention_tflops = 0;
};
const std::vector<ModelPreset>& model_presets();
const std::vector<GpuPreset>& gpu_presets();
// The preset of that name, or a usage error that lists the names.
Expected<ModelPreset> find_model_preset(const std::string& name);
Expected<GpuPreset> find_gpu_preset(const std::string& name);

// ---------------------------------------------------------------------------------------------------------
// Layout search: every tp x pp x dp x cp x ep x micro-batch x interleaving x recomputation x ZeRO stage for
// `gpus` GPUs, those whose memory estimate fits under the capacity less the margin, ranked by step time.
struct SearchSpace {
  int gpus = 0;
  int global_batch = 0;
  double memory_bytes = 0;      // per GPU
  double margin_bytes = 0;      // kept free (fragmentation, workspaces, the CUDA context)
  int top = 5;
  // Values to try; empty: every value that makes sense (docs/plan.md, "plan search").
  std::vector<int> tp, pp, cp, ep, micro_batch, interleave, zero_stage;
  std::vector<Recompute> recompute;
};
struct Candidate {
  Parallel layout;
  StepReport step;
  MemoryReport memory;
  // Why it is slower than the best: the parts of the step that grew, largest first (seconds).
  std::vector<std::pair<std::string, double>> losses;
};
struct SearchReport {
  int evaluated = 0;      // layouts that passed validate()
  int fitting = 0;        // of those, the ones that fit in memory
  double best_memory_bytes = 0;  // smallest total of all evaluated (what did not fit, by how much)
  std::vector<Candidate> top;
};
// `base` gives the fixed settings (precisions, flash attention, tp overlap, cp communication); its tp/pp/..., uneven
// stages and sequence parallelism are the enumeration's. A model that validate() refuses, or a space in which no
// layout passes it, is a usage error with the reason; layouts that pass but do not fit give an empty `top`.
Expected<SearchReport> search_layouts(const Model& m, const Parallel& base, const Hardware& hw, const SearchSpace& space);
nlohmann::json to_json(const SearchReport& r, const Model& m, const Hardware& hw, const SearchSpace& space);

}  // namespace pacer::plan
