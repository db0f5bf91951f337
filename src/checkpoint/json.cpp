// The JSON records of `pacer ckpt ls|verify|prune|export|interval --json` (the manifest's is in format.cpp).
#include <algorithm>

#include "pacer/checkpoint.hpp"

namespace pacer::ckpt {

using nlohmann::json;

json to_json(const Entry& e) {
  return {{"step", e.step},          {"path", e.path},         {"bytes", e.bytes},     {"partial", e.partial},
          {"committed", e.committed}, {"verified", e.verified}, {"damaged", e.damaged}, {"problem", e.problem}};
}

namespace {
json entries_json(const std::vector<Entry>& entries) {
  json a = json::array();
  for (const auto& e : entries) a.push_back(to_json(e));
  return a;
}
}  // namespace

json to_json(const ListReport& r) {
  return {{"schema", "pacer.ckpt.ls/1"}, {"dir", r.dir}, {"checkpoints", entries_json(r.checkpoints)}};
}

bool VerifyReport::ok() const {
  return std::all_of(checkpoints.begin(), checkpoints.end(), [](const Entry& e) { return e.verified; });
}

json to_json(const VerifyReport& r) {
  return {{"schema", "pacer.ckpt.verify/1"}, {"dir", r.dir}, {"checkpoints", entries_json(r.checkpoints)},
          {"verdict", r.ok() ? "pass" : "fail"}};
}

json to_json(const PruneResult& r, const std::string& dir, bool dry_run) {
  json damaged = json::array();
  for (const auto& d : r.damaged) {
    const bool gone = std::find(r.removed_damaged.begin(), r.removed_damaged.end(), d.path) != r.removed_damaged.end();
    damaged.push_back({{"step", d.step}, {"path", d.path}, {"moved_aside", d.damaged}, {"problem", d.problem}, {"removed", gone}});
  }
  json partial = json::array();
  for (const auto& p : r.removed_partial) partial.push_back({{"step", p.step}, {"path", p.path}, {"problem", p.problem}});
  return {{"schema", "pacer.ckpt.prune/1"},
          {"dir", dir},
          {"dry_run", dry_run},
          {"removed", r.removed},
          {"kept", r.kept},
          {"damaged", damaged},
          {"busy", r.busy},
          {"removed_partial", partial},
          {"newest_valid", r.newest_valid ? json(*r.newest_valid) : json(nullptr)}};
}

json to_json(const ExportResult& r, const std::string& dir, const std::string& out_dir) {
  return {{"schema", "pacer.ckpt.export/1"}, {"dir", dir},         {"step", r.step},       {"format", "safetensors"},
          {"out", out_dir},                  {"files", r.files},   {"tensors", r.tensors}, {"bytes", r.bytes},
          {"skipped", r.skipped}};
}

}  // namespace pacer::ckpt
