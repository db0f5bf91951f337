// The JSON records of `pacer plan <command> --json` (schemas pacer.plan.<command>/1, docs/plan.md).
#include <cmath>

#include "pacer/plan.hpp"

namespace pacer::plan {

using nlohmann::json;

namespace {

// JSON has no infinity or NaN: such figures are null.
json jnum(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

const char* name(ScalingMode m) { return m == ScalingMode::kStrong ? "strong" : "weak"; }

const char* name(Schedule s) {
  switch (s) {
    case Schedule::kGpipe: return "gpipe";
    case Schedule::k1f1b: return "1f1b";
    case Schedule::kInterleaved: return "interleaved";
  }
  return "1f1b";
}

const char* name(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "none";
}

json stage_json(const PipelinePlan& p) {
  json stages = json::array();
  for (std::size_t i = 0; i < p.stages.size(); ++i) {
    const auto& s = p.stages[i];
    json js = {{"stage", i}, {"first_layer", s.first_layer}, {"layers", s.layer_count}, {"time_s", s.time_s},
               {"memory_bytes", s.memory_bytes}, {"in_flight", s.in_flight}};
    if (!p.chunk_bounds.empty()) js["chunk_first_layers"] = p.chunk_bounds[i];
    stages.push_back(js);
  }
  return {{"stages", stages}, {"step_time_s", p.step_time_s}, {"bubble_fraction", p.bubble_fraction},
          {"max_stage_time_s", p.max_stage_time_s}};
}

json breakdown(const StepReport& r) {
  return {{"gemm", r.gemm_s},         {"elementwise", r.elementwise_s}, {"tp_comm", r.tp_comm_s},
          {"pp_comm", r.pp_comm_s},   {"cp_comm", r.cp_comm_s},         {"ep_comm", r.ep_comm_s},
          {"bubble", r.bubble_s},     {"dp_comm", r.dp_comm_s},         {"optimizer", r.optimizer_s}};
}

}  // namespace

json to_json(const AmdahlReport& r, bool from_speedup) {
  return {{"schema", "pacer.plan.amdahl/1"},   {"serial_fraction", r.serial_fraction},
          {"gpus", r.n},                       {"speedup", r.speedup},
          {"efficiency", r.efficiency},        {"max_speedup", jnum(r.max_speedup)},
          {"gpus_at_half_efficiency", jnum(r.n_for_half_efficiency)},
          {"serial_fraction_from", from_speedup ? "measured speedup (Karp-Flatt)" : "given"}};
}

json to_json(const ScalingReport& r, const std::string& file) {
  json j = {{"schema", "pacer.plan.scaling/1"}, {"file", file}, {"mode", name(r.mode)},
            {"serial_fraction", r.serial_fraction}, {"serial_fraction_stderr", jnum(r.serial_fraction_stderr)},
            {"rms_residual", r.rms_residual}, {"points", json::array()}, {"predictions", json::array()},
            {"warnings", r.warnings}};
  for (const auto& p : r.points)
    j["points"].push_back({{"gpus", p.gpus}, {"throughput", p.throughput > 0 ? json(p.throughput) : json(nullptr)},
                           {"step_time_s", p.step_time_s > 0 ? json(p.step_time_s) : json(nullptr)},
                           {"efficiency", p.efficiency}, {"karp_flatt", jnum(p.karp_flatt)}, {"line", p.line}});
  for (const auto& p : r.predictions)
    j["predictions"].push_back({{"gpus", p.gpus}, {"efficiency", p.efficiency}, {"efficiency_low", jnum(p.efficiency_low)},
                                {"efficiency_high", jnum(p.efficiency_high)}, {"extrapolated_far", p.extrapolated_far}});
  return j;
}

json to_json(const PipelineReport& r, const std::string& file, std::size_t layers) {
  return {{"schema", "pacer.plan.pipeline/1"}, {"file", file}, {"schedule", name(r.schedule)}, {"stages", r.stages},
          {"microbatches", r.microbatches}, {"chunks", r.chunks}, {"layers", layers},
          {"optimal", stage_json(r.optimal)}, {"by_count", stage_json(r.by_count)}, {"gain", r.gain}};
}

json to_json(const Model& m, const Parallel& p) {
  json j = {{"layers", m.layers}, {"hidden", m.hidden}, {"heads", m.heads}, {"seq", m.seq}, {"vocab", m.vocab},
          {"ffn", m.ffn > 0 ? m.ffn : 4 * m.hidden}, {"parameters", parameter_count(m)},
          {"kv_heads", m.kv_heads > 0 ? m.kv_heads : m.heads}, {"mlp", m.gated_mlp ? "swiglu" : "gelu"},
          {"biases", m.biases}, {"norm", m.rms_norm ? "rmsnorm" : "layernorm"},
          {"position", m.learned_positions ? "learned" : "rope"}, {"embeddings", m.tied_embeddings ? "tied" : "untied"},
          {"dropout", m.dropout}, {"padded_vocab", padded_vocab(m)},
          {"tp", p.tp}, {"pp", p.pp}, {"dp", p.dp}, {"cp", p.cp}, {"cp_comm", p.cp_comm == CpComm::kRing ? "ring" : "allgather"}, {"ep", p.ep}, {"micro_batch", p.micro_batch},
          {"global_batch", p.global_batch > 0 ? p.global_batch : p.micro_batch * p.dp}, {"interleave", p.interleave}, {"uneven_stages", p.uneven_stages},
          {"sequence_parallel", p.sequence_parallel}, {"tp_overlap", p.tp_comm_overlap}, {"flash_attention", p.flash_attention}, {"recompute", name(p.recompute)},
          {"zero_stage", p.zero_stage}};
  if (m.experts > 0) {
    j["experts"] = m.experts;
    j["top_k"] = m.top_k;
    j["expert_ffn"] = m.expert_ffn > 0 ? m.expert_ffn : j["ffn"].get<int>();
    j["shared_experts"] = m.shared_experts;
    j["dense_layers"] = m.dense_layers;
    j["capacity_factor"] = m.capacity_factor > 0 ? json(m.capacity_factor) : json(nullptr);
    j["active_parameters"] = active_parameter_count(m);
  }
  return j;
}

json to_json(const MemoryReport& r, const Model& m, const Parallel& p, std::optional<std::uint64_t> gpu_memory_bytes) {
  json j = {{"schema", "pacer.plan.memory/1"}, {"config", to_json(m, p)},
            {"per_gpu", {{"parameters", r.parameters}, {"weight_bytes", r.weight_bytes}, {"gradient_bytes", r.gradient_bytes},
                         {"optimizer_bytes", r.optimizer_bytes}, {"activation_bytes_per_layer", r.activation_bytes_per_layer}, {"stage_layers", r.stage_layers},
                         {"in_flight_microbatches", r.in_flight_microbatches}, {"activation_bytes", r.activation_bytes},
                         {"total_bytes", r.total_bytes}}},
            {"layer_activations", json::array()}};
  for (const auto& t : layer_activations(m, p)) j["layer_activations"].push_back({{"name", t.name}, {"bytes", t.bytes}});
  if (gpu_memory_bytes) {
    j["gpu_memory_bytes"] = *gpu_memory_bytes;
    j["fits"] = r.total_bytes <= double(*gpu_memory_bytes);
  }
  return j;
}

json to_json(const CommReport& r, const Model& m, const Parallel& p, const HardwareSources& hardware_sources) {
  return {{"schema", "pacer.plan.comm/1"}, {"config", to_json(m, p)}, {"hardware_sources", hardware_sources},
          {"per_gpu_per_step", {{"dp_bytes", r.dp_bytes}, {"tp_bytes", r.tp_bytes}, {"pp_bytes", r.pp_bytes},
                                {"cp_bytes", r.cp_bytes}, {"ep_bytes", r.ep_bytes},
                                {"dp_time_s", r.dp_time_s}, {"tp_time_s", r.tp_time_s}, {"pp_time_s", r.pp_time_s},
                                {"cp_time_s", r.cp_time_s}, {"ep_time_s", r.ep_time_s},
                                {"backward_flops", r.backward_flops}, {"dp_hide_flops", r.dp_hide_flops},
                                {"dp_hidden_fraction", r.dp_hidden_fraction}}}};
}

json to_json(const StepReport& r, const Model& m, const Parallel& p, const Hardware& hw, const HardwareSources& hardware_sources) {
  const auto flops = step_flops(m, p);
  return {{"schema", "pacer.plan.step/1"}, {"config", to_json(m, p)}, {"hardware_sources", hardware_sources},
          {"hardware", {{"gemm_tflops", hw.gemm_tflops}, {"attention_tflops", hw.attention_tflops},
                        {"peak_tflops", hw.peak_tflops}, {"hbm_gbps", hw.hbm_gbps}, {"tp_gbps", hw.tp_gbps},
                        {"dp_gbps", hw.dp_gbps}, {"gpus_per_node", hw.gpus_per_node}, {"overlap_dp", hw.overlap_dp}}},
          {"microbatches", r.microbatches},
          {"breakdown_s", breakdown(r)},
          {"step_s", r.step_s}, {"tokens_per_s", r.tokens_per_s}, {"model_flops", flops.model_flops},
          {"hardware_flops", flops.hardware_flops}, {"model_tflops_per_gpu", r.model_tflops_per_gpu},
          {"hardware_tflops_per_gpu", r.hardware_tflops_per_gpu},
          {"mfu", hw.peak_tflops > 0 ? json(r.mfu) : json(nullptr)},
          {"hfu", hw.peak_tflops > 0 ? json(r.hfu) : json(nullptr)}};
}

json to_json(const SearchReport& r, const Model& m, const Hardware& hw, const SearchSpace& space) {
  json top = json::array();
  for (std::size_t i = 0; i < r.top.size(); ++i) {
    const Candidate& c = r.top[i];
    json losses = json::array();
    for (const auto& [what, s] : c.losses) losses.push_back({{"part", what}, {"seconds", s}});
    top.push_back({{"rank", i + 1}, {"config", to_json(m, c.layout)}, {"step_s", c.step.step_s},
                   {"tokens_per_s", c.step.tokens_per_s}, {"model_tflops_per_gpu", c.step.model_tflops_per_gpu},
                   {"mfu", hw.peak_tflops > 0 ? json(c.step.mfu) : json(nullptr)}, {"breakdown_s", breakdown(c.step)},
                   {"memory_bytes", c.memory.total_bytes}, {"activation_bytes", c.memory.activation_bytes},
                   {"slower_than_best", i == 0 ? 0.0 : c.step.step_s / r.top[0].step.step_s - 1}, {"losses", losses}});
  }
  return {{"schema", "pacer.plan.search/1"}, {"gpus", space.gpus}, {"global_batch", space.global_batch},
          {"gpu_memory_bytes", space.memory_bytes}, {"margin_bytes", space.margin_bytes},
          {"parameters", parameter_count(m)}, {"evaluated", r.evaluated}, {"fitting", r.fitting},
          {"smallest_memory_bytes", r.best_memory_bytes}, {"top", top}};
}

json to_json(const CkptReport& r, const CkptInput& in, const std::string& save_cost_from) {
  json j = {{"schema", "pacer.plan.ckpt/1"}, {"save_cost_s", in.save_cost_s}, {"save_cost_from", save_cost_from},
            {"restart_cost_s", in.restart_cost_s}, {"mtbf_s", in.mtbf_s}, {"young_interval_s", r.young_interval_s},
            {"daly_interval_s", r.daly_interval_s}, {"interval_s", r.interval_s}, {"lost_fraction", r.lost_fraction}};
  if (in.write_time_s > 0) j["write_time_s"] = in.write_time_s;
  if (in.current_interval_s > 0) {
    j["current_interval_s"] = in.current_interval_s;
    j["lost_fraction_current"] = r.lost_fraction_current;
  }
  if (in.campaign_s > 0) {
    j["campaign_s"] = in.campaign_s;
    j["expected_failures"] = r.expected_failures;
    j["p_any_failure"] = r.p_any_failure;
  }
  return j;
}

}  // namespace pacer::plan
