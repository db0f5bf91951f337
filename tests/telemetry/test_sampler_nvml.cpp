// The sampler against tests/telemetry/fake_nvml.cpp (LD_LIBRARY_PATH points
// the sampler's dlopen of libnvidia-ml.so.1 at it; see tests/CMakeLists.txt).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "fake_root.hpp"
#include "pacer/telemetry/sampler.hpp"

namespace pacer::telemetry {
namespace {

using pacer::test::FakeRoot;

struct FakeNvml {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  unsigned long calls(const char* name) const {
    auto fn = reinterpret_cast<unsigned long (*)(const char*)>(::dlsym(lib, "fake_nvml_calls"));
    return fn ? fn(name) : ~0ul;
  }
  void reset() const {
    if (auto fn = reinterpret_cast<void (*)()>(::dlsym(lib, "fake_nvml_reset"))) fn();
  }
};

std::shared_ptr<hw::Nvml> open_fake() {
  auto nvml = hw::Nvml::open();
  EXPECT_TRUE(nvml.has_value()) << (nvml ? "" : nvml.error().message);
  if (!nvml) return nullptr;
  EXPECT_EQ((*nvml)->driver_version(), "580.00-fake") << "not the fake NVML: check LD_LIBRARY_PATH";
  return *nvml;
}

TEST(SamplerNvml, TenHertzReadsSlowFieldsOnTheirSchedule) {
  auto nvml = open_fake();
  ASSERT_TRUE(nvml);
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .gpus = true, .per_core = false, .nvml = nvml});
  ASSERT_EQ(sampler.gpus().size(), 2u);
  const FakeNvml fake;
  ASSERT_TRUE(fake.lib);
  fake.reset();
  // 100 passes at 10 Hz: 10 s. Small jitter either side of each tick.
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const Sample s = sampler.sample(1000.0 + 0.1 * i + ((i % 2) ? 0.003 : -0.003));
    for (const auto& r : s.readings) {
      EXPECT_TRUE(std::isfinite(r.value)) << r.metric->name;
      seen.insert(std::string(r.metric->name));
    }
  }
  const unsigned long gpus = 2;
  // Fast fields every pass on every GPU.
  EXPECT_EQ(fake.calls("nvmlDeviceGetUtilizationRates"), 100 * gpus);
  EXPECT_EQ(fake.calls("nvmlDeviceGetPowerUsage"), 100 * gpus);
  EXPECT_EQ(fake.calls("nvmlDeviceGetCurrentClocksEventReasons"), 100 * gpus);
  // Handles were looked up when NVML was opened, never per pass.
  EXPECT_EQ(fake.calls("nvmlDeviceGetHandleByIndex_v2"), 0u);
  // Temperature and GPM once a second (10 s), the process list and energy
  // every 5 s, ECC every 10 s: the first pass reads everything.
  EXPECT_EQ(fake.calls("nvmlDeviceGetTemperature"), 10 * gpus);
  EXPECT_EQ(fake.calls("nvmlGpmSampleGet"), 10 * gpus);
  EXPECT_EQ(fake.calls("nvmlGpmMetricsGet"), 9 * gpus);  // the first sample is no interval
  EXPECT_EQ(fake.calls("nvmlDeviceGetTotalEnergyConsumption"), 2 * gpus);
  EXPECT_EQ(fake.calls("nvmlDeviceGetComputeRunningProcesses_v2"), 2 * 2 * gpus);  // count, then list
  EXPECT_EQ(fake.calls("nvmlDeviceGetTotalEccErrors"), 1 * 2 * gpus);  // volatile and aggregate
  for (const char* m : {"gpu.util", "gpu.temperature_c", "gpu.energy_j", "gpu.process_memory_bytes",
                        "gpu.ecc_uncorrected", "gpm.sm_util", "gpm.tensor_util"})
    EXPECT_TRUE(seen.count(m)) << m;
  // NaN from GPM is left out; unsupported metrics too.
  EXPECT_FALSE(seen.count("gpm.nvlink_tx_bytes_per_s"));
  EXPECT_FALSE(seen.count("gpm.pcie_tx_bytes_per_s"));
}

TEST(SamplerNvml, EnergyRateIsOverTheTimeSinceItWasLastRead) {
  auto nvml = open_fake();
  ASSERT_TRUE(nvml);
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .gpus = true, .per_core = false, .nvml = nvml});
  // The fake's energy counter grows 1 J per read (shared by both GPUs, so 2 J
  // between two reads of one GPU); read every 5 s: 0.4 W, not 2 J per 1 s pass.
  std::vector<double> rates;
  for (int i = 0; i <= 10; ++i)
    for (const auto& r : sampler.sample(2000.0 + i).readings)
      if (r.metric->name == std::string_view("gpu.energy_j") && r.gpu == 0) rates.push_back(r.value);
  ASSERT_EQ(rates.size(), 2u);
  for (double w : rates) EXPECT_DOUBLE_EQ(w, 0.4);
}

}  // namespace
}  // namespace pacer::telemetry
