// `pacer plan`: the arithmetic of a training run (Amdahl, scaling fits, pipeline partitions, memory,
// communication, checkpoint intervals, step time), from the user's figures or a `pacer vet --json` report.
#include "pacer/plan.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <memory>

#include "ckpt_interval.hpp"
#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"

namespace pacer::cli {
namespace {

using plan::Recompute;
using plan::Schedule;

struct PlanArgs {
  bool json = false;
  // amdahl
  std::optional<double> serial_fraction, speedup;
  double gpus = 0;
  // scaling, pipeline
  std::string file;
  std::string mode = "strong";
  std::vector<double> predict;
  int stages = 0, microbatches = 0, chunks = 1;
  std::string schedule = "1f1b";
  // transformer: `flags` and `par` take what the command line gave; resolve_transformer() lays the flags given
  // over the --model preset into `model` (the command line wins, flag by flag).
  CLI::App* command = nullptr;  // the subcommand that ran, to ask which options were given
  std::string model_preset, gpu_preset;
  plan::Model flags, model;
  std::string mlp, norm, position, embeddings, biases, dropout;
  plan::Parallel par;
  std::string recompute = "none";
  std::string cp_comm = "ring";
  bool distributed_optimizer = false;
  std::string precision = "bf16", grad_precision = "fp32";
  std::string gpu_memory;
  // hardware: rates as text ("700TFLOPs", or a bare number in the unit the option's name says)
  plan::Hardware hw;
  std::string gemm, attention, peak, hbm, tp_link, dp_link;
  std::string attention_kernel = "cudnn";
  int gpus_per_node = 0;
  double tp_latency_us = 5, dp_latency_us = 10;
  std::string vet;
  // search
  int search_gpus = 0, top = 5;
  std::string memory_margin = "10%";
  // ckpt
  IntervalArgs ckpt;
};

std::string pct(double f) { return std::isfinite(f) ? fmt::format("{:.1f}%", 100 * f) : "-"; }
std::string num(double v) { return std::isfinite(v) ? format_number(v) : "inf"; }

int bytes_of(const std::string& precision, const char* option) {
  if (precision == "bf16" || precision == "fp16") return 2;
  if (precision == "fp32") return 4;
  if (precision == "fp8") return 1;
  usage_error(fmt::format("{} '{}': expected bf16, fp16, fp32 or fp8", option, precision));
}

double duration(const std::string& text, const char* option) {
  auto d = parse_duration(text);
  if (!d) usage_error(fmt::format("{} '{}': {}", option, text, d.error().message));
  return *d;
}

// ---------------------------------------------------------------------------------------------------------
int amdahl(const PlanArgs& a) {
  const auto r = unwrap(plan::amdahl(a.serial_fraction, a.speedup, a.gpus));
  std::string text = fmt::format("serial fraction {:.4g}{}\n", r.serial_fraction,
                                 a.speedup ? fmt::format(" (Karp-Flatt, from a speedup of {} on {} GPUs)", num(*a.speedup), num(a.gpus)) : "");
  text += fmt::format("on {} GPUs: speedup {}, efficiency {}\n", num(r.n), num(r.speedup), pct(r.efficiency));
  text += fmt::format("no number of GPUs gives more than {}x; efficiency falls to 50% at {} GPUs\n", num(r.max_speedup),
                      num(r.n_for_half_efficiency));
  print(plan::to_json(r, a.speedup.has_value()), a.json, text);
  return 0;
}

int scaling(const PlanArgs& a) {
  if (a.mode != "strong" && a.mode != "weak") usage_error(fmt::format("--mode '{}': expected strong or weak", a.mode));
  const auto mode = a.mode == "strong" ? plan::ScalingMode::kStrong : plan::ScalingMode::kWeak;
  const auto r = unwrap(plan::analyse_scaling(unwrap(plan::read_scaling_csv(a.file)), mode, a.predict));
  Table t({{"GPUS", true}, {"THROUGHPUT", true}, {"STEP TIME", true}, {"EFFICIENCY", true}, {"KARP-FLATT", true}});
  for (const auto& p : r.points) {
    t.add_row({num(p.gpus), p.throughput > 0 ? num(p.throughput) : "-", p.step_time_s > 0 ? format_duration(p.step_time_s) : "-",
               pct(p.efficiency), std::isfinite(p.karp_flatt) ? fmt::format("{:.4f}", p.karp_flatt) : "-"});
  }
  Table pt({{"PREDICT GPUS", true}, {"EFFICIENCY", true}, {"RANGE (2 SE)", true}, {"NOTE"}});
  for (const auto& p : r.predictions) {
    pt.add_row({num(p.gpus), pct(p.efficiency),
                std::isfinite(p.efficiency_low) ? fmt::format("{} - {}", pct(p.efficiency_low), pct(p.efficiency_high)) : "unknown",
                p.extrapolated_far ? "far beyond the data" : ""});
  }
  std::string text = t.render();
  text += fmt::format("fitted serial/communication fraction {:.4f} (standard error {}), {} model ({})\n", r.serial_fraction,
                      std::isfinite(r.serial_fraction_stderr) ? fmt::format("{:.4f}", r.serial_fraction_stderr) : "unknown",
                      a.mode == "strong" ? "Amdahl" : "Gustafson", a.mode == "strong" ? "fixed total work" : "fixed work per GPU");
  text += pt.render();
  for (const auto& w : r.warnings) text += "warning: " + w + "\n";
  print(plan::to_json(r, a.file), a.json, text);
  return 0;
}

int pipeline(const PlanArgs& a) {
  Schedule s = Schedule::k1f1b;
  if (a.schedule == "gpipe") s = Schedule::kGpipe;
  else if (a.schedule == "interleaved") s = Schedule::kInterleaved;
  else if (a.schedule != "1f1b") usage_error(fmt::format("--schedule '{}': expected gpipe, 1f1b or interleaved", a.schedule));
  const auto layers = unwrap(plan::read_layers_csv(a.file));
  const auto r = unwrap(plan::plan_pipeline(layers, a.stages, a.microbatches, s, a.chunks));
  std::vector<Table::Column> cols = {{"STAGE", true}, {"LAYERS"}, {"PER MICRO-BATCH", true}, {"BY COUNT", true}};
  if (r.has_memory) cols.push_back({"MEMORY", true});
  Table t(cols);
  for (int i = 0; i < r.stages; ++i) {
    const auto& st = r.optimal.stages[i];
    std::string span;
    if (r.optimal.chunk_bounds.empty()) {
      span = st.layer_count == 1 ? layers[st.first_layer].name
                                 : fmt::format("{}..{}", layers[st.first_layer].name, layers[st.first_layer + st.layer_count - 1].name);
    } else {
      span = fmt::format("{} layers in {} chunks", st.layer_count, r.chunks);
    }
    std::vector<std::string> row = {std::to_string(i), span, format_duration(st.time_s), format_duration(r.by_count.stages[i].time_s)};
    if (r.has_memory) row.push_back(format_bytes(st.memory_bytes));
    t.add_row(row);
  }
  std::string text = t.render();
  text += fmt::format("step {} with a {} bubble ({} schedule, {} micro-batches); splitting by layer count: {} ({} bubble)\n",
                      format_duration(r.optimal.step_time_s), pct(r.optimal.bubble_fraction), a.schedule, r.microbatches,
                      format_duration(r.by_count.step_time_s), pct(r.by_count.bubble_fraction));
  text += fmt::format("OK: the balanced partition is {} faster than splitting by layer count\n", pct(r.gain));
  print(plan::to_json(r, a.file, layers.size()), a.json, text);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------
// The model, parallel and hardware options are shared by memory, comm, step and search.
void add_model_options(CLI::App* c, PlanArgs& a) {
  c->add_option("--model", a.model_preset, "A model preset (gpt3-175b, llama3-70b, ...; docs/plan.md): flags override it");
  c->add_option("--layers", a.flags.layers, "Transformer layers");
  c->add_option("--hidden", a.flags.hidden, "Hidden size");
  c->add_option("--heads", a.flags.heads, "Attention heads");
  c->add_option("--kv-heads", a.flags.kv_heads, "Key/value heads (grouped-query: fewer than --heads; 1: multi-query)");
  c->add_option("--seq", a.flags.seq, "Sequence length");
  c->add_option("--vocab", a.flags.vocab, "Vocabulary size");
  c->add_option("--vocab-multiple", a.flags.vocab_multiple, "Pad the vocabulary to a multiple of this (Megatron: 128 x tp)");
  c->add_option("--ffn", a.flags.ffn, "MLP width (default 4 x hidden); for SwiGLU the width of each of gate and up");
  c->add_option("--mlp", a.mlp, "gelu (two matrices) or swiglu (gate, up, down)");
  c->add_option("--norm", a.norm, "layernorm or rmsnorm");
  c->add_option("--position", a.position, "learned (s x h parameters) or rope");
  c->add_option("--embeddings", a.embeddings, "tied or untied (a separate output layer)");
  c->add_option("--biases", a.biases, "on or off: biases in the linear layers");
  c->add_option("--dropout", a.dropout, "on or off: dropout masks kept for backward");
  c->add_option("--experts", a.flags.experts, "Experts per MoE layer (0: dense)");
  c->add_option("--top-k", a.flags.top_k, "Experts each token is routed to");
  c->add_option("--expert-ffn", a.flags.expert_ffn, "MLP width of one expert (default --ffn)");
  c->add_option("--shared-experts", a.flags.shared_experts, "Experts every token goes through");
  c->add_option("--dense-layers", a.flags.dense_layers, "First layers that keep a dense MLP");
  c->add_option("--capacity-factor", a.flags.capacity_factor, "Expert capacity over the balanced share (0: dropless)");
  c->add_option("--tp", a.par.tp, "Tensor-parallel size")->capture_default_str();
  c->add_option("--pp", a.par.pp, "Pipeline-parallel size")->capture_default_str();
  c->add_option("--dp", a.par.dp, "Data-parallel size")->capture_default_str();
  c->add_option("--cp", a.par.cp, "Context-parallel size (needs --flash-attention)")->capture_default_str();
  c->add_option("--cp-comm", a.cp_comm,
                "How context parallelism moves K and V: ring (overlapped with the attention, Megatron-Core) or allgather (before it, exposed: Llama 3)")
      ->capture_default_str();
  c->add_option("--ep", a.par.ep, "Expert-parallel size (divides --dp and --experts)")->capture_default_str();
  c->add_option("--micro-batch", a.par.micro_batch, "Sequences per micro-batch")->capture_default_str();
  c->add_option("--global-batch", a.par.global_batch, "Sequences per step (default micro-batch x dp)");
  c->add_option("--interleave", a.par.interleave, "Virtual pipeline chunks per device")->capture_default_str();
  c->add_flag("--uneven-stages", a.par.uneven_stages,
              "Pipeline stages of unequal layer counts (Llama 3: fewer on the first and last); timed by the heaviest");
  c->add_flag("--sequence-parallel", a.par.sequence_parallel, "Sequence parallelism in the tensor-parallel group");
  c->add_flag("--tp-overlap", a.par.tp_comm_overlap,
              "Tensor-parallel collectives overlapped with their GEMMs (Transformer Engine userbuffers; needs --sequence-parallel)");
  c->add_flag("--flash-attention", a.par.flash_attention,
              "Fused attention (FlashAttention, cuDNN): no scores in memory, causal half skipped");
  c->add_option("--recompute", a.recompute, "Activation recomputation: none, selective or full")->capture_default_str();
  c->add_option("--zero", a.par.zero_stage, "ZeRO stage 0-3 for the model states")->capture_default_str();
  c->add_flag("--distributed-optimizer", a.distributed_optimizer, "Megatron's distributed optimizer (ZeRO stage 1)");
  c->add_option("--precision", a.precision, "Activation precision: bf16, fp16, fp32, fp8")->capture_default_str();
  c->add_option("--grad-precision", a.grad_precision, "Precision of the data-parallel gradient reduction")->capture_default_str();
}

void add_gpu_option(CLI::App* c, PlanArgs& a) {
  c->add_option("--gpu", a.gpu_preset, "A GPU preset (a100-80g, h100-sxm, h200, gh200, b200): rates, memory, links");
}

void add_hardware_options(CLI::App* c, PlanArgs& a) {
  add_gpu_option(c, a);
  c->add_option("--gemm-tflops", a.gemm, "Measured GEMM throughput of one GPU: 700TFLOPs (a bare number is TFLOP/s)");
  c->add_option("--attention-tflops", a.attention,
                "Measured rate of the fused attention kernel on the blocks it runs (default: --gemm-tflops)");
  c->add_option("--attention-kernel", a.attention_kernel,
                "Which fused attention the --gpu preset's rate is for: cudnn, or flash2 (FlashAttention-2, what "
                "Transformer Engine runs with NVTE_FUSED_ATTN=0)")
      ->capture_default_str();
  c->add_option("--peak-tflops", a.peak, "Datasheet dense peak of one GPU, for MFU: 989TFLOPs");
  c->add_option("--hbm-gbps", a.hbm, "Device memory bandwidth: 4.8TB/s (a bare number is GB/s)");
  c->add_option("--tp-gbps", a.tp_link, "Tensor-parallel link bus bandwidth per GPU: 325GB/s");
  c->add_option("--dp-gbps", a.dp_link, "Network bus bandwidth per GPU (data and pipeline parallel): 45GB/s or 400Gb/s");
  c->add_option("--gpus-per-node", a.gpus_per_node, "GPUs sharing NVLink (tp, cp and ep groups inside use --tp-gbps)");
  c->add_option("--tp-latency-us", a.tp_latency_us, "Latency per step of a tensor-parallel collective")->capture_default_str();
  c->add_option("--dp-latency-us", a.dp_latency_us, "Latency per step of a network collective")->capture_default_str();
  c->add_flag("--overlap-dp", a.hw.overlap_dp, "Gradient reduction overlapped with the last backward");
  c->add_option("--from-vet,--vet", a.vet, "A `pacer vet --json` report: its measured figures instead of the preset's");
}

bool given(const PlanArgs& a, const char* option) { return a.command && a.command->count(option) > 0; }

bool choice(const std::string& text, const char* option, const char* yes, const char* no, bool current) {
  if (text.empty()) return current;
  if (text == yes) return true;
  if (text == no) return false;
  usage_error(fmt::format("{} '{}': expected {} or {}", option, text, yes, no));
}

// The model: the preset (if any), then every model flag given.
void resolve_model(PlanArgs& a) {
  plan::Model m;
  if (!a.model_preset.empty()) m = unwrap(plan::find_model_preset(a.model_preset)).model;
  const plan::Model& f = a.flags;
  const std::pair<const char*, int plan::Model::*> ints[] = {
      {"--layers", &plan::Model::layers},       {"--hidden", &plan::Model::hidden},
      {"--heads", &plan::Model::heads},         {"--kv-heads", &plan::Model::kv_heads},
      {"--seq", &plan::Model::seq},             {"--vocab", &plan::Model::vocab},
      {"--vocab-multiple", &plan::Model::vocab_multiple}, {"--ffn", &plan::Model::ffn},
      {"--experts", &plan::Model::experts},     {"--top-k", &plan::Model::top_k},
      {"--expert-ffn", &plan::Model::expert_ffn}, {"--shared-experts", &plan::Model::shared_experts},
      {"--dense-layers", &plan::Model::dense_layers}};
  for (const auto& [option, field] : ints)
    if (given(a, option)) m.*field = f.*field;
  if (given(a, "--capacity-factor")) m.capacity_factor = f.capacity_factor;
  m.gated_mlp = choice(a.mlp, "--mlp", "swiglu", "gelu", m.gated_mlp);
  m.rms_norm = choice(a.norm, "--norm", "rmsnorm", "layernorm", m.rms_norm);
  m.learned_positions = choice(a.position, "--position", "learned", "rope", m.learned_positions);
  m.tied_embeddings = choice(a.embeddings, "--embeddings", "tied", "untied", m.tied_embeddings);
  m.biases = choice(a.biases, "--biases", "on", "off", m.biases);
  m.dropout = choice(a.dropout, "--dropout", "on", "off", m.dropout);
  for (auto [v, option] : {std::pair{m.layers, "--layers"}, {m.hidden, "--hidden"}, {m.heads, "--heads"},
                           {m.seq, "--seq"}, {m.vocab, "--vocab"}})
    if (v == 0) {
      std::string names;
      for (const auto& p : plan::model_presets()) names += (names.empty() ? "" : ", ") + p.name;
      usage_error(fmt::format("{}: give it, or --model NAME ({})", option, names));
    }
  a.model = m;
}

// Resolves the transformer options into a model and parallel layout; throws a usage error when impossible.
void resolve_transformer(PlanArgs& a, bool validate = true) {
  resolve_model(a);
  if (a.recompute == "none") a.par.recompute = Recompute::kNone;
  else if (a.recompute == "selective") a.par.recompute = Recompute::kSelective;
  else if (a.recompute == "full") a.par.recompute = Recompute::kFull;
  else usage_error(fmt::format("--recompute '{}': expected none, selective or full", a.recompute));
  if (a.cp_comm == "ring") a.par.cp_comm = plan::CpComm::kRing;
  else if (a.cp_comm == "allgather") a.par.cp_comm = plan::CpComm::kAllGather;
  else usage_error(fmt::format("--cp-comm '{}': expected ring or allgather", a.cp_comm));
  if (a.distributed_optimizer) {
    if (a.par.zero_stage > 1) usage_error("--distributed-optimizer is ZeRO stage 1; do not combine it with --zero 2 or 3");
    a.par.zero_stage = 1;
  }
  a.par.act_bytes = bytes_of(a.precision, "--precision");
  a.par.grad_bytes = bytes_of(a.grad_precision, "--grad-precision");
  if (validate) unwrap(plan::validate(a.model, a.par));
}

// A rate option: a number with a unit, or a bare number in the unit the option's name carries.
std::optional<double> rate(const std::string& text, const char* option, bool flops) {
  if (text.empty()) return std::nullopt;
  double bare = 0;
  const char* end = text.data() + text.size();
  if (auto [ptr, ec] = std::from_chars(text.data(), end, bare); ec == std::errc() && ptr == end) {
    if (!(bare > 0) || !std::isfinite(bare)) usage_error(fmt::format("{} '{}': expected a positive rate", option, text));
    return bare;
  }
  auto v = flops ? parse_flop_rate(text) : parse_bandwidth(text);
  if (!v) usage_error(fmt::format("{}: {}", option, v.error().message));
  if (!(*v > 0)) usage_error(fmt::format("{} '{}': expected a positive rate", option, text));
  return *v / (flops ? 1e12 : 1e9);
}

// The GPU preset, if any, or nullopt.
std::optional<plan::GpuPreset> gpu_preset(const PlanArgs& a) {
  if (a.gpu_preset.empty()) return std::nullopt;
  return unwrap(plan::find_gpu_preset(a.gpu_preset));
}

// Hardware figures: the command line, else the vet report, else the --gpu preset; returns where each came from.
plan::HardwareSources resolve_hardware(PlanArgs& a) {
  const auto preset = gpu_preset(a);
  const bool overlap = a.hw.overlap_dp;
  if (preset) a.hw = preset->hw;
  const bool flash2 = a.attention_kernel == "flash2";
  if (!flash2 && a.attention_kernel != "cudnn")
    usage_error(fmt::format("--attention-kernel '{}': expected cudnn or flash2", a.attention_kernel));
  if (flash2 && !a.par.flash_attention) usage_error("--attention-kernel flash2 is a fused kernel: give --flash-attention");
  if (flash2 && a.attention.empty()) {
    if (!preset || !(preset->flash2_attention_tflops > 0))
      usage_error(fmt::format("--attention-kernel flash2: no measured FlashAttention-2 rate for {}; give --attention-tflops",
                              preset ? "--gpu " + preset->name : "a GPU without --gpu"));
    a.hw.attention_tflops = preset->flash2_attention_tflops;
  }
  if (!a.par.flash_attention) a.hw.attention_tflops = 0;  // the preset's fused-kernel rate has nothing to time
  a.hw.overlap_dp = overlap;
  a.hw.tp_latency_s = a.tp_latency_us * 1e-6;
  a.hw.dp_latency_s = a.dp_latency_us * 1e-6;
  if (given(a, "--gpus-per-node")) a.hw.gpus_per_node = a.gpus_per_node;
  plan::HardwareSources sources;
  std::optional<plan::Calibration> cal;
  if (!a.vet.empty()) cal = unwrap(plan::read_vet_report(a.vet));
  auto fill = [&](double& field, const std::string& text, const char* option, bool flops, const char* key, const char* check) {
    if (auto v = rate(text, option, flops)) {
      field = *v;
      sources[key] = "command line";
    } else if (cal && check && plan::figure(*cal, check)) {
      field = *plan::figure(*cal, check);
      sources[key] = fmt::format("{} ({})", check, a.vet);
    } else if (preset && field > 0) {
      sources[key] = fmt::format("preset {}", preset->name);
    }
  };
  fill(a.hw.gemm_tflops, a.gemm, "--gemm-tflops", true, "gemm_tflops", "gpu.gemm_bf16");
  fill(a.hw.attention_tflops, a.attention, "--attention-tflops", true, "attention_tflops", nullptr);
  if (flash2 && a.attention.empty()) sources["attention_tflops"] += " (FlashAttention-2)";
  fill(a.hw.peak_tflops, a.peak, "--peak-tflops", true, "peak_tflops", nullptr);
  fill(a.hw.hbm_gbps, a.hbm, "--hbm-gbps", false, "hbm_gbps", "gpu.hbm_bandwidth");
  fill(a.hw.tp_gbps, a.tp_link, "--tp-gbps", false, "tp_gbps", "gpu.nccl_busbw");
  fill(a.hw.dp_gbps, a.dp_link, "--dp-gbps", false, "dp_gbps", "network.busbw_gbps");
  return sources;
}

// Memory of one GPU: --gpu-memory (with a unit), else the --gpu preset's.
std::optional<std::uint64_t> gpu_memory(const PlanArgs& a) {
  if (!a.gpu_memory.empty()) {
    auto cap = parse_size_with_unit(a.gpu_memory);
    if (!cap) usage_error(fmt::format("--gpu-memory: {}", cap.error().message));
    if (*cap == 0) usage_error(fmt::format("--gpu-memory '{}': expected a size such as 80GiB", a.gpu_memory));
    return *cap;
  }
  if (auto preset = gpu_preset(a)) return static_cast<std::uint64_t>(preset->memory_bytes);
  return std::nullopt;
}

int memory(PlanArgs& a) {
  resolve_transformer(a);
  const auto r = plan::estimate_memory(a.model, a.par);
  Table t({{"WHAT"}, {"PER GPU", true}, {"HOW"}});
  t.add_row({"parameters", fmt::format("{:.3g}", r.parameters), "first pipeline stage, embeddings included"});
  t.add_row({"weights", format_bytes(r.weight_bytes), a.par.zero_stage >= 3 ? "2 B/param, sharded over dp" : "2 B/param"});
  t.add_row({"gradients", format_bytes(r.gradient_bytes),
             fmt::format("{} B/param ({}){}", a.par.grad_bytes, a.grad_precision, a.par.zero_stage >= 2 ? ", sharded over dp" : "")});
  t.add_row({"optimizer", format_bytes(r.optimizer_bytes), a.par.zero_stage >= 1 ? "12 B/param (Adam), sharded over dp" : "12 B/param (Adam)"});
  t.add_row({"activations", format_bytes(r.activation_bytes),
             fmt::format("{} per layer x {} layers x {} micro-batches in flight", format_bytes(r.activation_bytes_per_layer),
                         num(r.stage_layers), num(r.in_flight_microbatches))});
  t.add_row({"total", format_bytes(r.total_bytes), "before fragmentation, workspaces and the CUDA context"});
  std::string text = t.render();
  text += fmt::format("model: {:.3g} parameters; recomputation {}{}{}\n", plan::parameter_count(a.model), a.recompute,
                      a.par.sequence_parallel ? ", sequence parallel" : "", a.par.flash_attention ? ", fused attention" : "");
  int rc = 0;
  const std::optional<std::uint64_t> cap = gpu_memory(a);
  if (cap) {
    const bool fits = r.total_bytes <= double(*cap);
    text += fmt::format("{}: {} needed of {} per GPU\n", fits ? "OK" : "FAILED", format_bytes(r.total_bytes), format_bytes(double(*cap)));
    rc = fits ? 0 : 1;
  }
  print(plan::to_json(r, a.model, a.par, cap), a.json, text);
  return rc;
}

int comm(PlanArgs& a) {
  resolve_transformer(a);
  const auto sources = resolve_hardware(a);
  const auto r = unwrap(plan::estimate_comm(a.model, a.par, a.hw));
  Table t({{"TRAFFIC"}, {"BYTES/GPU/STEP", true}, {"TIME", true}, {"OVER"}});
  t.add_row({"data parallel", format_bytes(r.dp_bytes), format_duration(r.dp_time_s),
             a.par.zero_stage >= 1 ? "reduce-scatter + all-gather" : "all-reduce"});
  t.add_row({"tensor parallel", format_bytes(r.tp_bytes), format_duration(r.tp_time_s),
             a.par.sequence_parallel ? "all-gather + reduce-scatter" : "all-reduce"});
  t.add_row({"pipeline", format_bytes(r.pp_bytes), format_duration(r.pp_time_s), "send/recv to the next stage"});
  if (a.par.cp > 1) t.add_row({"context parallel", format_bytes(r.cp_bytes), format_duration(r.cp_time_s),
                                   a.par.cp_comm == plan::CpComm::kRing ? "ring of keys and values (before overlap)"
                                                                        : "all-gather of keys and values, reduce-scatter of their gradients"});
  if (a.par.ep > 1) t.add_row({"expert parallel", format_bytes(r.ep_bytes), format_duration(r.ep_time_s), "all-to-all dispatch and combine"});
  std::string text = t.render();
  if (a.hw.gemm_tflops > 0 && r.dp_time_s > 0)
    text += fmt::format("hiding the gradient reduction takes {:.3g} FLOP of backward per GPU; the last micro-batch has {:.3g}, enough to hide {} of it at {} TFLOP/s\n",
                        r.dp_hide_flops, r.backward_flops, pct(r.dp_hidden_fraction), num(a.hw.gemm_tflops));
  print(plan::to_json(r, a.model, a.par, sources), a.json, text);
  return 0;
}

int step(PlanArgs& a) {
  resolve_transformer(a);
  const auto sources = resolve_hardware(a);
  const auto r = unwrap(plan::estimate_step(a.model, a.par, a.hw));
  Table t({{"PART"}, {"TIME", true}, {"SHARE", true}});
  for (auto [name, v] : {std::pair{"matrix compute (GEMM)", r.gemm_s}, {"memory-bound kernels", r.elementwise_s},
                         {"tensor-parallel comm", r.tp_comm_s}, {"pipeline send/recv", r.pp_comm_s},
                         {"context-parallel comm", r.cp_comm_s}, {"expert all-to-all", r.ep_comm_s},
                         {"pipeline bubble", r.bubble_s}, {"data-parallel comm", r.dp_comm_s}, {"optimizer", r.optimizer_s}}) {
    // Context and expert parallelism show only where they are used, so that a dense model's table stays short.
    if ((name == std::string("context-parallel comm") && a.par.cp == 1) || (name == std::string("expert all-to-all") && a.par.ep == 1))
      continue;
    t.add_row({name, format_duration(v), pct(v / r.step_s)});
  }
  std::string text = t.render();
  text += fmt::format("step {} for {} micro-batches per pipeline: {:.3g} tokens/s, {} TFLOP/s model per GPU ({} with recomputation)",
                      format_duration(r.step_s), r.microbatches, r.tokens_per_s, num(r.model_tflops_per_gpu),
                      num(r.hardware_tflops_per_gpu));
  if (a.hw.peak_tflops > 0) text += fmt::format(", MFU {}", pct(r.mfu));
  text += "\n";
  print(plan::to_json(r, a.model, a.par, a.hw, sources), a.json, text);
  return 0;
}

// The margin left free: "10%" of the GPU's memory, or a size such as 4GiB.
double margin_bytes(const std::string& text, double memory) {
  if (!text.empty() && text.back() == '%') {
    double v = 0;
    const char* end = text.data() + text.size() - 1;
    auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (ec != std::errc() || ptr != end || !(v >= 0) || !(v < 100))
      usage_error(fmt::format("--memory-margin '{}': expected a share from 0% to 99%, or a size such as 4GiB", text));
    return memory * v / 100;
  }
  auto size = parse_size_with_unit(text);
  if (!size) usage_error(fmt::format("--memory-margin: {} (or a share such as 10%)", size.error().message));
  return double(*size);
}

std::string layout_name(const plan::Parallel& p) {
  return fmt::format("tp {} pp {} cp {} ep {} dp {}", p.tp, p.pp, p.cp, p.ep, p.dp);
}

const char* recompute_name(Recompute r) {
  return r == Recompute::kNone ? "none" : r == Recompute::kSelective ? "selective" : "full";
}

int search(PlanArgs& a) {
  if (given(a, "--dp")) usage_error("--dp: the search derives it from --gpus (dp = gpus / (tp x pp x cp))");
  if (a.search_gpus < 1) usage_error("--gpus: give the number of GPUs to lay the model out on");
  resolve_transformer(a, false);
  if (a.par.global_batch < 1) usage_error("--global-batch: give the sequences per step");
  a.par.flash_attention = true;  // every current framework runs a fused attention kernel; context parallelism needs it
  const auto sources = resolve_hardware(a);
  plan::SearchSpace space;
  space.gpus = a.search_gpus;
  space.global_batch = a.par.global_batch;
  const auto cap = gpu_memory(a);
  if (!cap) usage_error("--gpu-memory: give the memory of one GPU (141GB, 80GiB) or --gpu NAME");
  space.memory_bytes = double(*cap);
  space.margin_bytes = margin_bytes(a.memory_margin, space.memory_bytes);
  space.top = a.top;
  // A layout option given fixes that dimension; the others are searched.
  const std::pair<const char*, std::pair<std::vector<int>*, int>> fixed[] = {
      {"--tp", {&space.tp, a.par.tp}}, {"--pp", {&space.pp, a.par.pp}}, {"--cp", {&space.cp, a.par.cp}},
      {"--ep", {&space.ep, a.par.ep}}, {"--micro-batch", {&space.micro_batch, a.par.micro_batch}},
      {"--interleave", {&space.interleave, a.par.interleave}}, {"--zero", {&space.zero_stage, a.par.zero_stage}}};
  for (const auto& [option, target] : fixed)
    if (given(a, option)) *target.first = {target.second};
  if (a.distributed_optimizer) space.zero_stage = {1};
  if (given(a, "--recompute")) space.recompute = {a.par.recompute};
  const auto r = unwrap(plan::search_layouts(a.model, a.par, a.hw, space));
  Table t({{"#", true}, {"TP", true}, {"PP", true}, {"CP", true}, {"EP", true}, {"DP", true}, {"MB", true}, {"V", true},
           {"RECOMPUTE"}, {"ZERO", true}, {"MEMORY", true}, {"STEP", true}, {"MFU", true}, {"VS BEST", true}, {"WHY SLOWER"}});
  for (std::size_t i = 0; i < r.top.size(); ++i) {
    const auto& c = r.top[i];
    const auto& p = c.layout;
    std::string why;
    for (const auto& [part, sec] : c.losses) why += fmt::format("{}{} +{}", why.empty() ? "" : ", ", part, format_duration(sec));
    t.add_row({std::to_string(i + 1), std::to_string(p.tp), std::to_string(p.pp), std::to_string(p.cp), std::to_string(p.ep),
               std::to_string(p.dp), std::to_string(p.micro_batch), std::to_string(p.interleave), recompute_name(p.recompute),
               std::to_string(p.zero_stage), format_bytes(c.memory.total_bytes), format_duration(c.step.step_s),
               a.hw.peak_tflops > 0 ? pct(c.step.mfu) : "-", i == 0 ? "-" : "+" + pct(c.step.step_s / r.top[0].step.step_s - 1),
               i == 0 ? "" : why});
  }
  std::string text = r.top.empty() ? "" : t.render();
  const std::string room = fmt::format("{} less a {} margin", format_bytes(space.memory_bytes), format_bytes(space.margin_bytes));
  int rc = 0;
  if (r.top.empty()) {
    text += fmt::format("FAILED: none of {} layouts fits in {}; the smallest needs {}\n", r.evaluated, room,
                        format_bytes(r.best_memory_bytes));
    rc = 1;
  } else {
    const auto& best = r.top[0];
    text += fmt::format("OK: {} of {} layouts fit in {}; best {}: {:.3g} tokens/s, {} TFLOP/s model per GPU\n", r.fitting,
                        r.evaluated, room, layout_name(best.layout), best.step.tokens_per_s, num(best.step.model_tflops_per_gpu));
  }
  nlohmann::json j = plan::to_json(r, a.model, a.hw, space);
  j["hardware_sources"] = sources;
  print(j, a.json, text);
  return rc;
}

int ckpt(PlanArgs& a) {
  a.ckpt.json = a.json;
  return print_interval(a.ckpt, "pacer.plan.ckpt/1");
}

}  // namespace

int print_interval(const IntervalArgs& a, const std::string& schema) {
  plan::CkptInput in;
  if (!a.save_cost.empty()) in.save_cost_s = duration(a.save_cost, "--save-cost");
  std::string save_from = "given";
  if (a.nodes < 0) usage_error(fmt::format("--nodes {}: expected a positive count", a.nodes));
  if (!a.ckpt_size.empty()) {
    if (!a.save_cost.empty()) usage_error("give --save-cost or --ckpt-size, not both");
    auto size = parse_size(a.ckpt_size);
    if (!size || *size == 0) usage_error(fmt::format("--ckpt-size '{}': expected a size such as 2TB", a.ckpt_size));
    double rate = a.write_mbps;
    if (!(rate > 0) && !a.vet.empty()) {
      if (auto f = plan::figure(unwrap(plan::read_vet_report(a.vet)), "storage.write")) rate = *f;
    }
    if (!(rate > 0)) usage_error("--ckpt-size needs --write-mbps or a --vet report with storage.write");
    // Every node writes its share in parallel at the rate one node measured.
    in.save_cost_s = double(*size) / (rate * 1e6 * std::max(1, a.nodes));
    save_from = fmt::format("{} at {} MB/s per node on {} node(s)", format_bytes(double(*size)), num(rate), std::max(1, a.nodes));
  }
  if (in.save_cost_s <= 0) usage_error("give --save-cost (or --ckpt-size with --write-mbps or --vet)");
  in.restart_cost_s = duration(a.restart_cost, "--restart-cost");
  if (!a.mtbf.empty() && !a.node_mtbf.empty()) usage_error("give --mtbf (of the job) or --node-mtbf with --nodes, not both");
  if (!a.mtbf.empty()) in.mtbf_s = duration(a.mtbf, "--mtbf");
  else if (!a.node_mtbf.empty()) {
    if (a.nodes < 1) usage_error("--node-mtbf needs --nodes");
    in.mtbf_s = plan::job_mtbf_s(duration(a.node_mtbf, "--node-mtbf"), a.nodes);
  } else usage_error("give --mtbf or --node-mtbf with --nodes");
  if (!a.campaign.empty()) in.campaign_s = duration(a.campaign, "--campaign");
  if (!a.interval.empty()) in.current_interval_s = duration(a.interval, "--interval");
  if (!a.write_time.empty()) in.write_time_s = duration(a.write_time, "--write-time");
  const auto r = unwrap(plan::plan_ckpt(in));
  std::string text = fmt::format("job MTBF {}, save {}, restart {}\n", format_duration(in.mtbf_s), format_duration(in.save_cost_s),
                                 format_duration(in.restart_cost_s));
  if (r.interval_s > r.daly_interval_s) {
    text += fmt::format("checkpoint every {} (the write time; Daly's {} is shorter, and a save started sooner waits for the "
                        "last): {} of the time lost to saves, rework and restarts\n",
                        format_duration(r.interval_s), format_duration(r.daly_interval_s), pct(r.lost_fraction));
  } else {
    text += fmt::format("checkpoint every {} (Daly; Young: {}): {} of the time lost to saves, rework and restarts\n",
                        format_duration(r.daly_interval_s), format_duration(r.young_interval_s), pct(r.lost_fraction));
  }
  if (in.current_interval_s > 0) {
    text += fmt::format("at the current {} interval: {} lost\n", format_duration(in.current_interval_s), pct(r.lost_fraction_current));
  }
  if (in.campaign_s > 0) {
    text += fmt::format("over {}: {:.3g} failures expected, {} chance of at least one\n", format_duration(in.campaign_s),
                        r.expected_failures, r.p_any_failure > 0.999 ? "a >99.9%" : "a " + pct(r.p_any_failure));
  }
  nlohmann::json j = plan::to_json(r, in, save_from);
  if (schema != "pacer.plan.ckpt/1") j["schema"] = schema;
  print(j, a.json, text);
  return 0;
}


void add_interval_options(CLI::App* ck, IntervalArgs& a) {
  ck->add_option("--save-cost", a.save_cost, "Time one save stalls training, e.g. 40s");
  ck->add_option("--ckpt-size", a.ckpt_size, "Checkpoint size, e.g. 2TB (save cost from the write rate)");
  ck->add_option("--write-mbps", a.write_mbps, "Write rate of one node, MB/s");
  ck->add_option("--restart-cost", a.restart_cost, "From a failure to training again, e.g. 10m")->capture_default_str();
  ck->add_option("--mtbf", a.mtbf, "Mean time between failures of the whole job, e.g. 8h");
  ck->add_option("--node-mtbf", a.node_mtbf, "Mean time between failures of one node, e.g. 1000d");
  ck->add_option("--nodes", a.nodes, "Nodes in the job");
  ck->add_option("--campaign", a.campaign, "Length of the training campaign, e.g. 30d");
  ck->add_option("--interval", a.interval, "The interval in use now, to compare");
  ck->add_option("--write-time", a.write_time,
                 "How long a save takes to become durable in the background, e.g. 15s (the interval is never shorter)");
  ck->add_option("--vet", a.vet, "A `pacer vet --json` report (storage.write)");
}

Handler register_plan(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("plan", "Arithmetic before the allocation: scaling, pipeline, memory, comm, checkpoints, step time");
  cmd->require_subcommand(1);
  cmd->footer("Exit codes: 0 ok, 1 the configuration does not fit (memory --gpu-memory; search: no layout fits), 2 bad input. See docs/plan.md.");
  auto sub = [&](const char* name, const char* help, int (*fn)(PlanArgs&)) {
    CLI::App* s = cmd->add_subcommand(name, help);
    s->add_flag("--json", args->json, "Machine-readable output");
    s->callback([args, handler, fn, s] {
      args->command = s;
      *handler = [args, fn] { return fn(*args); };
    });
    return s;
  };
  auto* am = sub("amdahl", "Speedup limits from a serial fraction, or the fraction a measured speedup implies",
                 [](PlanArgs& a) { return amdahl(a); });
  am->add_option("--serial-fraction", args->serial_fraction, "Share of the work that does not parallelise, 0-1");
  am->add_option("--speedup", args->speedup, "Measured speedup on --gpus (gives the Karp-Flatt serial fraction)");
  am->add_option("--gpus", args->gpus, "Worker count")->required();

  auto* sc = sub("scaling", "Efficiency per point, the fitted serial fraction and predictions from measured points",
                 [](PlanArgs& a) { return scaling(a); });
  sc->add_option("file", args->file, "CSV with columns gpus and throughput or step_time_s")->required();
  sc->add_option("--mode", args->mode, "strong (fixed total work) or weak (fixed work per GPU)")->capture_default_str();
  sc->add_option("--predict", args->predict, "GPU counts to predict (default 2x, 4x, 8x the largest)");

  auto* pp = sub("pipeline", "Balanced pipeline stages from measured per-layer times", [](PlanArgs& a) { return pipeline(a); });
  pp->add_option("file", args->file, "CSV with columns time_ms and optionally layer, memory_mb")->required();
  pp->add_option("--stages", args->stages, "Pipeline stages")->required();
  pp->add_option("--microbatches", args->microbatches, "Micro-batches per step")->required();
  pp->add_option("--schedule", args->schedule, "gpipe, 1f1b or interleaved")->capture_default_str();
  pp->add_option("--chunks", args->chunks, "Model chunks per device (interleaved)")->capture_default_str();

  auto* me = sub("memory", "Parameters, gradients, optimizer states and activations per GPU", [](PlanArgs& a) { return memory(a); });
  add_model_options(me, *args);
  add_gpu_option(me, *args);
  me->add_option("--gpu-memory", args->gpu_memory, "GPU memory with a unit, e.g. 80GiB or 141GB (default: the --gpu preset's): exit 1 when the estimate does not fit");

  auto* co = sub("comm", "Bytes and time of data-, tensor- and pipeline-parallel traffic per step", [](PlanArgs& a) { return comm(a); });
  add_model_options(co, *args);
  add_hardware_options(co, *args);

  auto* st = sub("step", "Step time of a transformer configuration, its breakdown and MFU", [](PlanArgs& a) { return step(a); });
  add_model_options(st, *args);
  add_hardware_options(st, *args);

  auto* se = sub("search", "The fastest tp/pp/dp/cp/ep/micro-batch/interleave/recompute/ZeRO layouts that fit in memory",
                 [](PlanArgs& a) { return search(a); });
  add_model_options(se, *args);
  add_hardware_options(se, *args);
  se->add_option("--gpus", args->search_gpus, "GPUs to lay the model out on")->required();
  se->add_option("--gpu-memory", args->gpu_memory, "GPU memory with a unit (default: the --gpu preset's)");
  se->add_option("--memory-margin", args->memory_margin, "Memory kept free: a share (10%) or a size (4GiB)")->capture_default_str();
  se->add_option("--top", args->top, "Layouts to print")->capture_default_str();

  auto* ck = sub("ckpt", "Optimal checkpoint interval, time lost and the odds of failure", [](PlanArgs& a) { return ckpt(a); });
  add_interval_options(ck, args->ckpt);
  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
