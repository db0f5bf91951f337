#include "pacer/vet/check.hpp"

#include <fmt/format.h>

namespace pacer::vet {

std::string_view to_string(CheckStatus s) {
  switch (s) {
    case CheckStatus::kPass: return "pass";
    case CheckStatus::kWarn: return "warn";
    case CheckStatus::kFail: return "fail";
    case CheckStatus::kSkip: return "skip";
    case CheckStatus::kError: return "error";
  }
  return "error";
}

Expected<CheckStatus> parse_status(std::string_view s) {
  for (CheckStatus c : {CheckStatus::kPass, CheckStatus::kWarn, CheckStatus::kFail, CheckStatus::kSkip, CheckStatus::kError})
    if (to_string(c) == s) return c;
  return Error{ErrorKind::kConfig, fmt::format("unknown status '{}' (pass, warn, fail, skip, error)", s)};
}

namespace {
int rank(CheckStatus s) {
  switch (s) {
    case CheckStatus::kSkip: return 0;
    case CheckStatus::kPass: return 1;
    case CheckStatus::kWarn: return 2;
    case CheckStatus::kFail: return 3;
    case CheckStatus::kError: return 4;
  }
  return 4;
}
}  // namespace

CheckStatus worse(CheckStatus a, CheckStatus b) { return rank(a) >= rank(b) ? a : b; }

void to_json(nlohmann::json& j, const Measurement& m) {
  j = {{"check", m.check}, {"target", m.target}, {"text", m.text}, {"detail", m.detail}, {"reason", m.reason}};
  j["value"] = m.value ? nlohmann::json(*m.value) : nlohmann::json(nullptr);
  j["status"] = m.status ? nlohmann::json(std::string(to_string(*m.status))) : nlohmann::json(nullptr);
}

void from_json(const nlohmann::json& j, Measurement& m) {
  m.check = j.at("check").get<std::string>();
  m.target = j.value("target", "");
  m.text = j.value("text", "");
  m.detail = j.value("detail", "");
  m.reason = j.value("reason", "");
  if (j.contains("value") && j["value"].is_number()) m.value = j["value"].get<double>();
  if (j.contains("status") && j["status"].is_string()) {
    auto s = parse_status(j["status"].get<std::string>());
    m.status = s ? *s : CheckStatus::kError;
  }
}

void to_json(nlohmann::json& j, const CheckResult& r) {
  j = {{"name", r.name},           {"category", r.category}, {"target", r.target},
       {"unit", r.unit},           {"threshold", r.threshold}, {"status", std::string(to_string(r.status))},
       {"reason", r.reason},       {"duration_s", r.duration_s}};
  j["value"] = r.value ? nlohmann::json(*r.value) : (r.text.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.text));
  j["baseline"] = r.baseline ? nlohmann::json(*r.baseline) : nlohmann::json(nullptr);
}

void from_json(const nlohmann::json& j, CheckResult& r) {
  r.name = j.at("name").get<std::string>();
  r.category = j.value("category", "");
  r.target = j.value("target", "");
  r.unit = j.value("unit", "");
  r.threshold = j.value("threshold", "");
  r.reason = j.value("reason", "");
  r.duration_s = j.value("duration_s", 0.0);
  if (j.contains("value")) {
    if (j["value"].is_number()) r.value = j["value"].get<double>();
    else if (j["value"].is_string()) r.text = j["value"].get<std::string>();
  }
  if (j.contains("baseline") && j["baseline"].is_number()) r.baseline = j["baseline"].get<double>();
  auto s = parse_status(j.value("status", "error"));
  r.status = s ? *s : CheckStatus::kError;
}

}  // namespace pacer::vet
