#include "pacer/telemetry/records.hpp"

namespace pacer::telemetry {

const std::vector<MetricDef>& metric_defs() {
  using K = MetricKind;
  // Prometheus names: base units, _total for counters, _ratio for fractions.
  static const std::vector<MetricDef> kDefs = {
      {"cpu.busy", "ratio", K::kGauge, "pacer_cpu_busy_ratio", "Fraction of CPU time not idle or in iowait (device: cpuN; none: all CPUs)"},
      {"mem.used_bytes", "bytes", K::kGauge, "pacer_memory_used_bytes", "Host memory in use (MemTotal - MemAvailable)"},
      {"mem.available_bytes", "bytes", K::kGauge, "pacer_memory_available_bytes", "Host MemAvailable"},
      {"proc.cpu_seconds", "seconds", K::kCounter, "pacer_process_cpu_seconds", "CPU time of the monitored process tree (stored rate: cores busy)"},
      {"proc.rss_bytes", "bytes", K::kGauge, "pacer_process_resident_memory_bytes", "Resident memory of the monitored process tree"},
      {"proc.read_bytes", "bytes", K::kCounter, "pacer_process_read_bytes", "Bytes the process tree read from storage"},
      {"proc.write_bytes", "bytes", K::kCounter, "pacer_process_written_bytes", "Bytes the process tree wrote to storage"},
      {"proc.count", "processes", K::kGauge, "pacer_processes", "Live processes in the monitored tree"},
      {"net.rx_bytes", "bytes", K::kCounter, "pacer_network_receive_bytes", "Bytes received per interface (/proc/net/dev)"},
      {"net.tx_bytes", "bytes", K::kCounter, "pacer_network_transmit_bytes", "Bytes sent per interface (/proc/net/dev)"},
      {"ib.rx_bytes", "bytes", K::kCounter, "pacer_infiniband_receive_bytes", "Bytes received per InfiniBand port (port_rcv_data x 4)"},
      {"ib.tx_bytes", "bytes", K::kCounter, "pacer_infiniband_transmit_bytes", "Bytes sent per InfiniBand port (port_xmit_data x 4)"},
      {"ib.errors", "errors", K::kCounter, "pacer_infiniband_errors", "Symbol errors, receive errors and link-down events per port"},
      {"disk.read_bytes", "bytes", K::kCounter, "pacer_disk_read_bytes", "Bytes read per block device (/proc/diskstats)"},
      {"disk.write_bytes", "bytes", K::kCounter, "pacer_disk_written_bytes", "Bytes written per block device (/proc/diskstats)"},
      {"disk.io_seconds", "seconds", K::kCounter, "pacer_disk_io_time_seconds", "Time with I/O in flight per block device (stored rate: busy fraction)"},
      {"gpu.util", "ratio", K::kGauge, "pacer_gpu_utilization_ratio", "Fraction of time a kernel ran (NVML utilization.gpu)"},
      {"gpu.mem_util", "ratio", K::kGauge, "pacer_gpu_memory_utilization_ratio", "Fraction of time device memory was accessed (NVML utilization.memory)"},
      {"gpu.memory_used_bytes", "bytes", K::kGauge, "pacer_gpu_memory_used_bytes", "GPU memory in use"},
      {"gpu.temperature_c", "celsius", K::kGauge, "pacer_gpu_temperature_celsius", "GPU core temperature"},
      {"gpu.power_w", "watts", K::kGauge, "pacer_gpu_power_watts", "GPU board power draw"},
      {"gpu.energy_j", "joules", K::kCounter, "pacer_gpu_energy_joules", "GPU energy since the driver loaded (stored rate: mean watts)"},
      {"gpu.sm_clock_hz", "hertz", K::kGauge, "pacer_gpu_sm_clock_hertz", "SM clock"},
      {"gpu.mem_clock_hz", "hertz", K::kGauge, "pacer_gpu_memory_clock_hertz", "Memory clock"},
      {"gpu.clock_event_reasons", "bitmask", K::kGauge, "pacer_gpu_clock_event_reasons", "NVML clock event reason bits (0x20 sw thermal, 0x40 hw thermal, 0x4 power cap, 0x8 hw slowdown)"},
      {"gpu.ecc_uncorrected", "errors", K::kGauge, "pacer_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors since the driver loaded"},
      {"gpu.remapped_rows", "rows", K::kGauge, "pacer_gpu_remapped_rows", "Rows remapped for uncorrectable errors"},
      {"gpu.remap_pending", "bool", K::kGauge, "pacer_gpu_remap_pending", "A row remap waits for a GPU reset"},
      {"gpu.processes", "processes", K::kGauge, "pacer_gpu_processes", "Processes holding a compute context"},
      {"gpu.process_memory_bytes", "bytes", K::kGauge, "pacer_gpu_process_memory_bytes", "GPU memory of one compute process (device: pid N)"},
      {"gpm.sm_util", "ratio", K::kGauge, "pacer_gpu_sm_active_ratio", "GPM: fraction of time SMs were busy"},
      {"gpm.sm_occupancy", "ratio", K::kGauge, "pacer_gpu_sm_occupancy_ratio", "GPM: resident warps over the maximum"},
      {"gpm.tensor_util", "ratio", K::kGauge, "pacer_gpu_tensor_active_ratio", "GPM: fraction of time any tensor pipe was active"},
      {"gpm.dram_bw_util", "ratio", K::kGauge, "pacer_gpu_dram_active_ratio", "GPM: DRAM bandwidth used over peak"},
      {"gpm.fp64_util", "ratio", K::kGauge, "pacer_gpu_fp64_active_ratio", "GPM: non-tensor FP64 pipe activity"},
      {"gpm.fp32_util", "ratio", K::kGauge, "pacer_gpu_fp32_active_ratio", "GPM: non-tensor FP32 pipe activity"},
      {"gpm.fp16_util", "ratio", K::kGauge, "pacer_gpu_fp16_active_ratio", "GPM: non-tensor FP16 pipe activity"},
      {"gpm.pcie_tx_bytes_per_s", "bytes/s", K::kGauge, "pacer_gpu_pcie_transmit_bytes_per_second", "GPM: PCIe bytes sent by the GPU per second"},
      {"gpm.pcie_rx_bytes_per_s", "bytes/s", K::kGauge, "pacer_gpu_pcie_receive_bytes_per_second", "GPM: PCIe bytes received by the GPU per second"},
      {"gpm.nvlink_tx_bytes_per_s", "bytes/s", K::kGauge, "pacer_gpu_nvlink_transmit_bytes_per_second", "GPM: NVLink bytes sent per second, all links"},
      {"gpm.nvlink_rx_bytes_per_s", "bytes/s", K::kGauge, "pacer_gpu_nvlink_receive_bytes_per_second", "GPM: NVLink bytes received per second, all links"},
      {"sampler.cpu_seconds", "seconds", K::kCounter, "pacer_sampler_cpu_seconds", "CPU time of the pacer monitor itself (stored rate: cores busy)"},
  };
  return kDefs;
}

const MetricDef* find_metric(std::string_view name) {
  for (const auto& d : metric_defs())
    if (d.name == name) return &d;
  return nullptr;
}

nlohmann::json to_json(const ThreadRecord& r) {
  return {{"pid", r.pid}, {"tid", r.tid}, {"comm", r.comm}, {"main", r.main}, {"python", r.python},
          {"busy", r.busy}, {"threads", r.threads}, {"busy_threads", r.busy_threads}};
}

}  // namespace pacer::telemetry
