// Grace Hopper probes: nvidia_uvm's HMM setting and the NVLink-C2C bandwidth between Grace and Hopper memory.
#include <fmt/format.h>

#include "pacer/hw/gpu_bench.hpp"
#include "pacer/hw/gpu_errors.hpp"
#include "pacer/hw/nvml.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

std::vector<Measurement> run_hmm(const ProbeContext&) {
  auto hmm = hw::read_uvm_hmm(vet_root());
  if (!hmm) return {not_measured("gpu.hmm", CheckStatus::kSkip, hmm.error().message)};
  return {measured_text("gpu.hmm", *hmm, "nvidia_uvm uvm_disable_hmm; HMM lets GPUs fault on ordinary host memory")};
}

// A GH200's GPU reaches Grace's memory over NVLink-C2C, not PCIe: the host
// copies of the transfer probe, measured on those GPUs only.
std::vector<Measurement> run_c2c(const ProbeContext& ctx) {
  auto nvml = hw::Nvml::open();
  if (!nvml) return {not_measured("gpu.c2c_bandwidth", CheckStatus::kSkip, nvml.error().message)};
  auto count = (*nvml)->device_count();
  if (!count || *count == 0) return {not_measured("gpu.c2c_bandwidth", CheckStatus::kSkip, "no GPU visible")};
  std::vector<unsigned> grace;
  std::string other;
  for (unsigned i = 0; i < *count; ++i) {
    auto g = (*nvml)->query(i);
    if (g && g->name.find("GH200") != std::string::npos) grace.push_back(i);
    else if (g && other.empty()) other = g->name;
  }
  if (grace.empty())
    return {not_measured("gpu.c2c_bandwidth", CheckStatus::kSkip,
                         fmt::format("no GH200 ({}): the GPUs reach host memory over PCIe (gpu.h2d_pinned)", other.empty() ? "?" : other))};
  nvml->reset();  // CUDA numbering below; NVML is not needed any more
  ::setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 0);
  std::vector<Measurement> out;
  if (!hw::gpu::built_with_cuda()) {
    for (unsigned d : grace)
      out.push_back(not_measured("gpu.c2c_bandwidth", CheckStatus::kSkip, "pacer was built without CUDA", fmt::format("gpu{}", d)));
    return out;
  }
  for (unsigned d : grace) {
    if (cancelled()) break;
    const std::string target = fmt::format("gpu{}", d);
    auto r = hw::gpu::host_transfer(static_cast<int>(d), ctx.bytes("bytes"), static_cast<int>(ctx.integer("passes")));
    if (!r) {
      out.push_back(not_measured("gpu.c2c_bandwidth", CheckStatus::kError, r.error().message, target));
      continue;
    }
    const double slower = std::min(r->h2d_pinned, r->d2h_pinned);
    out.push_back(measured("gpu.c2c_bandwidth", slower,
                           fmt::format("slower way of pinned copies: to GPU {:.0f}, to CPU {:.0f} GB/s", r->h2d_pinned, r->d2h_pinned), target));
  }
  return out;
}

}  // namespace

std::vector<ProbeSpec> grace_probes() {
  return {{"gpu.hmm",
           {{"gpu.hmm", "gpu", "", ValueKind::kText, Direction::kNone, "HMM in nvidia_uvm (enabled, disabled)"}},
           {}, "", false, 5, 5, run_hmm}};
}

std::vector<ProbeSpec> grace_active_probes() {
  return {{"gpu.c2c",
           {{"gpu.c2c_bandwidth", "gpu", "GB/s", ValueKind::kNumber, Direction::kHigher,
             "GH200: copies between Grace and Hopper memory over NVLink-C2C (the slower way)"}},
           {{"bytes", ParamType::kSize, "1GiB", "256MiB", "copy size"}, {"passes", ParamType::kInteger, 11, 3, "timed copies"}},
           "", false, 60, 20, run_c2c}};
}

}  // namespace pacer::vet
