// NVIDIA GPUs through NVML, loaded with dlopen so one binary runs with or without a driver.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::hw {

// One GPU's passive state. A field is empty when this GPU or driver does not
// report it (NVML_ERROR_NOT_SUPPORTED, or a symbol the driver lacks).
struct GpuInfo {
  unsigned index = 0;
  std::string name;
  std::string uuid;
  std::optional<unsigned> temperature_c;
  std::optional<std::uint64_t> memory_total;  // bytes
  std::optional<std::uint64_t> memory_used;   // bytes
  std::optional<unsigned> compute_processes;  // processes holding a compute context
  // Uncorrected ECC errors since the driver loaded (volatile) and over the
  // board's life (aggregate); empty when ECC is off or unsupported.
  std::optional<std::uint64_t> ecc_volatile_uncorrected;
  std::optional<std::uint64_t> ecc_aggregate_uncorrected;
  // Row remapping (A100 and later): rows remapped for uncorrectable errors, a
  // remap waiting for the next GPU reset, and a remap that failed.
  std::optional<unsigned> remapped_rows_uncorrectable;
  std::optional<bool> remap_pending;
  std::optional<bool> remap_failed;
  std::optional<std::uint64_t> clock_event_reasons;  // nvmlClocksEventReason* bit mask
  std::optional<unsigned> pcie_gen;
  std::optional<unsigned> pcie_gen_max;
  std::optional<unsigned> pcie_width;
  std::optional<unsigned> pcie_width_max;
  std::optional<unsigned> power_mw;
  std::optional<unsigned> sm_clock_mhz;
  std::optional<unsigned> sm_clock_max_mhz;
  std::optional<unsigned> mem_clock_mhz;
  // nvmlDeviceGetUtilizationRates: percent of the last sample period (1/6 s
  // to 1 s, by product) in which a kernel ran / device memory was accessed.
  std::optional<unsigned> utilization_gpu_pct;
  std::optional<unsigned> utilization_memory_pct;
  std::optional<std::uint64_t> energy_mj;  // since the driver loaded (Volta and later)
};

// A process holding a compute context on a GPU.
struct GpuProcess {
  unsigned pid = 0;
  std::optional<std::uint64_t> used_memory;  // bytes; empty where the driver hides it
};

// GPM (GPU Performance Monitoring, Hopper and later) figures over the
// interval between two samples. Utilizations are fractions in [0, 1];
// bandwidths in bytes per second. Empty where this GPU does not report one.
struct GpmMetrics {
  std::optional<double> sm_util;        // fraction of time SMs were busy
  std::optional<double> sm_occupancy;   // resident warps over the maximum
  std::optional<double> tensor_util;    // any tensor pipe active
  std::optional<double> dram_bw_util;   // DRAM bandwidth used over peak
  std::optional<double> fp64_util;
  std::optional<double> fp32_util;
  std::optional<double> fp16_util;
  std::optional<double> pcie_tx_bytes_per_s;
  std::optional<double> pcie_rx_bytes_per_s;
  std::optional<double> nvlink_tx_bytes_per_s;
  std::optional<double> nvlink_rx_bytes_per_s;
};

// One NVLink of a GPU: whether it is up and its data-link error counters
// since the driver loaded (empty where the driver does not report one).
struct NvLink {
  unsigned link = 0;
  bool active = false;
  std::optional<std::uint64_t> replay;    // transmit replays
  std::optional<std::uint64_t> recovery;  // link recoveries (retraining)
  std::optional<std::uint64_t> crc;       // receive CRC errors, flit and data
};

// Pages retired for ECC errors (GPUs before Ampere; later ones remap rows).
struct RetiredPages {
  unsigned single_bit = 0;  // for repeated single-bit errors
  unsigned double_bit = 0;
  bool pending = false;     // a retirement waits for the next driver reload
};

// An Xid (the driver's error report) delivered by NVML's event API.
struct XidEvent {
  unsigned gpu = 0;  // NVML index
  unsigned long long xid = 0;  // 999: the driver did not say which
};

// Clock event reason bits as NVML defines them.
inline constexpr std::uint64_t kClockEventGpuIdle = 0x1;
inline constexpr std::uint64_t kClockEventApplicationsClocks = 0x2;
inline constexpr std::uint64_t kClockEventSwPowerCap = 0x4;
inline constexpr std::uint64_t kClockEventHwSlowdown = 0x8;
inline constexpr std::uint64_t kClockEventSyncBoost = 0x10;
inline constexpr std::uint64_t kClockEventSwThermal = 0x20;
inline constexpr std::uint64_t kClockEventHwThermal = 0x40;
inline constexpr std::uint64_t kClockEventHwPowerBrake = 0x80;
inline constexpr std::uint64_t kClockEventDisplayClocks = 0x100;

// "sw_power_cap,hw_thermal" for a reason mask; "none" for 0.
std::string clock_event_names(std::uint64_t mask);

// A loaded, initialised NVML. open() fails with a message starting
// "no NVIDIA driver" when libnvidia-ml cannot be loaded or has no GPU driver
// behind it. Calls are thread-safe (NVML is); one instance per process is
// enough. Destruction shuts NVML down and unloads the library.
class Nvml {
 public:
  static Expected<std::shared_ptr<Nvml>> open();
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  Expected<unsigned> device_count() const;
  // Scopes for samplers, each a superset of the one before it: kFast is
  // utilization, memory, power, SM clock and clock event reasons (five NVML
  // calls); kPerSecond adds temperature and memory clock; kDynamic adds the
  // compute process count and the energy counter; kAll adds what changes
  // rarely and costs most to ask (name, UUID, PCIe link, maximum clocks, ECC
  // counts, row remaps).
  enum class QueryScope { kFast, kPerSecond, kDynamic, kAll };
  Expected<GpuInfo> query(unsigned index, QueryScope scope = QueryScope::kAll) const;
  Expected<std::vector<GpuProcess>> compute_processes(unsigned index) const;
  // NVLinks of one GPU, in link order; empty when it has none (PCIe only).
  Expected<std::vector<NvLink>> nvlinks(unsigned index) const;
  // Empty when the GPU does not retire pages (Ampere and later remap rows).
  std::optional<RetiredPages> retired_pages(unsigned index) const;
  // The GPU's PCI address as sysfs names it ("0000:3b:00.0"); empty when unknown.
  std::string pci_bus_id(unsigned index) const;
  // Registers every GPU for Xid events and collects those that arrive within
  // `seconds` (blocks that long). Events before the call are not seen: NVML
  // delivers only those raised after registration. Fails (message starting
  // "Xid events not supported") on drivers or GPUs without the event API.
  Expected<std::vector<XidEvent>> watch_xid(double seconds) const;
  std::string driver_version() const;
  // The CUDA version the driver supports, as "13.0"; empty when unknown.
  std::string cuda_driver_version() const;

  struct Api;

 private:
  friend class GpmSampler;
  explicit Nvml(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

// GPM metrics of one GPU from two alternating sample buffers: each sample()
// fills the older buffer and computes the metrics between it and the newer
// one, so one NVML sample per interval suffices. Not thread-safe; one per GPU.
class GpmSampler {
 public:
  // Fails (message starting "GPM not supported") on GPUs before Hopper or
  // drivers without the GPM entry points.
  static Expected<std::unique_ptr<GpmSampler>> open(std::shared_ptr<Nvml> nvml, unsigned index);
  ~GpmSampler();
  GpmSampler(const GpmSampler&) = delete;
  GpmSampler& operator=(const GpmSampler&) = delete;
  // Empty on the first call (one sample is not an interval).
  Expected<std::optional<GpmMetrics>> sample();

 private:
  GpmSampler(std::shared_ptr<Nvml> nvml, unsigned index, void* device);
  std::shared_ptr<Nvml> nvml_;
  unsigned index_;
  void* device_;
  void* buffers_[2] = {nullptr, nullptr};
  int newest_ = -1;  // index into buffers_ of the last sample taken
};

}  // namespace pacer::hw
