// Passive GPU probe through NVML: count, health counters, slowdowns, PCIe link.
#include <fmt/format.h>

#include "pacer/hw/nvml.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

constexpr const char* kGpuChecks[] = {"gpu.count",  "gpu.name",         "gpu.temperature", "gpu.memory_used",
                                      "gpu.processes", "gpu.ecc",        "gpu.remap",       "gpu.clock_events",
                                      "gpu.pcie_width", "gpu.pcie_gen"};

// Slowdowns that mean the hardware is protecting itself; an idle GPU shows none.
constexpr std::uint64_t kBadClockEvents = hw::kClockEventHwSlowdown | hw::kClockEventHwThermal |
                                          hw::kClockEventHwPowerBrake | hw::kClockEventSwThermal;

std::vector<Measurement> run_gpu(const ProbeContext& ctx) {
  std::vector<Measurement> out;
  auto nvml = hw::Nvml::open();
  auto skip_all = [&](const std::string& why) {
    for (const char* c : kGpuChecks) out.push_back(not_measured(c, CheckStatus::kSkip, why));
    return out;
  };
  // --expect-gpus replaces the profile's expectation, 0 included (any count).
  const unsigned expected = ctx.expect_gpus ? *ctx.expect_gpus : static_cast<unsigned>(ctx.integer("expected"));
  const unsigned at_least = ctx.expect_gpus ? 0 : static_cast<unsigned>(ctx.integer("min"));
  const std::string wanted = expected ? fmt::format("{} expected", expected)
                                      : at_least ? fmt::format("at least {} expected", at_least) : "any count accepted";
  // A node that must have GPUs and shows none fails: as a prolog, a skip here
  // would admit a GPU node whose driver is broken.
  auto none_visible = [&](const std::string& why) {
    if (!expected && !at_least) return skip_all(why);
    out.push_back(not_measured("gpu.count", CheckStatus::kFail, fmt::format("{}; {} GPUs", why, wanted)));
    for (const char* c : kGpuChecks)
      if (std::string(c) != "gpu.count") out.push_back(not_measured(c, CheckStatus::kSkip, why));
    return out;
  };
  if (!nvml) return none_visible(nvml.error().message);
  auto count = (*nvml)->device_count();
  if (!count) {
    out.push_back(not_measured("gpu.count", CheckStatus::kError, count.error().message));
    return out;
  }
  if (*count == 0) return none_visible("NVIDIA driver loaded but no GPU visible");
  {
    Measurement m = measured("gpu.count", *count, wanted);
    if (expected && *count != expected) {
      m.status = CheckStatus::kFail;
      m.reason = fmt::format("{} GPUs visible, expected {}", *count, expected);
    } else if (*count < at_least) {
      m.status = CheckStatus::kFail;
      m.reason = fmt::format("{} GPUs visible, expected at least {}", *count, at_least);
    }
    out.push_back(m);
  }
  for (unsigned i = 0; i < *count; ++i) {
    const std::string target = fmt::format("gpu{}", i);
    auto info = (*nvml)->query(i);
    if (!info) {
      for (const char* c : kGpuChecks)
        if (std::string(c) != "gpu.count") out.push_back(not_measured(c, CheckStatus::kError, info.error().message, target));
      continue;
    }
    const hw::GpuInfo& g = *info;
    auto unsupported = [&](const char* check) { out.push_back(not_measured(check, CheckStatus::kSkip, "not reported by this GPU or driver", target)); };
    out.push_back(measured_text("gpu.name", g.name, g.uuid, target));
    if (g.temperature_c) out.push_back(measured("gpu.temperature", *g.temperature_c, "at idle, before any load", target));
    else unsupported("gpu.temperature");
    if (g.memory_used && g.memory_total)
      out.push_back(measured("gpu.memory_used", static_cast<double>(*g.memory_used) / 1048576.0,
                             fmt::format("of {:.0f} MiB; memory held before the job starts", static_cast<double>(*g.memory_total) / 1048576.0), target));
    else unsupported("gpu.memory_used");
    if (g.compute_processes) out.push_back(measured("gpu.processes", *g.compute_processes, "compute processes already on this GPU", target));
    else unsupported("gpu.processes");
    if (g.ecc_volatile_uncorrected)
      out.push_back(measured("gpu.ecc", static_cast<double>(*g.ecc_volatile_uncorrected),
                             fmt::format("uncorrected since driver load; {} over the board's life",
                                         g.ecc_aggregate_uncorrected ? std::to_string(*g.ecc_aggregate_uncorrected) : "?"), target));
    else out.push_back(not_measured("gpu.ecc", CheckStatus::kSkip, "ECC disabled or not supported", target));
    if (g.remap_pending) {
      Measurement m = measured("gpu.remap", g.remapped_rows_uncorrectable.value_or(0),
                               "rows remapped for uncorrectable errors", target);
      if (g.remap_failed.value_or(false)) {
        m.status = CheckStatus::kFail;
        m.reason = "a row remap failed: the GPU needs service";
      } else if (*g.remap_pending) {
        m.status = CheckStatus::kFail;
        m.reason = "a row remap is pending: the GPU needs a reset before use";
      }
      out.push_back(m);
    } else {
      unsupported("gpu.remap");
    }
    if (g.clock_event_reasons) {
      const std::uint64_t bad = *g.clock_event_reasons & kBadClockEvents;
      out.push_back(measured("gpu.clock_events", static_cast<double>(__builtin_popcountll(bad)),
                             fmt::format("active: {}", hw::clock_event_names(*g.clock_event_reasons)), target));
    } else {
      unsupported("gpu.clock_events");
    }
    if (g.pcie_width && g.pcie_width_max && *g.pcie_width_max > 0)
      out.push_back(measured("gpu.pcie_width", 100.0 * *g.pcie_width / *g.pcie_width_max,
                             fmt::format("x{} of x{}", *g.pcie_width, *g.pcie_width_max), target));
    else unsupported("gpu.pcie_width");
    if (g.pcie_gen && g.pcie_gen_max && *g.pcie_gen_max > 0)
      out.push_back(measured("gpu.pcie_gen", 100.0 * *g.pcie_gen / *g.pcie_gen_max,
                             fmt::format("gen {} of {}; idle links may train down to save power", *g.pcie_gen, *g.pcie_gen_max), target));
    else unsupported("gpu.pcie_gen");
  }
  return out;
}

}  // namespace

std::vector<ProbeSpec> gpu_probes() {
  auto num = [](const char* name, const char* unit, const char* help) {
    return CheckSpec{name, "gpu", unit, ValueKind::kNumber, Direction::kNone, help};
  };
  return {{"gpu",
           {num("gpu.count", "GPUs", "GPUs visible to NVML against the expected count"),
            CheckSpec{"gpu.name", "gpu", "", ValueKind::kText, Direction::kNone, "GPU model name"},
            num("gpu.temperature", "C", "GPU temperature at idle"),
            num("gpu.memory_used", "MiB", "GPU memory already in use (leftover processes)"),
            num("gpu.processes", "procs", "compute processes already on the GPU"),
            num("gpu.ecc", "errors", "volatile uncorrected ECC errors"),
            num("gpu.remap", "rows", "row remapping: pending or failed remaps fail"),
            num("gpu.clock_events", "reasons", "active thermal or power slowdowns (hw_slowdown, hw_thermal, hw_power_brake, sw_thermal)"),
            num("gpu.pcie_width", "%", "PCIe link width as a percentage of the maximum"),
            num("gpu.pcie_gen", "%", "PCIe link generation as a percentage of the maximum")},
           {{"expected", ParamType::kInteger, 0, 0, "GPUs expected on the node (0: any)"},
            {"min", ParamType::kInteger, 0, 0, "fewest GPUs the node must have (0: a node without GPUs passes)"}},
           "", false, 20, 10, run_gpu}};
}

}  // namespace pacer::vet
