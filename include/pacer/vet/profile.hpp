// Vet profiles: the thresholds and parameters `pacer vet` judges a node by (TOML).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::vet {

// Thresholds and settings for one check. Numeric checks fail (warn) outside
// [fail_below, fail_above] ([warn_below, warn_above]); text checks pass when
// the value is in `pass`, warn when it is in `warn`, and fail otherwise (with
// no `pass` list, anything not in `warn` passes).
struct CheckConfig {
  bool enabled = true;
  std::optional<double> fail_below;
  std::optional<double> warn_below;
  std::optional<double> fail_above;
  std::optional<double> warn_above;
  std::vector<std::string> pass;
  std::vector<std::string> warn;
  std::optional<double> timeout_s;
  std::optional<double> quick_timeout_s;
};

// How `pacer vet --cluster` compares nodes ([cluster] in a profile).
// Outliers: a node's figure is flagged when its robust z, (value - median) /
// max(1.4826 MAD, outlier_floor * |median|), is beyond -outlier_warn
// (-outlier_fail) on the worse side of a check with a direction. Links: a
// point-to-point bandwidth below link_warn_ratio (link_fail_ratio) of the
// median link warns (fails).
struct ClusterConfig {
  double outlier_warn = 3;
  double outlier_fail = 5;
  double outlier_floor = 0.05;
  unsigned outlier_min_nodes = 3;  // fewer nodes than this: no outlier judgement
  double link_warn_ratio = 0.8;
  double link_fail_ratio = 0.5;
};

// A fully resolved profile: the built-in `default`, overlaid by each profile
// it inherits and finally by the named one.
struct Profile {
  std::string name;
  std::string description;
  std::vector<std::string> sources;   // "builtin:default", "/path/to/file.toml", in overlay order
  double baseline_fail_ratio = 0.90;  // fail below this fraction of the baseline
  double baseline_warn_ratio = 0.95;
  std::vector<std::string> storage_paths;  // as written: "$TMPDIR" is expanded at run time
  std::map<std::string, CheckConfig> checks;
  ClusterConfig cluster;
  // Raw parameter tables, keyed by probe section, each {"normal": {...}, "quick": {...}}
  // with values as written (strings for durations and sizes); validated.
  nlohmann::json params = nlohmann::json::object();
};

// Loads a built-in profile by name ("default", "h200") or a TOML file by path.
// Errors name the file, line and key (ErrorKind::kConfig) or say which names
// exist (ErrorKind::kUsage).
Expected<Profile> load_profile(const std::string& name_or_path);
// Parses profile text as if read from `source`; `inherits` paths are resolved
// relative to `source`'s directory.
Expected<Profile> parse_profile(std::string_view text, const std::string& source);

std::vector<std::string> builtin_profile_names();

// The profile as JSON, as recorded in reports.
nlohmann::json to_json(const Profile& p);

}  // namespace pacer::vet
