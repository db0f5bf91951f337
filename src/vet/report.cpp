#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fmt/ranges.h>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/vet/vet.hpp"
#include "probes.hpp"

namespace pacer::vet {

using nlohmann::json;

std::string VetReport::verdict() const {
  if (interrupted) return "fail";
  for (const auto& c : checks)
    if (c.status == CheckStatus::kFail || c.status == CheckStatus::kError) return "fail";
  return "pass";
}

std::map<std::string, int> VetReport::counts() const {
  std::map<std::string, int> n{{"pass", 0}, {"warn", 0}, {"fail", 0}, {"skip", 0}, {"error", 0}};
  for (const auto& c : checks) ++n[std::string(to_string(c.status))];
  return n;
}

ExitCode exit_code(const VetReport& r) {
  if (r.interrupted) return ExitCode::kInterrupted;
  return r.verdict() == "pass" ? ExitCode::kOk : ExitCode::kCheckFailed;
}

namespace {

std::string fmt_value(double v, const std::string& unit) {
  return unit.empty() ? format_number(v) : fmt::format("{} {}", format_number(v), unit);
}

}  // namespace

CheckResult judge(const Measurement& m, const Profile& profile, const std::optional<double>& baseline) {
  CheckResult r;
  r.name = m.check;
  r.target = m.target;
  r.value = m.value;
  r.text = m.text;
  const CheckSpec* spec = find_check(m.check);
  if (spec) {
    r.category = spec->category;
    r.unit = spec->unit;
  }
  if (m.status) {
    r.status = *m.status;
    r.reason = m.reason;
    return r;
  }
  const auto it = profile.checks.find(m.check);
  const CheckConfig cfg = it == profile.checks.end() ? CheckConfig{} : it->second;
  std::vector<std::string> limits;
  CheckStatus status = CheckStatus::kPass;
  std::string why;
  auto flag = [&](CheckStatus s, std::string reason) {
    if (worse(status, s) == s && s != status) {
      status = s;
      why = std::move(reason);
    }
  };

  if (spec && spec->kind == ValueKind::kText) {
    if (!cfg.pass.empty()) limits.push_back(fmt::format("in [{}]", fmt::join(cfg.pass, ", ")));
    const bool in_pass = std::find(cfg.pass.begin(), cfg.pass.end(), m.text) != cfg.pass.end();
    const bool in_warn = std::find(cfg.warn.begin(), cfg.warn.end(), m.text) != cfg.warn.end();
    if (in_warn && !in_pass) flag(CheckStatus::kWarn, fmt::format("'{}' is discouraged by profile {}", m.text, profile.name));
    else if (!cfg.pass.empty() && !in_pass)
      flag(CheckStatus::kFail, fmt::format("'{}' is not allowed (allowed: {})", m.text, fmt::join(cfg.pass, ", ")));
  } else if (m.value && !std::isfinite(*m.value)) {
    // nan compares false with every threshold and would pass them all.
    flag(CheckStatus::kFail, fmt::format("measured {}, not a number a threshold can judge", *m.value));
  } else if (m.value) {
    const double v = *m.value;
    const std::string u = r.unit;
    if (cfg.fail_below) {
      limits.push_back(fmt::format(">= {}", format_number(*cfg.fail_below)));
      if (v < *cfg.fail_below) flag(CheckStatus::kFail, fmt::format("{} below the minimum {}", fmt_value(v, u), fmt_value(*cfg.fail_below, u)));
    }
    if (cfg.fail_above) {
      limits.push_back(fmt::format("<= {}", format_number(*cfg.fail_above)));
      if (v > *cfg.fail_above) flag(CheckStatus::kFail, fmt::format("{} above the maximum {}", fmt_value(v, u), fmt_value(*cfg.fail_above, u)));
    }
    if (cfg.warn_below) {
      limits.push_back(fmt::format("warn < {}", format_number(*cfg.warn_below)));
      if (v < *cfg.warn_below) flag(CheckStatus::kWarn, fmt::format("{} below {}", fmt_value(v, u), fmt_value(*cfg.warn_below, u)));
    }
    if (cfg.warn_above) {
      limits.push_back(fmt::format("warn > {}", format_number(*cfg.warn_above)));
      if (v > *cfg.warn_above) flag(CheckStatus::kWarn, fmt::format("{} above {}", fmt_value(v, u), fmt_value(*cfg.warn_above, u)));
    }
    if (baseline && spec && spec->direction != Direction::kNone && *baseline > 0) {
      r.baseline = *baseline;
      const double ratio = v / *baseline;
      const double pct = 100.0 * ratio;
      if (spec->direction == Direction::kHigher) {
        limits.push_back(fmt::format(">= {:.0f}% of baseline", 100 * profile.baseline_fail_ratio));
        if (ratio < profile.baseline_fail_ratio)
          flag(CheckStatus::kFail, fmt::format("{:.0f}% of baseline {} (minimum {:.0f}%)", pct, fmt_value(*baseline, u), 100 * profile.baseline_fail_ratio));
        else if (ratio < profile.baseline_warn_ratio)
          flag(CheckStatus::kWarn, fmt::format("{:.0f}% of baseline {} (warn below {:.0f}%)", pct, fmt_value(*baseline, u), 100 * profile.baseline_warn_ratio));
      } else {
        limits.push_back(fmt::format("<= {:.0f}% of baseline", 100 / profile.baseline_fail_ratio));
        if (ratio > 1 / profile.baseline_fail_ratio)
          flag(CheckStatus::kFail, fmt::format("{:.0f}% of baseline {} (maximum {:.0f}%)", pct, fmt_value(*baseline, u), 100 / profile.baseline_fail_ratio));
        else if (ratio > 1 / profile.baseline_warn_ratio)
          flag(CheckStatus::kWarn, fmt::format("{:.0f}% of baseline {} (warn above {:.0f}%)", pct, fmt_value(*baseline, u), 100 / profile.baseline_warn_ratio));
      }
    }
  } else {
    flag(CheckStatus::kError, "probe returned no value");
  }
  r.status = status;
  r.threshold = fmt::format("{}", fmt::join(limits, ", "));
  r.reason = why.empty() ? m.detail : (m.detail.empty() ? why : why + "; " + m.detail);
  return r;
}

Expected<std::map<std::string, double>> load_baseline(const std::string& path) {
  auto text = read_file(path);
  if (!text) return Error{ErrorKind::kConfig, fmt::format("baseline {}", text.error().message)};
  json j;
  try {
    j = json::parse(*text);
  } catch (const json::exception& e) {  // out_of_range too: a number beyond double
    return Error{ErrorKind::kConfig, fmt::format("baseline {}: not valid JSON: {}", path, e.what())};
  }
  // value("schema", "") would throw for a schema that is no string.
  const auto schema = j.is_object() ? j.find("schema") : j.end();
  if (!j.is_object() || schema == j.end() || !schema->is_string() || *schema != kReportSchema || !j.contains("checks") ||
      !j["checks"].is_array())
    return Error{ErrorKind::kConfig, fmt::format("baseline {}: not a pacer vet report (expected \"schema\": \"{}\" and a \"checks\" array)", path, kReportSchema)};
  std::map<std::string, double> figures;
  for (const auto& c : j["checks"]) {
    // A field of another type is no figure (as a missing one), not an exception.
    auto text = [&](const char* key) {
      auto it = c.find(key);
      return it != c.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string()) continue;
    if (c.contains("value") && c["value"].is_number() && text("status") != "error" && text("status") != "skip")
      figures[text("name") + "|" + text("target")] = c["value"].get<double>();
  }
  return figures;
}

void to_json(json& j, const Injection& i) {
  static const char* kNames[] = {"hang", "crash", "value"};
  j = {{"check", i.check}, {"action", kNames[static_cast<int>(i.action)]}};
  if (i.action == Injection::Action::kValue) j["value"] = i.text.empty() ? json(i.value) : json(i.text);
  if (!i.node.empty()) j["node"] = i.node;
}

json to_json(const VetReport& r) {
  json checks = json::array();
  for (const auto& c : r.checks) checks.push_back(c);
  json inj = json::array();
  for (const auto& i : r.injections) inj.push_back(i);
  return {{"schema", kReportSchema},
          {"host", r.host},
          {"started_at", r.started_at},
          {"duration_s", r.duration_s},
          {"mode", r.mode},
          {"profile", to_json(r.profile)},
          {"baseline", r.baseline_path ? json(*r.baseline_path) : json(nullptr)},
          {"versions", r.versions},
          {"checks", checks},
          {"injections", inj},
          {"interrupted", r.interrupted},
          {"counts", r.counts()},
          {"verdict", r.verdict()}};
}

std::string render_table(const VetReport& r) {
  Table t({{"CHECK"}, {"TARGET", false, 28}, {"VALUE", true}, {"THRESHOLD", false, 30}, {"STATUS"}, {"REASON", false, 90}});
  for (const auto& c : r.checks) {
    std::string value = c.value ? fmt_value(*c.value, c.unit) : c.text;
    t.add_row({c.name, c.target, value, c.threshold, std::string(to_string(c.status)), c.reason});
  }
  std::string out = t.render();
  const auto n = r.counts();
  out += fmt::format("{}: {} checks on {} ({} profile, {}) in {}: {} pass, {} warn, {} fail, {} error, {} skip{}\n",
                     r.verdict() == "pass" ? "OK" : "FAILED", r.checks.size(), r.host, r.profile.name, r.mode,
                     format_duration(r.duration_s), n.at("pass"), n.at("warn"), n.at("fail"), n.at("error"),
                     n.at("skip"), r.interrupted ? " (interrupted)" : "");
  return out;
}

std::vector<CheckInfo> list_checks() {
  std::vector<CheckInfo> out;
  for (const auto& p : all_probes())
    for (const auto& c : p.checks) out.push_back({c.name, c.category, c.unit, c.help});
  return out;
}

}  // namespace pacer::vet
