// Fuzzes vet baselines: arbitrary bytes as the JSON report `pacer vet --baseline` compares against.
#include <cmath>

#include "fuzz.hpp"
#include "pacer/vet/vet.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = fuzz::scratch() + "/baseline.json";
  fuzz::write_bytes(path, data, size);
  auto b = vet::load_baseline(path);
  if (!b) return 0;
  for (const auto& [key, value] : *b) PACER_FUZZ_CHECK(std::isfinite(value), "baseline figure %s is %g", key.c_str(), value);
  return 0;
}
