// Fuzzes the step JSON-lines parser (telemetry records): the input as one line, then as a file
// tailed by StepFileReader in two polls.
#include <cmath>

#include "fuzz.hpp"
#include "pacer/telemetry.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = fuzz::scratch() + "/steps.jsonl";
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  if (auto r = telemetry::parse_step_json(line)) {
    for (const auto& v : {r->loss, r->tokens, r->data_wait_s, r->comm_s, r->step_time_s})
      PACER_FUZZ_CHECK(!v || std::isfinite(*v), "a figure parsed as %g", *v);
    PACER_FUZZ_CHECK(r->rank >= -1, "rank parsed as %d", r->rank);  // -1: none given
  }

  // Half now, the rest later, as a writer appending while the monitor polls.
  fuzz::write_bytes(path, data, size / 2);
  telemetry::StepFileReader reader(path);
  std::uint64_t records = reader.poll().size();
  fuzz::write_bytes(path, data, size);
  records += reader.poll(true).size();
  PACER_FUZZ_CHECK(records + reader.malformed() <= reader.lines(), "%llu records and %llu malformed from %llu lines",
                   (unsigned long long)records, (unsigned long long)reader.malformed(), (unsigned long long)reader.lines());
  return 0;
}
