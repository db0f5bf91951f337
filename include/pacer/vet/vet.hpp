// `pacer vet`: run a node's checks against a profile and decide pass or fail.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"
#include "pacer/vet/check.hpp"
#include "pacer/vet/profile.hpp"

namespace pacer::vet {

inline constexpr const char* kReportSchema = "pacer.vet/1";

// A chaos injection (--inject [NODE:]CHECK=ACTION): the probe measuring CHECK
// hangs, crashes, or reports VALUE instead of what it measured (a number, or
// text for text checks such as versions). With NODE, only on that node (its
// --node-name or host name). For testing the detection and abort logic; every
// report records the injections it ran with.
struct Injection {
  std::string check;
  enum class Action { kHang, kCrash, kValue } action = Action::kValue;
  double value = 0;
  std::string text;  // the value of a text check
  std::string node;  // empty: every node
  bool applies_to(const std::string& node_name) const { return node.empty() || node == node_name; }
};
Expected<Injection> parse_injection(const std::string& text);
// {"check", "action", "value" (for value), "node" (when targeted)}, as reports record it.
void to_json(nlohmann::json& j, const Injection& i);

struct VetOptions {
  std::string profile = "default";           // built-in name or TOML path
  std::optional<std::string> baseline_path;  // JSON report of a known-good run
  bool quick = false;                        // prolog-sized run
  std::vector<std::string> only;             // check names or categories
  std::vector<std::string> skip;             // check names or categories
  std::vector<std::string> storage_paths;    // replaces the profile's paths
  std::optional<double> timeout_s;           // replaces every probe's timeout
  std::optional<unsigned> expect_gpus;       // replaces gpu.count's expectation
  std::vector<Injection> injections;
  std::string node_name;            // reported as the host; default: the host name
  std::optional<double> bound_s;    // the whole run ends within this: probe timeouts are cut to the time left
  // Called before and after each probe from the calling thread (progress display).
  std::function<void(const std::string& probe, std::size_t index, std::size_t total, bool done)> on_probe;
};

struct VetReport {
  std::string host;
  std::string started_at;  // ISO 8601 UTC
  double duration_s = 0;
  std::string mode;        // "quick" or "full"
  Profile profile;
  std::optional<std::string> baseline_path;
  std::map<std::string, std::string> versions;
  std::vector<CheckResult> checks;
  std::vector<Injection> injections;
  bool interrupted = false;

  // "pass" when no check failed or errored (warnings allowed), else "fail".
  std::string verdict() const;
  std::map<std::string, int> counts() const;
};

// Runs the selected checks, each probe in a child process under its timeout.
// Blocks until done. Installs SIGINT/SIGTERM handlers while it runs: a signal
// stops the probe in flight, removes its scratch files and returns the report
// with `interrupted` set. Errors only for bad options (unknown check names,
// bad profile or baseline); a failing or hanging check is a result, not an error.
Expected<VetReport> run_vet(const VetOptions& options);
// The errors run_vet would return for these options (profile, baseline, check
// names, injections), without running a probe: for a caller that runs the
// vet later (`pacer run --vet quick`) and must refuse bad options at once.
Status check_options(const VetOptions& options);

nlohmann::json to_json(const VetReport& r);
// The compact table and the final OK/FAILED line.
std::string render_table(const VetReport& r);
ExitCode exit_code(const VetReport& r);

// Judges a measurement against a check's thresholds and, when given, its
// baseline figure. Exposed for tests.
CheckResult judge(const Measurement& m, const Profile& profile, const std::optional<double>& baseline);

// Reads a baseline (a vet JSON report) into figures keyed by "name|target".
Expected<std::map<std::string, double>> load_baseline(const std::string& path);

struct CheckInfo {
  std::string name;
  std::string category;
  std::string unit;
  std::string help;
};
std::vector<CheckInfo> list_checks();

}  // namespace pacer::vet
