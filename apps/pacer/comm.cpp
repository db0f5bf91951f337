// `pacer comm`: measure collectives (bench) and turn the measurement into bucket settings (tune); the work is in pacer/comm.hpp.
#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/comm.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/progress.hpp"
#include "pacer/core/stats.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"

namespace pacer::cli {
namespace {

using nlohmann::json;

struct CommArgs {
  std::string backend = "mpi";
  std::vector<std::string> collectives;
  std::string min_size = "8", max_size = "64MiB", dtype = "fp32", timeout = "300s";
  double step_factor = 2;
  int iters = 20, warmup = 3;
  std::string output;
  bool json = false;
  // tune
  std::string bench_file, gradient_size, backward;
  double params = 0;
  int ranks = 0;
};

std::vector<std::string> split_commas(const std::vector<std::string>& in) {
  std::vector<std::string> out;
  for (const auto& s : in) {
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');)
      if (!item.empty()) out.push_back(item);
  }
  return out;
}

comm::BenchOptions bench_options(const CommArgs& a) {
  comm::BenchOptions o;
  if (!a.collectives.empty()) o.collectives = split_commas(a.collectives);
  for (const auto& c : o.collectives)
    if (!busbw_factor(c, 2)) usage_error(fmt::format("--collectives: unknown collective '{}' (expected {})", c,
                                                     fmt::join(comm::bench_collectives(), ", ")));
  auto lo = parse_size(a.min_size), hi = parse_size(a.max_size);
  if (!lo || *lo == 0) usage_error(fmt::format("--min-size '{}': expected a positive size such as 8 or 1KiB", a.min_size));
  if (!hi || *hi < *lo) usage_error(fmt::format("--max-size '{}': expected a size of at least --min-size", a.max_size));
  if (!(a.step_factor > 1)) usage_error("--step-factor must be greater than 1");
  if (a.iters < 1) usage_error("--iters must be at least 1");
  if (a.warmup < 0) usage_error("--warmup must not be negative");
  auto t = comm::parse_dtype(a.dtype);
  if (!t) usage_error("--dtype: " + t.error().message);
  auto to = parse_duration(a.timeout);
  if (!to) usage_error(fmt::format("--timeout '{}': expected a duration such as 300s", a.timeout));
  o.min_bytes = *lo;
  o.max_bytes = *hi;
  o.step_factor = a.step_factor;
  o.iters = a.iters;
  o.warmup = a.warmup;
  o.dtype = *t;
  o.timeout_s = *to;
  return o;
}

std::string bench_text(const comm::BenchReport& r) {
  std::string text = fmt::format("backend {}  ranks {}  dtype {}  host {}  {}\n", r.backend, r.ranks,
                                 comm::dtype_name(r.dtype), r.host, r.date_utc);
  Table t({{"COLLECTIVE"}, {"SIZE", true}, {"MEDIAN", true}, {"P99", true}, {"ALGBW GB/s", true},
           {"BUSBW GB/s", true}, {"CHECK"}});
  for (const auto& c : r.collectives)
    for (const auto& p : c.points)
      t.add_row({c.name, format_bytes(double(p.bytes)), format_duration(p.median_s), format_duration(p.p99_s),
                 fmt::format("{:.3f}", p.algbw_gbps), fmt::format("{:.3f}", p.busbw_gbps), p.correct ? "ok" : "WRONG"});
  text += t.render();
  Table f({{"COLLECTIVE"}, {"ALPHA", true}, {"BETA -> GB/s", true}, {"R2", true}});
  for (const auto& c : r.collectives)
    f.add_row({c.name, c.fitted ? format_duration(c.fit.alpha_s) : "-",
               c.fitted && c.fit.beta_s_per_byte > 0 ? fmt::format("{:.3f}", 1e-9 / c.fit.beta_s_per_byte) : "-",
               c.fitted ? fmt::format("{:.4f}", c.fit.r2) : "-"});
  text += "\nfit: t(bytes) = alpha + bytes / bandwidth\n" + f.render();
  text += r.ok() ? "OK: every result checked\n" : "FAILED: some collectives returned wrong data (CHECK column)\n";
  return text;
}

// Every rank measures; `rank` tells the caller whether it is the one that reports.
Expected<comm::BenchReport> bench_run(const CommArgs& a, comm::BenchOptions o, bool show_progress, int& rank) {
  auto c = comm::open_collectives(a.backend);
  if (!c) return c.error();
  rank = (*c)->rank();
  // On rank 0's terminal: stderr, or stdout under mpirun, which hands the
  // ranks a terminal on stdout only (a bench of minutes must not look hung).
  std::unique_ptr<Progress> progress;
  if (show_progress && rank == 0) {
    progress = std::make_unique<Progress>(stderr);
    if (!progress->enabled()) progress = std::make_unique<Progress>(stdout);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t points = 0;
  auto on_point = [&](const comm::BenchCollective& col, const comm::BenchPoint& p) {
    if (!progress) return;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    progress->update(fmt::format("[{}] {} {} done: median {}, {} so far", ++points, col.name, format_bytes(double(p.bytes)),
                                 format_duration(p.median_s), format_duration(elapsed)));
  };
  auto r = comm::run_bench(**c, o, on_point);
  if (progress) progress->clear();
  return r;
}

int bench(const CommArgs& a) {
  int rank = 0;
  const auto report = unwrap(bench_run(a, bench_options(a), !a.json, rank));
  if (rank != 0) return report.ok() ? 0 : static_cast<int>(ExitCode::kCheckFailed);
  const json j = comm::to_json(report);
  if (!a.output.empty()) unwrap(write_file_atomic(a.output, j.dump(2) + "\n"));
  print(j, a.json, bench_text(report));
  return report.ok() ? 0 : static_cast<int>(ExitCode::kCheckFailed);
}

std::string tune_text(const comm::TuneReport& r) {
  std::string text = fmt::format(
      "gradient {} ({} x {})  backward {}  all-reduce alpha {} bandwidth {:.3f} GB/s (R2 {:.3f})\n"
      "one all-reduce after backward: {} exposed\n"
      "best bucket {}: {} buckets, {} exposed of {} communication ({:.0f}% hidden)\n\n",
      format_bytes(r.gradient_bytes), format_number(r.input.elements), comm::dtype_name(r.input.dtype),
      format_duration(r.input.backward_s), format_duration(r.input.all_reduce.alpha_s),
      r.input.all_reduce.beta_s_per_byte > 0 ? 1e-9 / r.input.all_reduce.beta_s_per_byte : 0.0, r.input.all_reduce.r2,
      format_duration(r.single_all_reduce_s), format_bytes(r.best.bucket_bytes), r.best.buckets,
      format_duration(r.best.exposed_s), format_duration(r.best.comm_s), 100 * r.best.hidden_fraction);
  Table t({{"FRAMEWORK"}, {"SETTING"}, {"RECOMMENDED", true}, {"EXPOSED", true}, {"HIDDEN", true}, {"DEFAULT", true},
           {"EXPOSED", true}});
  auto value = [](const comm::FrameworkSetting& f, double v) {
    return f.unit == "MiB" ? fmt::format("{:g}", v) : fmt::format("{:.0f}", v);
  };
  for (const auto& f : r.settings)
    t.add_row({f.framework, f.option + " (" + f.unit + ")", value(f, f.recommended), format_duration(f.at_recommended.exposed_s),
               fmt::format("{:.0f}%", 100 * f.at_recommended.hidden_fraction), value(f, f.default_value),
               format_duration(f.at_default.exposed_s)});
  text += t.render();
  for (const auto& f : r.settings) text += fmt::format("  {}: {}\n", f.framework, f.note);
  if (r.input.all_reduce.r2 < 0.9)
    text += fmt::format("warning: the alpha-beta line fits the all-reduce times poorly (R2 {:.2f}); treat the exposed times as rough\n",
                        r.input.all_reduce.r2);
  text += "OK\n";
  return text;
}

int tune(const CommArgs& a) {
  comm::TuneInput in;
  if (a.params > 0 && !a.gradient_size.empty()) usage_error("give --params or --gradient-size, not both");
  auto t = comm::parse_dtype(a.dtype);
  if (!t) usage_error("--dtype: " + t.error().message);
  in.dtype = *t;
  if (a.params > 0) {
    in.elements = a.params;
  } else if (!a.gradient_size.empty()) {
    auto b = parse_size(a.gradient_size);
    if (!b || *b == 0) usage_error(fmt::format("--gradient-size '{}': expected a size such as 14GB", a.gradient_size));
    in.elements = double(*b) / double(comm::dtype_bytes(in.dtype));
  } else {
    usage_error("give the gradient size: --params N (elements) or --gradient-size BYTES");
  }
  auto bw = parse_duration(a.backward);
  if (!bw) usage_error(fmt::format("--backward '{}': expected the measured backward time, e.g. 850ms", a.backward));
  in.backward_s = *bw;

  comm::BenchReport report;
  if (!a.bench_file.empty()) {
    auto text = read_file(a.bench_file);
    if (!text) throw Exception(Error{ErrorKind::kUsage, a.bench_file + ": " + text.error().message});
    json j = json::parse(*text, nullptr, false);
    if (j.is_discarded()) throw Exception(Error{ErrorKind::kConfig, a.bench_file + ": not JSON"});
    report = unwrap(comm::bench_from_json(j, a.bench_file));
  } else {
    comm::BenchOptions o = bench_options(a);
    o.collectives = {"all_reduce"};
    int rank = 0;
    report = unwrap(bench_run(a, o, !a.json, rank));
    if (rank != 0) return 0;
  }
  const comm::BenchCollective* ar = nullptr;
  for (const auto& c : report.collectives)
    if (c.name == "all_reduce") ar = &c;
  const std::string src = a.bench_file.empty() ? "the fresh bench run" : a.bench_file;
  if (!ar) usage_error(src + ": no all_reduce measurements (run pacer comm bench with all_reduce)");
  if (!report.ok()) usage_error(src + ": the bench found wrong results; fix the network before tuning");
  auto fit = comm::fit_points(*ar, comm::kTuneMinBucketBytes);
  if (!fit)
    usage_error(fmt::format("{}: needs all_reduce at two or more sizes of at least {} (--max-size)", src,
                            format_bytes(double(comm::kTuneMinBucketBytes))));
  in.all_reduce = *fit;
  in.ranks = a.ranks > 0 ? a.ranks : report.ranks;
  const auto r = unwrap(comm::tune(in));
  json j = comm::to_json(r);
  j["bench"] = {{"source", src}, {"backend", report.backend}, {"ranks", report.ranks}, {"host", report.host},
                {"date_utc", report.date_utc}};
  print(j, a.json, tune_text(r));
  return 0;
}

}  // namespace

Handler register_comm(CLI::App& app) {
  auto args = std::make_shared<CommArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("comm", "Measure collectives and tune gradient buckets");
  cmd->require_subcommand(1);
  cmd->footer(
      "Run bench under mpirun or srun (one process per rank; rank 0 prints).\n"
      "Exit codes: 0 ok, 1 a collective returned wrong data, 2 usage error or malformed input, 3 runtime error. See docs/comm.md.");
  auto common = [&](CLI::App* sub) {
    sub->add_option("--backend", args->backend, "mpi (CPU buffers) or nccl (GPU buffers, bootstrapped through MPI)")
        ->capture_default_str();
    sub->add_option("--min-size", args->min_size, "Smallest message (nccl-tests' size)")->capture_default_str();
    sub->add_option("--max-size", args->max_size, "Largest message")->capture_default_str();
    sub->add_option("--step-factor", args->step_factor, "Each size is the previous times this")->capture_default_str();
    sub->add_option("--iters", args->iters, "Timed calls per size")->capture_default_str();
    sub->add_option("--warmup", args->warmup, "Untimed calls per size")->capture_default_str();
    sub->add_option("--timeout", args->timeout, "A collective that takes longer fails, naming this rank")->capture_default_str();
    sub->add_flag("--json", args->json, "Machine-readable output");
  };

  CLI::App* b = cmd->add_subcommand("bench", "Time all-reduce, reduce-scatter, all-gather, broadcast and all-to-all over message sizes");
  common(b);
  b->add_option("--collectives", args->collectives, "Comma-separated subset, e.g. all_reduce,all_gather");
  b->add_option("--dtype", args->dtype, "Element type: fp32, fp64, bf16, int32, uint8")->capture_default_str();
  b->add_option("--output", args->output, "Also write the JSON report to this file (for pacer comm tune --bench)");
  b->callback([args, handler] { *handler = [args] { return bench(*args); }; });

  CLI::App* t = cmd->add_subcommand("tune", "Bucket size that hides the most gradient all-reduce behind backward");
  common(t);
  t->add_option("--bench", args->bench_file, "A report from pacer comm bench --output (default: measure all_reduce now)");
  t->add_option("--params", args->params, "Gradient elements (model parameters)");
  t->add_option("--gradient-size", args->gradient_size, "Or the gradient size in bytes, e.g. 14GB");
  t->add_option("--dtype", args->dtype, "Gradient dtype as reduced: fp32 or bf16")->capture_default_str();
  t->add_option("--backward", args->backward, "Measured backward time per step, e.g. 850ms")->required();
  t->add_option("--ranks", args->ranks, "Data-parallel ranks (default: the bench's)");
  t->callback([args, handler] { *handler = [args] { return tune(*args); }; });

  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
