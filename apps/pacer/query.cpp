// `pacer query` and `pacer catalog`: ask a job catalog a named question or any SQL; merge per-node catalogs.
#include <fmt/format.h>

#include <cstdio>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/table.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry/questions.hpp"

namespace pacer::cli {
namespace {

using telemetry::Value;

struct QueryArgs {
  std::string db, query;
  telemetry::QuestionArgs q;
  bool json = false, csv = false, list = false;
  double timeout_s = 30;
};

// What one query may hold in memory before it is stopped (a recursive CTE
// without end fills memory faster than the time limit stops it).
constexpr std::uint64_t kMaxResultBytes = 1ull << 30;

// Tables show 10 significant digits (enough for Unix times to the millisecond);
// CSV keeps every digit (the shortest text that reads back the same double).
std::string cell_text(const Value& v, bool exact = false) {
  if (std::holds_alternative<std::monostate>(v)) return "";
  if (const auto* i = std::get_if<std::int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return exact ? fmt::format("{}", *d) : fmt::format("{:.10g}", *d);
  return std::get<std::string>(v);
}

// RFC 4180: quote fields with commas, quotes or line breaks; double the quotes.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

int query(const QueryArgs& a) {
  if (a.list) {
    Table t({{"QUESTION"}, {"WHAT IT ANSWERS"}});
    for (const auto& q : telemetry::questions()) t.add_row({std::string(q.name), std::string(q.summary)});
    std::fputs(t.render().c_str(), stdout);
    return 0;
  }
  if (a.db.empty() || a.query.empty()) usage_error("usage: pacer query DB QUESTION|SQL (pacer query --list for the questions)");
  if (a.json && a.csv) usage_error("--json and --csv: choose one");
  const bool named = a.query.find(' ') == std::string::npos && a.query.find('\n') == std::string::npos;
  if (a.q.run_id && !named)
    usage_error(fmt::format("--run {0} applies to the named questions; in SQL, say WHERE run_id = {0}", *a.q.run_id));
  const std::string sql = named ? unwrap(telemetry::question_sql(a.query, a.q)) : a.query;
  if (!(a.timeout_s >= 0) || !std::isfinite(a.timeout_s)) usage_error("--timeout: seconds, 0 or more (0: no limit)");
  auto cat = unwrap(telemetry::Catalog::open(
      a.db, telemetry::CatalogOptions{.read_only = true, .query_timeout_s = a.timeout_s, .max_result_bytes = kMaxResultBytes}));
  if (a.q.run_id) unwrap(telemetry::check_run(*cat, *a.q.run_id));
  const auto r = unwrap(cat->query(sql));
  if (a.csv) {
    std::string out;
    for (std::size_t i = 0; i < r.columns.size(); ++i) out += (i ? "," : "") + csv_field(r.columns[i]);
    out += "\n";
    for (const auto& row : r.rows) {
      for (std::size_t i = 0; i < row.size(); ++i) out += (i ? "," : "") + csv_field(cell_text(row[i], true));
      out += "\n";
    }
    std::fputs(out.c_str(), stdout);
    return 0;
  }
  std::vector<Table::Column> cols;
  for (const auto& c : r.columns) cols.push_back({c, false, 48});
  Table t(cols);
  for (const auto& row : r.rows) {
    std::vector<std::string> cells;
    for (const auto& v : row) cells.push_back(cell_text(v));
    t.add_row(std::move(cells));
  }
  std::string text = r.columns.empty() ? "" : t.render();
  text += fmt::format("OK: {} row(s)\n", r.rows.size());
  print(telemetry::to_json(r, a.db, a.query, named), a.json, text);
  return 0;
}

struct CatalogArgs {
  std::string out;
  std::vector<std::string> inputs;
  bool json = false;
};

int merge(const CatalogArgs& a) {
  const auto r = unwrap(telemetry::merge_catalogs(a.out, a.inputs));
  for (const auto& s : r.skipped) std::fprintf(stderr, "pacer catalog merge: note: %s\n", s.c_str());
  print(telemetry::to_json(r, a.out, a.inputs), a.json,
        fmt::format("OK: merged {} catalog(s) into {}: {} run(s), {} node(s), {} samples, {} steps, {} events\n",
                    r.inputs, a.out, r.runs, r.nodes, r.samples, r.steps, r.events));
  return 0;
}

}  // namespace

Handler register_query(CLI::App& app) {
  auto args = std::make_shared<QueryArgs>();
  CLI::App* cmd = app.add_subcommand("query", "Ask a job catalog a named question or any SQL");
  cmd->add_option("db", args->db, "Catalog file");
  cmd->add_option("query", args->query, "A question (slowest-steps, hot-nodes, data-wait, throttle) or SQL");
  cmd->add_option("--limit", args->q.limit, "slowest-steps: how many steps (default 10)");
  cmd->add_option("--threshold", args->q.threshold_c, "hot-nodes: GPU temperature in C (default 85)");
  cmd->add_option("--regression", args->q.regression, "hot-nodes: slower than this x the median step (default 1.2)");
  cmd->add_option("--run", args->q.run_id, "A named question about this run only (default: every run; the run_id column)");
  cmd->add_option("--timeout", args->timeout_s, "Stop the query after this many seconds (default 30; 0: no limit)");
  cmd->add_flag("--json", args->json, "JSON output (pacer.query/1)");
  cmd->add_flag("--csv", args->csv, "CSV output");
  cmd->add_flag("--list", args->list, "List the named questions");
  cmd->footer("The query is read-only: statements that would change a file (INSERT, ATTACH, VACUUM INTO, a PRAGMA "
              "that sets) are refused. Exit codes: 0 ok, 2 usage error (bad SQL, a refused statement, unknown question, "
              "newer catalog), 3 runtime error (the query passed --timeout or held more than 1 GiB). See docs/telemetry.md.");
  return [args] { return query(*args); };
}

Handler register_catalog(CLI::App& app) {
  auto args = std::make_shared<CatalogArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("catalog", "Manage job catalogs");
  cmd->require_subcommand(1);
  CLI::App* m = cmd->add_subcommand("merge", "Merge per-node catalogs of a job into OUT (created or extended)");
  m->add_option("out", args->out, "The merged catalog")->required();
  m->add_option("inputs", args->inputs, "Catalogs to merge")->required();
  m->add_flag("--json", args->json, "JSON output (pacer.catalog.merge/1)");
  m->callback([args, handler] { *handler = [args] { return merge(*args); }; });
  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
