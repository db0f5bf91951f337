// The records `pacer vet` produces: raw measurements and judged check results.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::vet {

// pass and warn let the node through; fail, error (the check could not
// finish: timeout, crash) stop it; skip means the check does not apply here.
enum class CheckStatus { kPass, kWarn, kFail, kSkip, kError };
std::string_view to_string(CheckStatus s);
Expected<CheckStatus> parse_status(std::string_view s);
// Worse of two statuses: error > fail > warn > pass > skip.
CheckStatus worse(CheckStatus a, CheckStatus b);

// What a probe measured, before any threshold is applied. A probe sets
// `status` itself only when it could not measure (skip, fail, error) and then
// says why in `reason`.
struct Measurement {
  std::string check;
  std::string target;            // a path, "gpu0", or empty for the node
  std::optional<double> value;   // numeric checks
  std::string text;              // text checks (a mode, a version), or empty
  std::string detail;            // evidence shown as the reason when judged ok
  std::optional<CheckStatus> status;
  std::string reason;
};
void to_json(nlohmann::json& j, const Measurement& m);
void from_json(const nlohmann::json& j, Measurement& m);

// A judged check, as reported.
struct CheckResult {
  std::string name;
  std::string category;
  std::string target;
  std::optional<double> value;
  std::string text;
  std::string unit;
  std::string threshold;            // the thresholds applied, human-readable
  std::optional<double> baseline;   // the baseline figure compared against
  CheckStatus status = CheckStatus::kPass;
  std::string reason;
  double duration_s = 0;            // of the probe that measured it
};
void to_json(nlohmann::json& j, const CheckResult& r);
void from_json(const nlohmann::json& j, CheckResult& r);

}  // namespace pacer::vet
