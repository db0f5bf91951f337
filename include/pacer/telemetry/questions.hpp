// Named questions over a catalog ("slowest-steps", "hot-nodes", "data-wait", "throttle") as SQL.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::telemetry {

struct Question {
  std::string_view name;
  std::string_view summary;
};
// Every named question, for --help and docs/telemetry.md.
const std::vector<Question>& questions();

struct QuestionArgs {
  int limit = 10;            // slowest-steps: how many steps
  double threshold_c = 85;   // hot-nodes: GPU temperature, degrees Celsius
  double regression = 1.2;   // hot-nodes: a step regressed when slower than this x its run's median
  std::optional<std::int64_t> run_id = std::nullopt;  // only this run (--run); default: every run of the catalog
};

// The SQL that answers `name`; a usage error names the known questions.
Expected<std::string> question_sql(std::string_view name, const QuestionArgs& args);

}  // namespace pacer::telemetry
