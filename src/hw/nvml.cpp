#include "pacer/hw/nvml.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <iterator>
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
constexpr int kClockMem = 2;
struct nvmlUtilization_t {
  unsigned gpu;
  unsigned memory;
};
// nvmlProcessInfo_t as the _v2 and _v3 process queries fill it.
struct nvmlProcessInfo_t {
  unsigned pid;
  unsigned long long used_gpu_memory;
  unsigned gpu_instance_id;
  unsigned compute_instance_id;
};
constexpr unsigned long long kValueNotAvailable = ~0ull;

// NVLink, page retirement, PCI address and events.
constexpr unsigned kNvLinkMaxLinks = 18;  // NVML_NVLINK_MAX_LINKS
constexpr int kNvLinkErrorReplay = 0, kNvLinkErrorRecovery = 1, kNvLinkErrorCrcFlit = 2, kNvLinkErrorCrcData = 3;
constexpr int kRetireMultipleSingleBit = 0, kRetireDoubleBit = 1;
constexpr nvmlReturn_t kTimeout = 10;
constexpr unsigned long long kEventXidCriticalError = 0x8;
struct nvmlPciInfo_t {
  char bus_id_legacy[16];
  unsigned domain;
  unsigned bus;
  unsigned device;
  unsigned pci_device_id;
  unsigned pci_subsystem_id;
  char bus_id[32];
};
using nvmlEventSet_t = void*;
struct nvmlEventData_t {
  nvmlDevice_t device;
  unsigned long long event_type;
  unsigned long long event_data;  // the Xid for Xid events
  unsigned gpu_instance_id;
  unsigned compute_instance_id;
};

// GPM: a sample is an opaque handle; metrics are requested by id.
struct nvmlGpmSample_t {
  void* handle;
};
struct nvmlGpmMetric_t {
  unsigned metric_id;
  nvmlReturn_t nvml_return;
  double value;
  struct {
    char* short_name;
    char* long_name;
    char* unit;
  } info;
};
// NVML reads only the first num_metrics entries, so a shorter array than the
// header's NVML_GPM_METRIC_MAX is fine.
constexpr unsigned kGpmMaxRequested = 16;
struct nvmlGpmMetricsGet_t {
  unsigned version;
  unsigned num_metrics;
  nvmlGpmSample_t sample1;
  nvmlGpmSample_t sample2;
  nvmlGpmMetric_t metrics[kGpmMaxRequested];
};
struct nvmlGpmSupport_t {
  unsigned version;
  unsigned is_supported_device;
};
constexpr unsigned kGpmMetricsGetVersion = 1;
constexpr unsigned kGpmSupportVersion = 1;
// nvmlGpmMetricId_t values.
constexpr unsigned kGpmSmUtil = 2;
constexpr unsigned kGpmSmOccupancy = 3;
constexpr unsigned kGpmAnyTensorUtil = 5;
constexpr unsigned kGpmDramBwUtil = 10;
constexpr unsigned kGpmFp64Util = 11;
constexpr unsigned kGpmFp32Util = 12;
constexpr unsigned kGpmFp16Util = 13;
constexpr unsigned kGpmPcieTxPerSec = 20;     // MiB/s
constexpr unsigned kGpmPcieRxPerSec = 21;     // MiB/s
constexpr unsigned kGpmNvlinkRxPerSec = 60;   // MiB/s, all links
constexpr unsigned kGpmNvlinkTxPerSec = 61;   // MiB/s, all links
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
  nvmlReturn_t (*device_get_utilization_rates)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*device_get_total_energy)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*device_get_process_list)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  nvmlReturn_t (*gpm_query_device_support)(nvmlDevice_t, nvmlGpmSupport_t*) = nullptr;
  nvmlReturn_t (*gpm_sample_alloc)(nvmlGpmSample_t*) = nullptr;
  nvmlReturn_t (*gpm_sample_free)(nvmlGpmSample_t) = nullptr;
  nvmlReturn_t (*gpm_sample_get)(nvmlDevice_t, nvmlGpmSample_t) = nullptr;
  nvmlReturn_t (*gpm_metrics_get)(nvmlGpmMetricsGet_t*) = nullptr;
  nvmlReturn_t (*system_get_driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_nvlink_state)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*device_get_nvlink_error_counter)(nvmlDevice_t, unsigned, int, unsigned long long*) = nullptr;
  nvmlReturn_t (*device_get_retired_pages)(nvmlDevice_t, int, unsigned*, unsigned long long*) = nullptr;
  nvmlReturn_t (*device_get_retired_pages_pending)(nvmlDevice_t, int*) = nullptr;
  nvmlReturn_t (*device_get_pci_info)(nvmlDevice_t, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*event_set_create)(nvmlEventSet_t*) = nullptr;
  nvmlReturn_t (*device_register_events)(nvmlDevice_t, unsigned long long, nvmlEventSet_t) = nullptr;
  nvmlReturn_t (*event_set_wait)(nvmlEventSet_t, nvmlEventData_t*, unsigned) = nullptr;
  nvmlReturn_t (*event_set_free)(nvmlEventSet_t) = nullptr;
  nvmlReturn_t (*system_get_cuda_driver_version)(int*) = nullptr;

  std::string message(nvmlReturn_t rc) const {
    return error_string ? error_string(rc) : fmt::format("NVML error {}", rc);
  }
  // Handles stay valid until nvmlShutdown; they are looked up once at open()
  // so that a sampler's pass does not pay for the lookup on every GPU.
  std::vector<nvmlDevice_t> handles;
  Expected<nvmlDevice_t> device(unsigned index) const {
    if (index < handles.size() && handles[index]) return handles[index];
    nvmlDevice_t dev = nullptr;
    if (const nvmlReturn_t rc = device_get_handle_by_index(index, &dev); rc != kSuccess)
      return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlDeviceGetHandleByIndex: {}", index, message(rc))};
    return dev;
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
  bind(h, api->device_get_utilization_rates, {"nvmlDeviceGetUtilizationRates"});
  bind(h, api->device_get_total_energy, {"nvmlDeviceGetTotalEnergyConsumption"});
  // _v2 fills the 24-byte nvmlProcessInfo_t above on every driver; one CUDA
  // 12.0 header gave _v3's element an extra field, so _v3 is only a fallback.
  bind(h, api->device_get_process_list,
       {"nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses_v3"});
  bind(h, api->gpm_query_device_support, {"nvmlGpmQueryDeviceSupport"});
  bind(h, api->gpm_sample_alloc, {"nvmlGpmSampleAlloc"});
  bind(h, api->gpm_sample_free, {"nvmlGpmSampleFree"});
  bind(h, api->gpm_sample_get, {"nvmlGpmSampleGet"});
  bind(h, api->gpm_metrics_get, {"nvmlGpmMetricsGet"});
  bind(h, api->system_get_driver_version, {"nvmlSystemGetDriverVersion"});
  bind(h, api->device_get_nvlink_state, {"nvmlDeviceGetNvLinkState"});
  bind(h, api->device_get_nvlink_error_counter, {"nvmlDeviceGetNvLinkErrorCounter"});
  bind(h, api->device_get_retired_pages, {"nvmlDeviceGetRetiredPages"});
  bind(h, api->device_get_retired_pages_pending, {"nvmlDeviceGetRetiredPagesPendingStatus"});
  bind(h, api->device_get_pci_info, {"nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2"});
  bind(h, api->event_set_create, {"nvmlEventSetCreate"});
  bind(h, api->device_register_events, {"nvmlDeviceRegisterEvents"});
  // _v2 fills the GPU and compute instance ids as well; the first three
  // fields, all that is read, are the same in both.
  bind(h, api->event_set_wait, {"nvmlEventSetWait_v2", "nvmlEventSetWait"});
  bind(h, api->event_set_free, {"nvmlEventSetFree"});
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
  if (unsigned n = 0; api->device_get_count(&n) == kSuccess) {
    api->handles.assign(n, nullptr);
    for (unsigned i = 0; i < n; ++i)
      if (api->device_get_handle_by_index(i, &api->handles[i]) != kSuccess) api->handles[i] = nullptr;
  }
  return std::shared_ptr<Nvml>(new Nvml(std::move(api)));
}

Expected<unsigned> Nvml::device_count() const {
  unsigned n = 0;
  if (const nvmlReturn_t rc = api_->device_get_count(&n); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("nvmlDeviceGetCount: {}", api_->message(rc))};
  return n;
}

Expected<GpuInfo> Nvml::query(unsigned index, QueryScope scope) const {
  const bool all = scope >= QueryScope::kAll;
  const bool dynamic = scope >= QueryScope::kDynamic;
  const bool per_second = scope >= QueryScope::kPerSecond;
  auto handle = api_->device(index);
  if (!handle) return handle.error();
  nvmlDevice_t dev = *handle;
  const Api& a = *api_;
  GpuInfo g;
  g.index = index;
  char buf[256] = {};
  if (all && a.device_get_name && a.device_get_name(dev, buf, sizeof(buf)) == kSuccess) g.name = buf;
  buf[0] = 0;
  if (all && a.device_get_uuid && a.device_get_uuid(dev, buf, sizeof(buf)) == kSuccess) g.uuid = buf;
  if (per_second) g.temperature_c = get<unsigned>(a.device_get_temperature, dev, kTemperatureGpu);
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
  if (dynamic && a.device_get_compute_processes) {
    // Asking with no buffer returns the count (and "insufficient size" when
    // there are any), which is all vet needs.
    unsigned count = 0;
    const nvmlReturn_t rc = a.device_get_compute_processes(dev, &count, nullptr);
    if (rc == kSuccess || rc == kInsufficientSize) g.compute_processes = count;
  }
  if (all && a.device_get_total_ecc_errors) {
    unsigned long long n = 0;
    if (a.device_get_total_ecc_errors(dev, kMemoryErrorUncorrected, kVolatileEcc, &n) == kSuccess)
      g.ecc_volatile_uncorrected = n;
    if (a.device_get_total_ecc_errors(dev, kMemoryErrorUncorrected, kAggregateEcc, &n) == kSuccess)
      g.ecc_aggregate_uncorrected = n;
  }
  if (all && a.device_get_remapped_rows) {
    unsigned corr = 0, unc = 0, pending = 0, failed = 0;
    if (a.device_get_remapped_rows(dev, &corr, &unc, &pending, &failed) == kSuccess) {
      g.remapped_rows_uncorrectable = unc;
      g.remap_pending = pending != 0;
      g.remap_failed = failed != 0;
    }
  }
  if (auto r = get<unsigned long long>(a.device_get_clock_event_reasons, dev)) g.clock_event_reasons = *r;
  if (all) {
    g.pcie_gen = get<unsigned>(a.device_get_curr_pcie_gen, dev);
    g.pcie_gen_max = get<unsigned>(a.device_get_max_pcie_gen, dev);
    g.pcie_width = get<unsigned>(a.device_get_curr_pcie_width, dev);
    g.pcie_width_max = get<unsigned>(a.device_get_max_pcie_width, dev);
    g.sm_clock_max_mhz = get<unsigned>(a.device_get_max_clock_info, dev, kClockSm);
  }
  g.power_mw = get<unsigned>(a.device_get_power_usage, dev);
  g.sm_clock_mhz = get<unsigned>(a.device_get_clock_info, dev, kClockSm);
  if (per_second) g.mem_clock_mhz = get<unsigned>(a.device_get_clock_info, dev, kClockMem);
  if (auto u = get<nvmlUtilization_t>(a.device_get_utilization_rates, dev)) {
    g.utilization_gpu_pct = u->gpu;
    g.utilization_memory_pct = u->memory;
  }
  if (dynamic)
    if (auto e = get<unsigned long long>(a.device_get_total_energy, dev)) g.energy_mj = *e;
  return g;
}

Expected<std::vector<GpuProcess>> Nvml::compute_processes(unsigned index) const {
  const Api& a = *api_;
  if (!a.device_get_process_list) return Error{ErrorKind::kIo, "nvmlDeviceGetComputeRunningProcesses_v2/_v3 missing"};
  auto handle = a.device(index);
  if (!handle) return handle.error();
  nvmlDevice_t dev = *handle;
  // Processes may start between the size query and the fetch; retry with room to spare.
  std::vector<nvmlProcessInfo_t> buf(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    unsigned n = static_cast<unsigned>(buf.size());
    const nvmlReturn_t rc = a.device_get_process_list(dev, &n, buf.data());
    if (rc == kInsufficientSize) {
      buf.resize(n + 16);
      continue;
    }
    if (rc != kSuccess)
      return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlDeviceGetComputeRunningProcesses: {}", index, a.message(rc))};
    std::vector<GpuProcess> out;
    for (unsigned i = 0; i < n && i < buf.size(); ++i) {
      GpuProcess p;
      p.pid = buf[i].pid;
      if (buf[i].used_gpu_memory != kValueNotAvailable) p.used_memory = buf[i].used_gpu_memory;
      out.push_back(p);
    }
    return out;
  }
  return Error{ErrorKind::kIo, fmt::format("gpu {}: process list kept growing", index)};
}

GpmSampler::GpmSampler(std::shared_ptr<Nvml> nvml, unsigned index, void* device)
    : nvml_(std::move(nvml)), index_(index), device_(device) {}

GpmSampler::~GpmSampler() {
  for (void* b : buffers_)
    if (b && nvml_->api_->gpm_sample_free) nvml_->api_->gpm_sample_free(nvmlGpmSample_t{b});
}

Expected<std::unique_ptr<GpmSampler>> GpmSampler::open(std::shared_ptr<Nvml> nvml, unsigned index) {
  const Nvml::Api& a = *nvml->api_;
  if (!a.gpm_query_device_support || !a.gpm_sample_alloc || !a.gpm_sample_free || !a.gpm_sample_get ||
      !a.gpm_metrics_get)
    return Error{ErrorKind::kIo, "GPM not supported (this driver has no nvmlGpm* entry points)"};
  auto handle = a.device(index);
  if (!handle) return handle.error();
  nvmlDevice_t dev = *handle;
  nvmlGpmSupport_t support{kGpmSupportVersion, 0};
  if (const nvmlReturn_t rc = a.gpm_query_device_support(dev, &support); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("GPM not supported on gpu {} ({})", index, a.message(rc))};
  if (!support.is_supported_device)
    return Error{ErrorKind::kIo, fmt::format("GPM not supported on gpu {} (Hopper or later needed)", index)};
  std::unique_ptr<GpmSampler> s(new GpmSampler(nvml, index, dev));
  for (void*& b : s->buffers_) {
    nvmlGpmSample_t smp{nullptr};
    if (const nvmlReturn_t rc = a.gpm_sample_alloc(&smp); rc != kSuccess)
      return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlGpmSampleAlloc: {}", index, a.message(rc))};
    b = smp.handle;
  }
  return s;
}

Expected<std::optional<GpmMetrics>> GpmSampler::sample() {
  const Nvml::Api& a = *nvml_->api_;
  const int next = newest_ < 0 ? 0 : 1 - newest_;
  if (const nvmlReturn_t rc = a.gpm_sample_get(device_, nvmlGpmSample_t{buffers_[next]}); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlGpmSampleGet: {}", index_, a.message(rc))};
  const int previous = newest_;
  newest_ = next;
  if (previous < 0) return std::optional<GpmMetrics>{};
  static constexpr unsigned kIds[] = {kGpmSmUtil,       kGpmSmOccupancy,  kGpmAnyTensorUtil, kGpmDramBwUtil,
                                      kGpmFp64Util,     kGpmFp32Util,     kGpmFp16Util,      kGpmPcieTxPerSec,
                                      kGpmPcieRxPerSec, kGpmNvlinkTxPerSec, kGpmNvlinkRxPerSec};
  static_assert(std::size(kIds) <= kGpmMaxRequested);
  nvmlGpmMetricsGet_t mg{};
  mg.version = kGpmMetricsGetVersion;
  mg.num_metrics = static_cast<unsigned>(std::size(kIds));
  mg.sample1 = nvmlGpmSample_t{buffers_[previous]};
  mg.sample2 = nvmlGpmSample_t{buffers_[next]};
  for (unsigned i = 0; i < mg.num_metrics; ++i) mg.metrics[i].metric_id = kIds[i];
  if (const nvmlReturn_t rc = a.gpm_metrics_get(&mg); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("gpu {}: nvmlGpmMetricsGet: {}", index_, a.message(rc))};
  GpmMetrics m;
  constexpr double kMiB = 1024.0 * 1024.0;
  for (unsigned i = 0; i < mg.num_metrics; ++i) {
    const auto& r = mg.metrics[i];
    // NVML reports a metric it could not compute over too short an interval
    // as NaN or infinity with a success code; it is left empty instead.
    if (r.nvml_return != kSuccess || !std::isfinite(r.value)) continue;
    switch (r.metric_id) {
      case kGpmSmUtil: m.sm_util = r.value / 100.0; break;
      case kGpmSmOccupancy: m.sm_occupancy = r.value / 100.0; break;
      case kGpmAnyTensorUtil: m.tensor_util = r.value / 100.0; break;
      case kGpmDramBwUtil: m.dram_bw_util = r.value / 100.0; break;
      case kGpmFp64Util: m.fp64_util = r.value / 100.0; break;
      case kGpmFp32Util: m.fp32_util = r.value / 100.0; break;
      case kGpmFp16Util: m.fp16_util = r.value / 100.0; break;
      case kGpmPcieTxPerSec: m.pcie_tx_bytes_per_s = r.value * kMiB; break;
      case kGpmPcieRxPerSec: m.pcie_rx_bytes_per_s = r.value * kMiB; break;
      case kGpmNvlinkTxPerSec: m.nvlink_tx_bytes_per_s = r.value * kMiB; break;
      case kGpmNvlinkRxPerSec: m.nvlink_rx_bytes_per_s = r.value * kMiB; break;
      default: break;
    }
  }
  return std::optional<GpmMetrics>{m};
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

Expected<std::vector<NvLink>> Nvml::nvlinks(unsigned index) const {
  const Api& a = *api_;
  std::vector<NvLink> out;
  if (!a.device_get_nvlink_state) return out;
  auto handle = a.device(index);
  if (!handle) return handle.error();
  for (unsigned l = 0; l < kNvLinkMaxLinks; ++l) {
    int active = 0;
    // Links a GPU does not have answer "not supported" or "invalid argument".
    if (a.device_get_nvlink_state(*handle, l, &active) != kSuccess) continue;
    NvLink link;
    link.link = l;
    link.active = active != 0;
    auto counter = [&](int which) -> std::optional<std::uint64_t> {
      unsigned long long v = 0;
      if (!a.device_get_nvlink_error_counter || a.device_get_nvlink_error_counter(*handle, l, which, &v) != kSuccess)
        return std::nullopt;
      return v;
    };
    link.replay = counter(kNvLinkErrorReplay);
    link.recovery = counter(kNvLinkErrorRecovery);
    const auto flit = counter(kNvLinkErrorCrcFlit);
    const auto data = counter(kNvLinkErrorCrcData);
    if (flit || data) link.crc = flit.value_or(0) + data.value_or(0);
    out.push_back(link);
  }
  return out;
}

std::optional<RetiredPages> Nvml::retired_pages(unsigned index) const {
  const Api& a = *api_;
  if (!a.device_get_retired_pages) return std::nullopt;
  auto handle = a.device(index);
  if (!handle) return std::nullopt;
  // A zero-sized query returns the count ("insufficient size" when there are any).
  auto count = [&](int cause) -> std::optional<unsigned> {
    unsigned n = 0;
    const nvmlReturn_t rc = a.device_get_retired_pages(*handle, cause, &n, nullptr);
    if (rc != kSuccess && rc != kInsufficientSize) return std::nullopt;
    return n;
  };
  const auto sbe = count(kRetireMultipleSingleBit);
  const auto dbe = count(kRetireDoubleBit);
  if (!sbe || !dbe) return std::nullopt;
  RetiredPages r;
  r.single_bit = *sbe;
  r.double_bit = *dbe;
  int pending = 0;
  if (a.device_get_retired_pages_pending && a.device_get_retired_pages_pending(*handle, &pending) == kSuccess)
    r.pending = pending != 0;
  return r;
}

std::string Nvml::pci_bus_id(unsigned index) const {
  const Api& a = *api_;
  if (!a.device_get_pci_info) return "";
  auto handle = a.device(index);
  if (!handle) return "";
  nvmlPciInfo_t info{};
  if (a.device_get_pci_info(*handle, &info) != kSuccess) return "";
  // NVML's bus id carries an 8-digit domain; sysfs a 4-digit one, lower case.
  return fmt::format("{:04x}:{:02x}:{:02x}.0", info.domain & 0xffff, info.bus, info.device);
}

Expected<std::vector<XidEvent>> Nvml::watch_xid(double seconds) const {
  const Api& a = *api_;
  if (!a.event_set_create || !a.device_register_events || !a.event_set_wait || !a.event_set_free)
    return Error{ErrorKind::kIo, "Xid events not supported (this driver has no nvmlEventSet* entry points)"};
  nvmlEventSet_t set = nullptr;
  if (const nvmlReturn_t rc = a.event_set_create(&set); rc != kSuccess)
    return Error{ErrorKind::kIo, fmt::format("Xid events not supported (nvmlEventSetCreate: {})", a.message(rc))};
  std::vector<nvmlDevice_t> registered;
  std::string why;
  for (unsigned i = 0; i < api_->handles.size(); ++i) {
    if (!api_->handles[i]) continue;
    const nvmlReturn_t rc = a.device_register_events(api_->handles[i], kEventXidCriticalError, set);
    if (rc == kSuccess) registered.push_back(api_->handles[i]);
    else why = fmt::format("gpu {}: nvmlDeviceRegisterEvents: {}", i, a.message(rc));
  }
  std::vector<XidEvent> out;
  if (registered.empty()) {
    a.event_set_free(set);
    return Error{ErrorKind::kIo, "Xid events not supported (" + (why.empty() ? std::string("no GPU") : why) + ")"};
  }
  using clock = std::chrono::steady_clock;
  const auto end = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - clock::now()).count();
    if (left <= 0) break;
    nvmlEventData_t data{};
    const nvmlReturn_t rc = a.event_set_wait(set, &data, static_cast<unsigned>(left));
    if (rc == kTimeout) break;
    if (rc != kSuccess) {
      a.event_set_free(set);
      return Error{ErrorKind::kIo, fmt::format("nvmlEventSetWait: {}", a.message(rc))};
    }
    if (!(data.event_type & kEventXidCriticalError)) continue;
    XidEvent e;
    for (unsigned i = 0; i < api_->handles.size(); ++i)
      if (api_->handles[i] == data.device) e.gpu = i;
    e.xid = data.event_data;
    out.push_back(e);
  }
  a.event_set_free(set);
  return out;
}

}  // namespace pacer::hw
