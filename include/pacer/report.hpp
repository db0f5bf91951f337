// The run report: one self-contained HTML file (charts, scores, verdict, events) drawn from a job catalog.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"
#include "pacer/score.hpp"

namespace pacer::report {

struct ReportOptions {
  score::ScoreOptions score;     // which run, link capacities
  int max_points = 1500;         // per timeline series; longer runs are averaged into time buckets
  int heatmap_buckets = 80;      // columns of the per-node heatmap
  std::size_t max_events = 2000; // events listed, the earliest first
  std::size_t max_marks = 1000;  // checkpoints, restarts, hangs and vet results marked on the timelines
  // A `pacer plan step --json` file: its FLOPs per token give MFU for steps
  // without `flops`, its peak_tflops the GPU peak, its step_s the goodput
  // ledger's planned step. Empty: none.
  std::string plan_file;
  std::optional<double> peak_tflops;  // one GPU's dense peak; overrides the plan's
};

// Everything the page draws, as the `pacer.report.data/1` document (also what
// the page embeds). Opens `db` read-only.
Expected<nlohmann::json> report_data(const std::string& db, const ReportOptions& options);

// The whole HTML page for `data`: the charting library, the page's script and
// styles, and the data, inline; it needs no network and no server.
std::string render_html(const nlohmann::json& data);

// report_data + render_html, written atomically to `out`.
Status write_report(const std::string& db, const std::string& out, const ReportOptions& options);

}  // namespace pacer::report
