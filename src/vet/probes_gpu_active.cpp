// Active GPU probes: GEMM throughput with a result check, HBM bandwidth, memory test, host transfers, sustained
// load watched through NVML, peer copies and NCCL all-reduce. The CUDA work lives in pacer::hw::gpu.
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "pacer/hw/gpu_bench.hpp"
#include "pacer/hw/nvml.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

namespace gpu = hw::gpu;

// Why no GPU work can run here, or nothing when devices are there.
std::optional<std::string> no_devices(int* count) {
  // CUDA numbers devices fastest first unless told otherwise; NVML (and
  // nvidia-smi) by PCI bus. Each probe runs in a fresh child, before any CUDA
  // call, so this takes effect; a user's own setting wins.
  ::setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 0);
  if (!gpu::built_with_cuda()) return "pacer was built without CUDA (nvcc not found at build time)";
  // Without a driver the runtime's own message ("driver version is
  // insufficient") misleads: say what is missing.
  if (void* h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) ::dlclose(h);
  else return "no NVIDIA driver (libcuda.so.1 not found)";
  auto n = gpu::device_count();
  if (!n) return fmt::format("no CUDA device: {}", n.error().message);
  if (*n == 0) return "no CUDA device visible";
  *count = *n;
  return std::nullopt;
}

std::vector<Measurement> skip_all(const std::vector<std::string>& checks, const std::string& why, CheckStatus status = CheckStatus::kSkip) {
  std::vector<Measurement> out;
  for (const auto& c : checks) out.push_back(not_measured(c, status, why));
  return out;
}

std::string target_of(int device) { return fmt::format("gpu{}", device); }

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<Measurement> run_gemm(const ProbeContext& ctx) {
  const std::vector<std::pair<std::string, gpu::Precision>> all = {
      {"bf16", gpu::Precision::kBf16}, {"fp16", gpu::Precision::kFp16}, {"tf32", gpu::Precision::kTf32}, {"fp64", gpu::Precision::kFp64}};
  std::vector<std::string> checks;
  for (const auto& [name, p] : all) checks.push_back("gpu.gemm_" + name);
  int devices = 0;
  if (auto why = no_devices(&devices)) return skip_all(checks, *why);
  const auto wanted = split(ctx.params.at("precisions").get<std::string>());
  gpu::GemmOptions o;
  o.m = o.n = o.k = static_cast<int>(ctx.integer("size"));
  o.seconds = ctx.seconds("seconds");
  std::vector<Measurement> out;
  for (int d = 0; d < devices; ++d)
    for (const auto& [name, p] : all) {
      const std::string check = "gpu.gemm_" + name;
      if (!ctx.wants(check)) continue;
      if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) {
        out.push_back(not_measured(check, CheckStatus::kSkip, fmt::format("not in precisions '{}'", ctx.params.at("precisions").get<std::string>()),
                                   target_of(d)));
        continue;
      }
      if (cancelled()) return out;
      auto r = gpu::gemm(d, p, o);
      if (!r) {
        out.push_back(not_measured(check, CheckStatus::kError, r.error().message, target_of(d)));
        continue;
      }
      Measurement m = measured(check, r->tflops,
                               fmt::format("{}^3 {} GEMM, cuBLASLt {}; {} entries match fp64 (worst {:.1e}, allowed {:.0e})", o.m, name,
                                           r->algorithm, r->checked, r->worst_error, r->tolerance),
                               target_of(d));
      if (r->wrong > 0) {
        m.status = CheckStatus::kFail;
        m.reason = fmt::format("silent data corruption: {} of {} checked entries differ from the fp64 reference (worst {:.2e}, allowed {:.0e})",
                               r->wrong, r->checked, r->worst_error, r->tolerance);
      }
      out.push_back(m);
    }
  return out;
}

std::vector<Measurement> run_hbm(const ProbeContext& ctx) {
  int devices = 0;
  if (auto why = no_devices(&devices)) return skip_all({"gpu.hbm_bandwidth", "gpu.memtest"}, *why);
  std::vector<Measurement> out;
  for (int d = 0; d < devices && !cancelled(); ++d) {
    if (ctx.wants("gpu.hbm_bandwidth")) {
      auto bw = gpu::hbm_bandwidth(d, ctx.bytes("bytes"), static_cast<int>(ctx.integer("passes")));
      if (bw) out.push_back(measured("gpu.hbm_bandwidth", *bw, fmt::format("copy kernel over {} MiB, read + write counted, median", ctx.bytes("bytes") >> 20), target_of(d)));
      else out.push_back(not_measured("gpu.hbm_bandwidth", CheckStatus::kError, bw.error().message, target_of(d)));
    }
    if (ctx.wants("gpu.memtest")) {
      auto mt = gpu::memtest(d, ctx.params.at("fraction").get<double>());
      if (!mt) {
        out.push_back(not_measured("gpu.memtest", CheckStatus::kError, mt.error().message, target_of(d)));
        continue;
      }
      std::string detail = fmt::format("{:.1f} GiB written with address patterns and their inverse, read back", double(mt->bytes) / (1u << 30));
      if (mt->errors) detail += "; first: " + mt->first;
      out.push_back(measured("gpu.memtest", static_cast<double>(mt->errors), detail, target_of(d)));
    }
  }
  return out;
}

std::vector<Measurement> run_transfer(const ProbeContext& ctx) {
  const std::vector<std::string> checks = {"gpu.h2d_pinned", "gpu.d2h_pinned", "gpu.h2d_pageable", "gpu.d2h_pageable"};
  int devices = 0;
  if (auto why = no_devices(&devices)) return skip_all(checks, *why);
  std::vector<Measurement> out;
  const std::uint64_t bytes = ctx.bytes("bytes");
  for (int d = 0; d < devices && !cancelled(); ++d) {
    auto r = gpu::host_transfer(d, bytes, static_cast<int>(ctx.integer("passes")));
    if (!r) {
      for (const auto& c : checks) out.push_back(not_measured(c, CheckStatus::kError, r.error().message, target_of(d)));
      continue;
    }
    const std::string how = fmt::format("{} MiB cudaMemcpy, median", bytes >> 20);
    out.push_back(measured("gpu.h2d_pinned", r->h2d_pinned, how, target_of(d)));
    out.push_back(measured("gpu.d2h_pinned", r->d2h_pinned, how, target_of(d)));
    out.push_back(measured("gpu.h2d_pageable", r->h2d_pageable, how, target_of(d)));
    out.push_back(measured("gpu.d2h_pageable", r->d2h_pageable, how, target_of(d)));
  }
  return out;
}

// Slowdowns that mean the GPU could not hold its clocks under load. The
// software power cap is left out: GEMMs routinely run at the power limit.
constexpr std::uint64_t kLoadSlowdowns = hw::kClockEventHwSlowdown | hw::kClockEventHwThermal | hw::kClockEventHwPowerBrake | hw::kClockEventSwThermal;

std::vector<Measurement> run_sustained(const ProbeContext& ctx) {
  const std::vector<std::string> checks = {"gpu.sustained_tflops", "gpu.sustained_clock", "gpu.sustained_temperature",
                                           "gpu.sustained_power", "gpu.sustained_throttle"};
  int devices = 0;
  if (auto why = no_devices(&devices)) return skip_all(checks, *why);
  auto nvml = hw::Nvml::open();
  // CUDA device d is NVML device d only when no CUDA_VISIBLE_DEVICES renumbers them.
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); nvml && v && *v)
    nvml = Error{ErrorKind::kUsage, "CUDA_VISIBLE_DEVICES renumbers the GPUs, so NVML cannot watch the one under load"};
  std::vector<Measurement> out;
  const double seconds = ctx.seconds("duration");
  for (int d = 0; d < devices && !cancelled(); ++d) {
    std::vector<double> clocks, temps, powers;
    std::uint64_t reasons = 0;
    auto watch = [&](const gpu::LoadTick&) {
      if (!nvml) return;
      auto g = (*nvml)->query(static_cast<unsigned>(d));
      if (!g) return;
      if (g->sm_clock_mhz) clocks.push_back(*g->sm_clock_mhz);
      if (g->temperature_c) temps.push_back(*g->temperature_c);
      if (g->power_mw) powers.push_back(*g->power_mw / 1000.0);
      if (g->clock_event_reasons) reasons |= *g->clock_event_reasons & kLoadSlowdowns;
    };
    auto ticks = gpu::sustained_gemm(d, seconds, 0.25, static_cast<int>(ctx.integer("size")), watch);
    if (!ticks) {
      for (const auto& c : checks) out.push_back(not_measured(c, CheckStatus::kError, ticks.error().message, target_of(d)));
      continue;
    }
    std::vector<double> tf;
    for (const auto& t : *ticks) tf.push_back(t.tflops);
    std::sort(tf.begin(), tf.end());
    const double med = tf.empty() ? 0 : tf[tf.size() / 2];
    const double low = tf.empty() ? 0 : tf.front();
    out.push_back(measured("gpu.sustained_tflops", med,
                           fmt::format("bf16 GEMM for {:.0f} s: median of {} windows, slowest {:.0f}", seconds, tf.size(), low), target_of(d)));
    auto summarize = [&](const char* check, std::vector<double> v, bool use_min, const char* what) {
      if (v.empty()) {
        out.push_back(not_measured(check, CheckStatus::kSkip, nvml ? "NVML did not report it" : nvml.error().message, target_of(d)));
        return;
      }
      std::sort(v.begin(), v.end());
      const double x = use_min ? v.front() : v.back();
      out.push_back(measured(check, x, fmt::format("{} of {} NVML samples under load (median {:.0f})", what, v.size(), v[v.size() / 2]), target_of(d)));
    };
    summarize("gpu.sustained_clock", clocks, true, "lowest SM clock");
    summarize("gpu.sustained_temperature", temps, false, "highest temperature");
    summarize("gpu.sustained_power", powers, false, "highest power draw");
    if (nvml) {
      out.push_back(measured("gpu.sustained_throttle", static_cast<double>(__builtin_popcountll(reasons)),
                             fmt::format("slowdowns seen under load: {}", hw::clock_event_names(reasons)), target_of(d)));
    } else {
      out.push_back(not_measured("gpu.sustained_throttle", CheckStatus::kSkip, nvml.error().message, target_of(d)));
    }
  }
  return out;
}

std::vector<Measurement> run_multi(const ProbeContext& ctx) {
  int devices = 0;
  if (auto why = no_devices(&devices)) return skip_all({"gpu.p2p_bandwidth", "gpu.nccl_busbw"}, *why);
  if (devices < 2) return skip_all({"gpu.p2p_bandwidth", "gpu.nccl_busbw"}, fmt::format("{} GPU: no pair to measure", devices));
  std::vector<Measurement> out;
  const std::uint64_t bytes = ctx.bytes("bytes");
  const int passes = static_cast<int>(ctx.integer("passes"));
  if (ctx.wants("gpu.p2p_bandwidth")) {
    auto peers = gpu::peer_bandwidth(bytes, passes);
    if (!peers) out.push_back(not_measured("gpu.p2p_bandwidth", CheckStatus::kError, peers.error().message));
    else
      for (const auto& p : *peers)
        out.push_back(measured("gpu.p2p_bandwidth", p.gb_per_s,
                               fmt::format("{} MiB cudaMemcpyPeer, {}", bytes >> 20, p.peer_access ? "peer access" : "no peer access: staged through the host"),
                               fmt::format("gpu{}-gpu{}", p.from, p.to)));
  }
  if (ctx.wants("gpu.nccl_busbw") && !cancelled()) {
    auto ar = gpu::nccl_all_reduce(bytes, passes);
    if (!ar) {
      out.push_back(not_measured("gpu.nccl_busbw", CheckStatus::kError, ar.error().message));
    } else {
      Measurement m = measured("gpu.nccl_busbw", ar->busbw,
                               fmt::format("fp32 sum all-reduce of {} MiB on {} GPUs, NCCL {}: algbw {:.1f} GB/s, busbw = algbw x 2(n-1)/n", ar->bytes >> 20,
                                           ar->devices, ar->nccl_version, ar->algbw));
      if (!ar->correct) {
        m.status = CheckStatus::kFail;
        m.reason = "all-reduce result is wrong";
      }
      out.push_back(m);
    }
  }
  return out;
}

}  // namespace

std::vector<ProbeSpec> gpu_active_probes() {
  auto num = [](const char* name, const char* unit, const char* help, Direction dir = Direction::kHigher) {
    return CheckSpec{name, "gpu", unit, ValueKind::kNumber, dir, help};
  };
  std::vector<ProbeSpec> v;
  v.push_back({"gpu.gemm",
               {num("gpu.gemm_bf16", "TFLOP/s", "bf16 GEMM through cuBLASLt, result checked against fp64"),
                num("gpu.gemm_fp16", "TFLOP/s", "fp16 GEMM through cuBLASLt, result checked against fp64"),
                num("gpu.gemm_tf32", "TFLOP/s", "fp32 GEMM on TF32 tensor cores, result checked against fp64"),
                num("gpu.gemm_fp64", "TFLOP/s", "fp64 GEMM, result checked against an fp64 dot product")},
               {{"size", ParamType::kInteger, 8192, 4096, "m = n = k"},
                {"seconds", ParamType::kDuration, "1s", "200ms", "timed time per precision"},
                {"precisions", ParamType::kString, "bf16,fp16,tf32,fp64", "bf16", "which GEMMs run (others skip)"}},
               "", false, 120, 30, run_gemm});
  v.push_back({"gpu.hbm",
               {num("gpu.hbm_bandwidth", "GB/s", "device memory bandwidth of a copy kernel (read + write)"),
                num("gpu.memtest", "errors", "device memory words that read back wrong", Direction::kNone)},
               {{"bytes", ParamType::kSize, "4GiB", "1GiB", "copy size"},
                {"passes", ParamType::kInteger, 20, 5, "timed copies"},
                {"fraction", ParamType::kNumber, 0.5, 0.05, "fraction of free device memory the memory test covers"}},
               "", false, 120, 30, run_hbm});
  v.push_back({"gpu.transfer",
               {num("gpu.h2d_pinned", "GB/s", "host to device from page-locked memory"),
                num("gpu.d2h_pinned", "GB/s", "device to host into page-locked memory"),
                num("gpu.h2d_pageable", "GB/s", "host to device from ordinary memory"),
                num("gpu.d2h_pageable", "GB/s", "device to host into ordinary memory")},
               {{"bytes", ParamType::kSize, "256MiB", "64MiB", "copy size"}, {"passes", ParamType::kInteger, 11, 3, "timed copies"}},
               "", false, 60, 20, run_transfer});
  v.push_back({"gpu.sustained",
               {num("gpu.sustained_tflops", "TFLOP/s", "bf16 GEMM throughput held under sustained load (median window)"),
                num("gpu.sustained_clock", "MHz", "lowest SM clock under sustained load"),
                num("gpu.sustained_temperature", "C", "highest temperature under sustained load", Direction::kLower),
                num("gpu.sustained_power", "W", "highest power draw under sustained load", Direction::kNone),
                num("gpu.sustained_throttle", "reasons", "thermal or power slowdowns seen under load", Direction::kNone)},
               {{"duration", ParamType::kDuration, "30s", "3s", "load time per GPU"}, {"size", ParamType::kInteger, 8192, 4096, "GEMM m = n = k"}},
               "", false, 300, 30, run_sustained});
  v.push_back({"gpu.multi",
               {num("gpu.p2p_bandwidth", "GB/s", "peer-to-peer copy bandwidth for every ordered pair of GPUs"),
                num("gpu.nccl_busbw", "GB/s", "NCCL all-reduce bus bandwidth across the node's GPUs (nccl-tests' busbw)")},
               {{"bytes", ParamType::kSize, "1GiB", "256MiB", "bytes per copy and per all-reduce"}, {"passes", ParamType::kInteger, 10, 3, "timed runs"}},
               "", false, 180, 60, run_multi});
  return v;
}

}  // namespace pacer::vet
