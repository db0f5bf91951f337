// vet's gpu.count against tests/telemetry/fake_nvml.cpp: a node that must have
// GPUs fails when the driver is missing or shows none, instead of skipping.
// $PACER_FAKE_NVML_INIT makes the fake's nvmlInit fail as on a node whose
// driver is not loaded; $PACER_FAKE_NVML_GPUS hides GPUs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "pacer/vet/vet.hpp"
#include "test_util.hpp"

namespace pacer::vet {
namespace {

constexpr const char* kDriverNotLoaded = "9";  // NVML_ERROR_DRIVER_NOT_LOADED

// Sets the fake's variables for one test; the probe's child process inherits them.
struct FakeNode {
  FakeNode(const char* init_rc, const char* gpus) {
    set("PACER_FAKE_NVML_INIT", init_rc);
    set("PACER_FAKE_NVML_GPUS", gpus);
  }
  ~FakeNode() {
    ::unsetenv("PACER_FAKE_NVML_INIT");
    ::unsetenv("PACER_FAKE_NVML_GPUS");
  }
  static void set(const char* name, const char* v) {
    if (v) ::setenv(name, v, 1);
    else ::unsetenv(name);
  }
};

CheckResult gpu_count(const std::string& profile, std::optional<unsigned> expect, std::string* verdict = nullptr) {
  VetOptions o;
  o.quick = true;
  o.profile = profile;
  o.only = {"gpu.count"};
  o.expect_gpus = expect;
  auto r = run_vet(o);
  EXPECT_TRUE(r) << (r ? "" : r.error().message);
  if (!r) return {};
  EXPECT_EQ(r->checks.size(), 1u);
  if (verdict) *verdict = r->verdict();
  return r->checks.empty() ? CheckResult{} : r->checks.front();
}

TEST(VetGpuCount, MissingDriverFailsWhenGpusAreExpected) {
  FakeNode node(kDriverNotLoaded, nullptr);
  std::string verdict;
  const CheckResult c = gpu_count("h200", 8u, &verdict);
  EXPECT_EQ(c.status, CheckStatus::kFail) << c.reason;
  EXPECT_NE(c.reason.find("no NVIDIA driver"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("8 expected"), std::string::npos) << c.reason;
  EXPECT_EQ(verdict, "fail");
}

TEST(VetGpuCount, ProfileThatNeedsGpusFailsWithoutTheDriver) {
  FakeNode node(kDriverNotLoaded, nullptr);
  const CheckResult c = gpu_count("h200", std::nullopt);
  EXPECT_EQ(c.status, CheckStatus::kFail) << c.reason;
  EXPECT_NE(c.reason.find("at least 1 expected"), std::string::npos) << c.reason;
}

TEST(VetGpuCount, MissingDriverSkipsWhenNoGpuIsExpected) {
  FakeNode node(kDriverNotLoaded, nullptr);
  EXPECT_EQ(gpu_count("default", std::nullopt).status, CheckStatus::kSkip);
  // --expect-gpus 0 replaces the profile's expectation: any count, none included.
  EXPECT_EQ(gpu_count("h200", 0u).status, CheckStatus::kSkip);
}

TEST(VetGpuCount, DriverWithoutGpusFailsWhenGpusAreExpected) {
  FakeNode node(nullptr, "0");
  EXPECT_EQ(gpu_count("h200", std::nullopt).status, CheckStatus::kFail);
  EXPECT_EQ(gpu_count("default", 2u).status, CheckStatus::kFail);
  EXPECT_EQ(gpu_count("default", std::nullopt).status, CheckStatus::kSkip);
}

TEST(VetGpuCount, CountIsComparedWithTheExpectation) {
  FakeNode node(nullptr, nullptr);  // two GPUs
  CheckResult c = gpu_count("h200", std::nullopt);
  EXPECT_EQ(c.status, CheckStatus::kPass) << c.reason;
  ASSERT_TRUE(c.value);
  EXPECT_EQ(*c.value, 2);
  c = gpu_count("h200", 8u);
  EXPECT_EQ(c.status, CheckStatus::kFail);
  EXPECT_NE(c.reason.find("2 GPUs visible, expected 8"), std::string::npos) << c.reason;
  EXPECT_EQ(gpu_count("h200", 2u).status, CheckStatus::kPass);

  pacer::test::TempDir dir("vet-gpu-min-");
  const std::string site = dir.file("site.toml", "name = \"site\"\ninherits = \"default\"\n[checks.\"gpu.count\"]\nmin = 3\n");
  c = gpu_count(site, std::nullopt);
  EXPECT_EQ(c.status, CheckStatus::kFail);
  EXPECT_NE(c.reason.find("2 GPUs visible, expected at least 3"), std::string::npos) << c.reason;
}

}  // namespace
}  // namespace pacer::vet
