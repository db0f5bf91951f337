// NVIDIA GPUs through NVML, loaded with dlopen so one binary runs with or without a driver.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

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
  Expected<GpuInfo> query(unsigned index) const;
  std::string driver_version() const;
  // The CUDA version the driver supports, as "13.0"; empty when unknown.
  std::string cuda_driver_version() const;

  struct Api;

 private:
  explicit Nvml(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

}  // namespace pacer::hw
