// The CPU FLOP probe runs the vector kernel of the CPU it is on: AVX-512,
// AVX2 or SSE2 on x86, NEON or SVE on aarch64 (Grace), and measures a rate.
#include <gtest/gtest.h>

#include <cstdlib>

#include "pacer/vet/vet.hpp"

namespace pacer::vet {
namespace {

TEST(CpuProbe, MeasuresWithTheVectorUnitOfThisCpu) {
  VetOptions o;
  o.quick = true;
  o.only = {"cpu.flops"};
  auto r = run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 1u);
  const CheckResult& c = r->checks.front();
  ASSERT_TRUE(c.value) << c.reason;
  EXPECT_GT(*c.value, 0);
#if defined(__x86_64__)
  const std::vector<std::string> isas = {"fp64 avx512 ", "fp64 avx2 ", "fp64 sse2 "};
#elif defined(__aarch64__)
  const std::vector<std::string> isas = {"fp64 neon ", "fp64 sve "};
#else
  const std::vector<std::string> isas = {"fp64 generic "};
#endif
  bool named = false;
  for (const auto& isa : isas) named = named || c.reason.find(isa) != std::string::npos;
  EXPECT_TRUE(named) << c.reason;
  // tests/cross/aarch64.sh runs this under emulated CPUs with and without SVE.
  if (const char* want = std::getenv("PACER_EXPECT_CPU_KERNEL")) {
    EXPECT_NE(c.reason.find(std::string("fp64 ") + want + " "), std::string::npos) << c.reason;
  }
}

}  // namespace
}  // namespace pacer::vet
