// `pacer curate`: classify, dedup, decontaminate, filter, train and eval (the work is in pacer/curate.hpp).
#include <fmt/format.h>

#include <cstdio>
#include <iostream>
#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/table.hpp"
#include "pacer/curate.hpp"

namespace pacer::cli {
namespace {

using nlohmann::json;

struct CurateArgs {
  std::string store;
  std::vector<std::string> sources;
  std::vector<std::string> models;
  std::vector<std::string> against, benches;
  std::string version, expression, annotations, model, out, name, file, callable;
  int jobs = 0, shingle = 5, bands = 32, rows = 4, ngram = 13;
  std::uint64_t min_overlap = 1;
  double threshold = 0.8, holdout = 0.2;
  bool exact_only = false;
  curate::TrainOptions train;
  bool strict = false, json = false;
};

std::string pct(double x) { return fmt::format("{:.1f}%", 100 * x); }

// Malformed lines: a line in the human output and a warning on stderr.
std::string malformed_text(const curate::Malformed& m) {
  if (!m.count) return {};
  std::string t = fmt::format("{} malformed line(s) skipped (--strict makes them fatal):\n", m.count);
  for (const auto& f : m.first) t += "  " + f + "\n";
  std::fprintf(stderr, "pacer: warning: %llu malformed line(s) skipped, first: %s\n", static_cast<unsigned long long>(m.count), m.first.front().c_str());
  return t;
}

curate::Store store_of(const CurateArgs& a) { return unwrap(curate::Store::open(a.store)); }

int classify(const CurateArgs& a) {
  curate::ClassifyOptions o;
  for (const auto& spec : a.models) o.classifiers.push_back(unwrap(curate::parse_classifier(spec)));
  if (o.classifiers.empty()) usage_error("classify: give at least one --model NAME=MODEL.bin[:LABEL]");
  if (a.jobs < 0) usage_error("--jobs: expected 0 (every CPU) or more");
  o.jobs = a.jobs;
  o.strict = a.strict;
  const auto store = store_of(a);
  const auto parent = unwrap(store.resolve(a.sources));
  const auto r = unwrap(curate::classify(store, parent, o));
  Table t({{"COLUMN"}, {"MODEL"}, {"LABEL"}, {"MODEL XXH3"}});
  for (const auto& c : r.version.parameters["classifiers"])
    t.add_row({c["name"].get<std::string>(), c["model"].get<std::string>(), c["label"].get<std::string>().empty() ? "(top label)" : c["label"].get<std::string>(),
               c["model_xxh3"].get<std::string>()});
  std::string text = t.render() + malformed_text(r.malformed);
  text += r.reused ? fmt::format("OK: version {} (parent {}) already has these columns; nothing recomputed\n", r.version.version, r.version.parent)
                   : fmt::format("OK: version {} (parent {}): {} samples in {:.2f} s ({:.0f}/s on {} thread(s))\n", r.version.version, r.version.parent,
                                 r.samples, r.seconds, r.seconds > 0 ? double(r.samples) / r.seconds : 0.0, r.jobs);
  print(curate::to_json(r), a.json, text);
  return 0;
}

int dedup(const CurateArgs& a) {
  curate::DedupOptions o;
  o.against = a.against;
  o.shingle = a.shingle;
  o.bands = a.bands;
  o.rows = a.rows;
  o.threshold = a.threshold;
  o.near = !a.exact_only;
  o.jobs = a.jobs;
  o.strict = a.strict;
  const auto store = store_of(a);
  const auto parent = unwrap(store.resolve(a.sources));
  const auto r = unwrap(curate::dedup(store, parent, o));
  Table t({{"SAMPLES", true}, {"EXACT DUPS", true}, {"NEAR DUPS", true}, {"CANDIDATES", true}, {"AGAINST", true}});
  t.add_row({std::to_string(r.samples), std::to_string(r.exact), std::to_string(r.near), std::to_string(r.candidates), std::to_string(r.against_samples)});
  std::string text = t.render() + malformed_text(r.malformed);
  text += fmt::format("OK: version {} (parent {}): columns dup, dup_of, dup_kind; {} of {} samples are duplicates{}\n", r.version.version,
                      r.version.parent, r.exact + r.near, r.samples,
                      o.near ? fmt::format(" (Jaccard >= {} over {}-word shingles, {} bands x {} rows)", o.threshold, o.shingle, o.bands, o.rows) : "");
  print(curate::to_json(r), a.json, text);
  return 0;
}

int decontaminate(const CurateArgs& a) {
  curate::DecontaminateOptions o;
  o.benchmarks = a.benches;
  o.n = a.ngram;
  o.min_overlap = a.min_overlap;
  o.strict = a.strict;
  if (o.benchmarks.empty()) usage_error("decontaminate: give at least one --bench FILE");
  const auto store = store_of(a);
  const auto parent = unwrap(store.resolve(a.sources));
  const auto r = unwrap(curate::decontaminate(store, parent, o));
  Table t({{"SAMPLES", true}, {"CONTAMINATED", true}, {"BENCH LINES", true}, {"BENCH NGRAMS", true}, {"SHORT LINES", true}});
  t.add_row({std::to_string(r.samples), std::to_string(r.contaminated), std::to_string(r.benchmark_lines), std::to_string(r.benchmark_ngrams),
             std::to_string(r.short_lines)});
  std::string text = t.render() + malformed_text(r.malformed);
  if (r.short_lines) text += fmt::format("{} benchmark line(s) shorter than {} words have no {}-gram and match nothing\n", r.short_lines, o.n, o.n);
  text += fmt::format("OK: version {} (parent {}): columns contaminated, contam_ngrams; {} of {} samples share a {}-gram with the benchmarks\n",
                      r.version.version, r.version.parent, r.contaminated, r.samples, o.n);
  print(curate::to_json(r), a.json, text);
  return 0;
}

int filter(const CurateArgs& a) {
  const auto store = store_of(a);
  const auto parent = unwrap(store.read(a.version));
  const auto r = unwrap(curate::filter(store, parent, a.expression, a.strict));
  Table t({{"CLAUSE", false, 60}, {"FAILED", true}, {"DROPPED", true}});
  for (const auto& c : r.clauses) t.add_row({c.text, std::to_string(c.failed), std::to_string(c.dropped)});
  std::string text = t.render() + malformed_text(r.malformed);
  text += fmt::format("OK: version {} (parent {}): kept {} of {} samples, dropped {}\n", r.version.version, r.version.parent, r.kept, r.samples, r.dropped);
  print(curate::to_json(r), a.json, text);
  return 0;
}

std::string eval_text(const curate::EvalReport& e) {
  Table t({{"LABEL"}, {"PRECISION", true}, {"RECALL", true}, {"F1", true}, {"SUPPORT", true}});
  for (const auto& p : e.per_label) t.add_row({p.label, fmt::format("{:.3f}", p.precision), fmt::format("{:.3f}", p.recall), fmt::format("{:.3f}", p.f1),
                                               std::to_string(p.support)});
  std::vector<Table::Column> cols{{"TRUE \\ PREDICTED"}};
  for (const auto& l : e.labels) cols.push_back({l, true});
  Table c(cols);
  for (std::size_t i = 0; i < e.labels.size(); ++i) {
    std::vector<std::string> row{e.labels[i]};
    for (auto v : e.confusion[i]) row.push_back(std::to_string(v));
    c.add_row(row);
  }
  std::string text = t.render() + c.render();
  if (e.unknown_labels) text += fmt::format("{} sample(s) carry a label the model does not know\n", e.unknown_labels);
  return text;
}

int train(const CurateArgs& a) {
  curate::TrainOptions o = a.train;
  o.out = a.out;
  o.holdout = a.holdout;
  o.strict = a.strict;
  const auto store = store_of(a);
  const auto r = unwrap(curate::train(store, a.annotations, o));
  std::string text = eval_text(r.eval);
  if (r.ties) text += fmt::format("{} sample(s) skipped: their annotators tied\n", r.ties);
  text += fmt::format("OK: model {} ({}), version {}: trained on {} samples, accuracy {} on {} held out\n", a.out,
                      r.version.parameters["model_xxh3"].get<std::string>(), r.version.version, r.train_samples, pct(r.eval.accuracy), r.eval.samples);
  print(curate::to_json(r), a.json, text);
  return 0;
}

int eval(const CurateArgs& a) {
  const auto r = unwrap(curate::evaluate(a.model, a.annotations, a.holdout, a.strict));
  std::string text = eval_text(r);
  text += fmt::format("OK: accuracy {} on {} sample(s) ({})\n", pct(r.accuracy), r.samples, a.holdout > 0 ? fmt::format("the held-out {}", pct(a.holdout)) : "all");
  print(curate::to_json(r), a.json, text);
  return 0;
}

// The samples as JSON lines, for scorers outside the binary (pacer.curate).
int samples(const CurateArgs& a) {
  const auto store = store_of(a);
  const auto m = unwrap(store.resolve(a.sources));
  const auto vs = unwrap(curate::load_samples(store, m, true, a.strict));
  if (vs.malformed.count) malformed_text(vs.malformed);
  std::string out;
  for (const auto& s : vs.samples) {
    out += json{{"input", s.input}, {"row", s.row}, {"id", s.id}, {"text", s.text}}.dump(-1, ' ', false, json::error_handler_t::replace);
    out += '\n';
    if (out.size() > (1u << 20)) std::fwrite(out.data(), 1, out.size(), stdout), out.clear();
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int import_scores(const CurateArgs& a) {
  const auto store = store_of(a);
  const auto parent = unwrap(store.read(a.version));
  json source = {{"kind", "python"}, {"callable", a.callable}};
  const auto m = unwrap(curate::import_scores(store, parent, a.name, a.file, source));
  print({{"schema", "pacer.curate.import/1"}, {"version", m.version}, {"parent", m.parent}, {"column", a.name}, {"scored", m.counts["scored"]}}, a.json,
        fmt::format("OK: version {} (parent {}): column {}, {} samples scored\n", m.version, m.parent, a.name, m.counts["scored"].get<std::uint64_t>()));
  return 0;
}

}  // namespace

Handler register_curate(CLI::App& app) {
  auto args = std::make_shared<CurateArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("curate", "Classify, deduplicate, decontaminate and filter SFT data; train and evaluate classifiers");
  cmd->require_subcommand(1);
  cmd->footer(
      "SOURCE: a data-set version (v + 16 hex digits) of the store, or JSON-lines files / shard sets (registered as a raw version).\n"
      "Exit codes: 0 ok, 2 usage error or malformed input, 3 runtime error. See docs/curate.md.");
  auto bind = [&](CLI::App* sub, int (*fn)(const CurateArgs&)) {
    sub->add_flag("--json", args->json, "Machine-readable output");
    sub->add_option("--store", args->store, "The version store directory (default $PACER_DATA_STORE, else ./pacer-data)");
    sub->add_flag("--strict", args->strict, "A malformed line is an error (default: counted, reported and skipped)");
    sub->callback([args, handler, fn] { *handler = [args, fn] { return fn(*args); }; });
  };
  auto sources = [&](CLI::App* sub) { sub->add_option("source", args->sources, "A version id, or input files")->required(); };

  CLI::App* c = cmd->add_subcommand("classify", "Score every sample with fastText models: a column per model beside the data");
  sources(c);
  c->add_option("--model", args->models, "NAME=MODEL.bin (column NAME: the top label) or NAME=MODEL.bin:LABEL (P(LABEL))")->required();
  c->add_option("--jobs", args->jobs, "Threads (0: every CPU this process may use)")->capture_default_str();
  bind(c, classify);

  CLI::App* d = cmd->add_subcommand("dedup", "Exact and near (MinHash + LSH) duplicates: columns dup, dup_of, dup_kind");
  sources(d);
  d->add_option("--against", args->against, "Versions or files whose samples count as earlier (across sets)");
  d->add_option("--threshold", args->threshold, "Jaccard similarity of the shingle sets that makes a near duplicate")->capture_default_str();
  d->add_option("--shingle", args->shingle, "Words per shingle")->capture_default_str();
  d->add_option("--bands", args->bands, "LSH bands")->capture_default_str();
  d->add_option("--rows", args->rows, "MinHash values per band")->capture_default_str();
  d->add_flag("--exact-only", args->exact_only, "Only exact (normalised) duplicates");
  d->add_option("--jobs", args->jobs, "Threads (0: every CPU)")->capture_default_str();
  bind(d, dedup);

  CLI::App* x = cmd->add_subcommand("decontaminate", "N-gram overlap with benchmark files: columns contaminated, contam_ngrams");
  sources(x);
  x->add_option("--bench", args->benches, "Benchmark files: text (a line each) or JSON lines")->required();
  x->add_option("--ngram", args->ngram, "Words per n-gram")->capture_default_str();
  x->add_option("--min-overlap", args->min_overlap, "Shared n-grams that make a sample contaminated")->capture_default_str();
  bind(x, decontaminate);

  CLI::App* f = cmd->add_subcommand("filter", "Keep the samples whose scores satisfy EXPR: a new version");
  f->add_option("version", args->version, "The version to filter")->required();
  f->add_option("expression", args->expression, "e.g. 'safety > 0.9 and not dup and lang == \"en\"'")->required();
  bind(f, filter);

  CLI::App* t = cmd->add_subcommand("train", "Train a fastText classifier from an annotation set; report on its held-out split");
  t->add_option("annotations", args->annotations, "An annotation set directory (pacer annotate ... export)")->required();
  t->add_option("--out", args->out, "The model file to write")->required();
  t->add_option("--holdout", args->holdout, "Fraction held out for evaluation (by a hash of the sample id)")->capture_default_str();
  t->add_option("--epoch", args->train.epoch, "Epochs")->capture_default_str();
  t->add_option("--lr", args->train.lr, "Learning rate")->capture_default_str();
  t->add_option("--dim", args->train.dim, "Vector dimension")->capture_default_str();
  t->add_option("--ngrams", args->train.word_ngrams, "Word n-grams")->capture_default_str();
  t->add_option("--bucket", args->train.bucket, "Hash buckets for n-grams")->capture_default_str();
  t->add_option("--seed", args->train.seed, "Seed")->capture_default_str();
  t->add_option("--threads", args->train.threads, "Training threads (more than 1 is not reproducible)")->capture_default_str();
  bind(t, train);

  CLI::App* e = cmd->add_subcommand("eval", "Precision, recall and the confusion matrix of a model on an annotation set");
  e->add_option("model", args->model, "A fastText model (.bin)")->required();
  e->add_option("annotations", args->annotations, "An annotation set directory")->required();
  e->add_option("--holdout", args->holdout, "The held-out fraction train used (0: every sample)")->capture_default_str();
  bind(e, eval);

  CLI::App* s = cmd->add_subcommand("samples", "Print a version's samples as JSON lines {input, row, id, text}");
  sources(s);
  bind(s, samples);

  CLI::App* im = cmd->add_subcommand("import-scores", "Add a score column computed elsewhere (JSON lines {input, row, value})");
  im->add_option("version", args->version, "The version scored")->required();
  im->add_option("name", args->name, "The column")->required();
  im->add_option("file", args->file, "The scores")->required();
  im->add_option("--callable", args->callable, "What computed them (recorded in the manifest)");
  bind(im, import_scores);

  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
