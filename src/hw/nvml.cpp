#include "pacer/hw/nvml.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <vector>

namespace pacer::hw {

// The few NVML prototypes pacer uses, declared here so that no NVML header or
// library is needed at build time. Handles are opaque pointers; enums are ints.
namespace {
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
struct nvmlMemory_t {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
// The v2 query separates memory the driver reserves for itself, which v1
// counts as used (about 600 MiB on an idle H200 that nvidia-smi shows as 0).
struct nvmlMemory_v2_t {
  unsigned int version;
  unsigned long long total;
  unsigned long long reserved;
  unsigned long long free;
  unsigned long long used;
};
constexpr unsigned kMemoryV2Version = static_cast<unsigned>(sizeof(nvmlMemory_v2_t)) | (2u << 24);
constexpr nvmlReturn_t kSuccess = 0;
constexpr nvmlReturn_t kInsufficientSize = 7;
constexpr int kTemperatureGpu = 0;
constexpr int kMemoryErrorUncorrected = 1;
constexpr int kVolatileEcc = 0;
constexpr int kAggregateEcc = 1;
constexpr int kClockSm = 1;
}  // namespace

struct Nvml::Api {
  void* handle = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*device_get_count)(unsigned*) = nullptr;
  nvmlReturn_t (*device_get_handle_by_index)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*device_get_name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_temperature)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_memory_info)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*device_get_memory_info_v2)(nvmlDevice_t, nvmlMemory_v2_t*) = nullptr;
  nvmlReturn_t (*device_get_compute_processes)(nvmlDevice_t, unsigned*, void*) = nullptr;
  nvmlReturn_t (*device_get_total_ecc_errors)(nvmlDevice_t, int, int, unsigned long long*) = nullptr;
  nvmlReturn_t (*device_get_remapped_rows)(nvmlDevice_t, unsigned*, unsigned*, unsigned*, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_clock_event_reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*device_get_curr_pcie_gen)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_max_pcie_gen)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_curr_pcie_width)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_max_pcie_width)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_power_usage)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_clock_info)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*device_get_max_clock_info)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*system_get_driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*system_get_cuda_driver_version)(int*) = nullptr;

  std::string message(nvmlReturn_t rc) const {
    return error_string ? error_string(rc) : fmt::format("NVML error {}", rc);
  }
};

namespace {

template <class Fn>
void bind(void* handle, Fn& fn, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (void* sym = ::dlsym(handle, name)) {
      fn = reinterpret_cast<Fn>(sym);
      return;
    }
  }
}

template <class T, class Fn, class... Args>
std::optional<T> get(Fn fn, Args... args) {
  if (!fn) return std::nullopt;
  T value{};
  if (fn(args..., &value) != kSuccess) return std::nullopt;
  return value;
}

}  // namespace

std::string clock_event_names(std::uint64_t mask) {
  static const std::pair<std::uint64_t, const char*> kNames[] = {
      {kClockEventGpuIdle, "gpu_idle"},         {kClockEventApplicationsClocks, "applications_clocks"},
      {kClockEventSwPowerCap, "sw_power_cap"},  {kClockEventHwSlowdown, "hw_slowdown"},
      {kClockEventSyncBoost, "sync_boost"},     {kClockEventSwThermal, "sw_thermal"},
      {kClockEventHwThermal, "hw_thermal"},     {kClockEventHwPowerBrake, "hw_power_brake"},
      {kClockEventDisplayClocks, "display_clocks"}};
  std::string out;
  for (const auto& [bit, name] : kNames) {
    if (mask & bit) out += (out.empty() ? "" : ",") + std::string(name);
  }
  return out.empty() ? "none" : out;
}

Nvml::Nvml(std::unique_ptr<Api> api) : api_(std::move(api)) {}

Nvml::~Nvml() {
  if (api_->shutdown) api_->shutdown();
  if (api_->handle) ::dlclose(api_->handle);
}

Expected<std::shared_ptr<Nvml>> Nvml::open() {
  auto api = std::make_unique<Api>();
  api->handle = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!api->handle) return Error{ErrorKind::kIo, "no NVIDIA driver (libnvidia-ml.so.1 not found)"};
  void* h = api->handle;
  bind(h, api->init, {"nvmlInit_v2", "nvmlInit"});
  bind(h, api->shutdown, {"nvmlShutdown"});
  bind(h, api->error_string, {"nvmlErrorString"});
  bind(h, api->device_get_count, {"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"});
  bind(h, api->device_get_handle_by_index, {"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"});
  bind(h, api->device_get_name, {"nvmlDeviceGetName"});
  bind(h, api->device_get_uuid, {"nvmlDeviceGetUUID"});
  bind(h, api->device_get_temperature, {"nvmlDeviceGetTemperature"});
  bind(h, api->device_get_memory_info, {"nvmlDeviceGetMemoryInfo"});
  bind(h, api->device_get_memory_info_v2, {"nvmlDeviceGetMemoryInfo_v2"});
  bind(h, api->device_get_compute_processes,
       {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses"});
  bind(h, api->device_get_total_ecc_errors, {"nvmlDeviceGetTotalEccErrors"});
  bind(h, api->device_get_remapped_rows, {"nvmlDeviceGetRemappedRows"});
  bind(h, api->device_get_clock_event_reasons,
       {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"});
  bind(h, api->device_get_curr_pcie_gen, {"nvmlDeviceGetCurrPcieLinkGeneration"});
  bind(h, api->device_get_max_pcie_gen, {"nvmlDeviceGetMaxPcieLinkGeneration"});
  bind(h, api->device_get_curr_pcie_width, {"nvmlDeviceGetCurrPcieLinkWidth"});
  bind(h, api->device_get_max_pcie_width, {"nvmlDeviceGetMaxPcieLinkWidth"});
  bind(h, api->device_get_power_usage, {"nvmlDeviceGetPowerUsage"});
  bind(h, api->device_get_clock_info, {"nvmlDeviceGetClockInfo"});
  bind(h, api->device_get_max_clock_info, {"nvmlDeviceGetMaxClockInfo"});
  bind(h, api->system_get_driver_version, {"nvmlSystemGetDriverVersion"});
  bind(h, api->system_get_cuda_driver_version, {"nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"});

  if (!api->init || !api->device_get_count || !api->device_get_handle_by_index) {
    ::dlclose(h);
    return Error{ErrorKind::kIo, "no NVIDIA driver (libnvidia-ml.so.1 lacks nvmlInit)"};
  }
  if (const nvmlReturn_t rc = api->init(); rc != kSuccess) {
    const std::string why = api->message(rc);
    ::dlclose(h);
    return Error{ErrorKind::kIo, fmt::format("no NVIDIA driver (nvmlInit: {})", why)};
  }
  return std::shared_ptr<Nvml>(new Nvml(std::move(api)));
}

Expected<unsigned> Nvml::device_count() const {
  unsigned n = 0;
  if (const nvmlReturn_t rc = api_->device_get_count(&n); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("nvmlDeviceGetCount: {}", api_->message(rc))};
  return n;
}

Expected<GpuInfo> Nvml::query(unsigned index) const {
  nvmlDevice_t dev = nullptr;
  if (const nvmlReturn_t rc = api_->device_get_handle_by_index(index, &dev); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlDeviceGetHandleByIndex: {}", index, api_->message(rc))};
  const Api& a = *api_;
  GpuInfo g;
  g.index = index;
  char buf[256] = {};
  if (a.device_get_name && a.device_get_name(dev, buf, sizeof(buf)) == kSuccess) g.name = buf;
  buf[0] = 0;
  if (a.device_get_uuid && a.device_get_uuid(dev, buf, sizeof(buf)) == kSuccess) g.uuid = buf;
  g.temperature_c = get<unsigned>(a.device_get_temperature, dev, kTemperatureGpu);
  nvmlMemory_v2_t m2{};
  m2.version = kMemoryV2Version;
  if (a.device_get_memory_info_v2 && a.device_get_memory_info_v2(dev, &m2) == kSuccess) {
    g.memory_total = m2.total;
    g.memory_used = m2.used;
  } else if (a.device_get_memory_info) {
    nvmlMemory_t m{};
    if (a.device_get_memory_info(dev, &m) == kSuccess) {
      g.memory_total = m.total;
      g.memory_used = m.used;
    }
  }
  if (a.device_get_compute_processes) {
    // Asking with no buffer returns the count (and "insufficient size" when
    // there are any), which is all vet needs.
    unsigned count = 0;
    const nvmlReturn_t rc = a.device_get_compute_processes(dev, &count, nullptr);
    if (rc == kSuccess || rc == kInsufficientSize) g.compute_processes = count;
  }
  if (a.device_get_total_ecc_errors) {
    unsigned long long n = 0;
    if (a.device_get_total_ecc_errors(dev, kMemoryErrorUncorrected, kVolatileEcc, &n) == kSuccess)
      g.ecc_volatile_uncorrected = n;
    if (a.device_get_total_ecc_errors(dev, kMemoryErrorUncorrected, kAggregateEcc, &n) == kSuccess)
      g.ecc_aggregate_uncorrected = n;
  }
  if (a.device_get_remapped_rows) {
    unsigned corr = 0, unc = 0, pending = 0, failed = 0;
    if (a.device_get_remapped_rows(dev, &corr, &unc, &pending, &failed) == kSuccess) {
      g.remapped_rows_uncorrectable = unc;
      g.remap_pending = pending != 0;
      g.remap_failed = failed != 0;
    }
  }
  if (auto r = get<unsigned long long>(a.device_get_clock_event_reasons, dev)) g.clock_event_reasons = *r;
  g.pcie_gen = get<unsigned>(a.device_get_curr_pcie_gen, dev);
  g.pcie_gen_max = get<unsigned>(a.device_get_max_pcie_gen, dev);
  g.pcie_width = get<unsigned>(a.device_get_curr_pcie_width, dev);
  g.pcie_width_max = get<unsigned>(a.device_get_max_pcie_width, dev);
  g.power_mw = get<unsigned>(a.device_get_power_usage, dev);
  g.sm_clock_mhz = get<unsigned>(a.device_get_clock_info, dev, kClockSm);
  g.sm_clock_max_mhz = get<unsigned>(a.device_get_max_clock_info, dev, kClockSm);
  return g;
}

std::string Nvml::driver_version() const {
  char buf[96] = {};
  if (api_->system_get_driver_version && api_->system_get_driver_version(buf, sizeof(buf)) == kSuccess) return buf;
  return "";
}

std::string Nvml::cuda_driver_version() const {
  int v = 0;
  if (!api_->system_get_cuda_driver_version || api_->system_get_cuda_driver_version(&v) != kSuccess || v <= 0) return "";
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

}  // namespace pacer::hw
