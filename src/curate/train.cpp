// train and eval: fastText classifiers from annotation sets
// (pacer.annotations/1, written by `pacer annotate ... export`).
#include <fasttext/fasttext.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>

#include "curate_internal.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/time.hpp"
#include "pacer/data.hpp"

namespace pacer::curate {

namespace fs = std::filesystem;
using nlohmann::json;

Expected<AnnotationSet> read_annotations(const std::string& dir, bool strict) {
  AnnotationSet set;
  set.dir = dir;
  const std::string mpath = dir + "/manifest.json";
  auto mtext = read_file(mpath);
  if (!mtext) return Error{ErrorKind::kUsage, fmt::format("{}: not an annotation set ({})", dir, mtext.error().message)};
  json m = json::parse(*mtext, nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("schema", "") != "pacer.annotations/1")
    return Error{ErrorKind::kConfig, fmt::format("{}: not an annotation set manifest (schema is not pacer.annotations/1)", mpath)};
  try {
    set.version = m.at("version").get<std::string>();
    set.source = m.value("source", "");
    set.labels = m.at("labels").get<std::vector<std::string>>();
  } catch (const json::exception& e) {
    return Error{ErrorKind::kConfig, fmt::format("{}: malformed: {}", mpath, e.what())};
  }
  if (set.labels.empty()) return Error{ErrorKind::kConfig, fmt::format("{}: no labels", mpath)};
  for (const auto& l : set.labels)
    if (l.empty() || l.find_first_of(" \t\r\n\v\f") != std::string::npos)
      return Error{ErrorKind::kConfig, fmt::format("{}: label '{}' is empty or contains whitespace (fastText labels are single tokens)", mpath, l)};
  const std::string lpath = dir + "/labels.jsonl";
  std::ifstream f(lpath, std::ios::binary);
  if (!f) return Error{ErrorKind::kUsage, fmt::format("{}: cannot open", lpath)};
  struct Votes {
    std::string text;
    std::map<std::string, std::uint64_t> count;
  };
  std::vector<std::string> order;
  std::unordered_map<std::string, Votes> votes;
  std::string line;
  std::uint64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++set.lines;
    json j = json::parse(line, nullptr, false);
    std::string why;
    if (j.is_discarded() || !j.is_object()) why = "not a JSON object";
    else if (!j.contains("id") || !(j["id"].is_string() || j["id"].is_number_integer())) why = "no \"id\"";
    else if (!j.contains("label") || !j["label"].is_string()) why = "no string \"label\"";
    else if (std::find(set.labels.begin(), set.labels.end(), j["label"].get<std::string>()) == set.labels.end())
      why = fmt::format("label '{}' is not one of the manifest's labels", j["label"].get<std::string>());
    if (!why.empty()) {
      const std::string where = fmt::format("{}:{}: {}", lpath, n, why);
      if (strict) return Error{ErrorKind::kConfig, where + " (--strict)"};
      ++set.malformed.count;
      if (set.malformed.first.size() < 20) set.malformed.first.push_back(where);
      continue;
    }
    const std::string id = j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump();
    auto [it, fresh] = votes.try_emplace(id);
    if (fresh) order.push_back(id);
    if (it->second.text.empty() && j.contains("text") && j["text"].is_string()) it->second.text = j["text"].get<std::string>();
    ++it->second.count[j["label"].get<std::string>()];
  }
  for (const auto& id : order) {
    const Votes& v = votes[id];
    std::uint64_t best = 0, at_best = 0;
    std::string label;
    for (const auto& [l, c] : v.count) {
      if (c > best) best = c, at_best = 1, label = l;
      else if (c == best) ++at_best;
    }
    if (at_best > 1) {
      ++set.ties;
      continue;
    }
    set.samples.push_back({id, v.text, label});
  }
  return set;
}

bool held_out(const std::string& id, double fraction) {
  if (fraction <= 0) return false;
  const std::uint64_t h = XXH3_64bits(id.data(), id.size());
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

namespace {

EvalReport score(const Model& model, const AnnotationSet& set, const std::vector<const Annotated*>& samples) {
  EvalReport r;
  r.model = model.path();
  r.annotations = set.dir;
  r.labels = set.labels;
  for (const auto& l : model.labels())
    if (std::find(r.labels.begin(), r.labels.end(), l) == r.labels.end()) r.labels.push_back(l);
  const auto model_labels = model.labels();
  auto index = [&](const std::string& l) { return static_cast<std::size_t>(std::find(r.labels.begin(), r.labels.end(), l) - r.labels.begin()); };
  r.confusion.assign(r.labels.size(), std::vector<std::uint64_t>(r.labels.size(), 0));
  std::uint64_t right = 0;
  for (const Annotated* a : samples) {
    if (std::find(model_labels.begin(), model_labels.end(), a->label) == model_labels.end()) ++r.unknown_labels;
    const auto p = model.predict(a->text, 1);
    if (p.empty()) continue;  // no word the model knows
    ++r.samples;
    ++r.confusion[index(a->label)][index(p[0].second)];
    right += p[0].second == a->label;
  }
  r.accuracy = r.samples ? double(right) / double(r.samples) : 0;
  for (std::size_t k = 0; k < r.labels.size(); ++k) {
    std::uint64_t tp = r.confusion[k][k], predicted = 0, actual = 0;
    for (std::size_t j = 0; j < r.labels.size(); ++j) predicted += r.confusion[j][k], actual += r.confusion[k][j];
    EvalReport::PerLabel pl;
    pl.label = r.labels[k];
    pl.support = actual;
    pl.precision = predicted ? double(tp) / double(predicted) : 0;
    pl.recall = actual ? double(tp) / double(actual) : 0;
    pl.f1 = pl.precision + pl.recall > 0 ? 2 * pl.precision * pl.recall / (pl.precision + pl.recall) : 0;
    r.per_label.push_back(pl);
  }
  return r;
}

}  // namespace

Expected<TrainReport> train(const Store& store, const std::string& annotations, const TrainOptions& o) {
  if (o.out.empty()) return Error{ErrorKind::kUsage, "train: no --out model file"};
  if (!(o.holdout >= 0 && o.holdout < 1)) return Error{ErrorKind::kUsage, fmt::format("--holdout {}: expected [0, 1)", o.holdout)};
  if (o.epoch < 1 || o.dim < 1 || o.dim > 1000 || o.word_ngrams < 1 || o.word_ngrams > 5 || o.bucket < 0 || o.threads < 1 || !(o.lr > 0))
    return Error{ErrorKind::kUsage, "train: --epoch, --dim (1..1000), --ngrams (1..5), --threads and --lr must be positive"};
  auto set = read_annotations(annotations, o.strict);
  if (!set) return set.error();
  TrainReport r;
  r.ties = set->ties;
  std::string text;
  std::vector<const Annotated*> held;
  for (const auto& a : set->samples) {
    if (held_out(a.id, o.holdout)) {
      held.push_back(&a);
      continue;
    }
    text += "__label__" + a.label + " " + fasttext_line(a.text) + "\n";
    ++r.train_samples;
  }
  r.heldout_samples = held.size();
  if (r.train_samples == 0) return Error{ErrorKind::kConfig, fmt::format("{}: no samples to train on (after the held-out split)", annotations)};
  const std::string tmp_train = o.out + ".train.txt.tmp";
  const std::string tmp_model = o.out + ".partial";
  if (Status st = write_file_atomic(tmp_train, text, Durability::kCache); !st) return st.error();
  fasttext::Args a;
  a.input = tmp_train;
  a.output = o.out;
  a.model = fasttext::model_name::sup;
  a.loss = fasttext::loss_name::softmax;
  a.minCount = 1;
  a.minn = 0;
  a.maxn = 0;
  a.lr = o.lr;
  a.dim = o.dim;
  a.epoch = o.epoch;
  a.wordNgrams = o.word_ngrams;
  a.bucket = o.word_ngrams > 1 ? o.bucket : 0;
  a.thread = o.threads;
  a.seed = o.seed;
  a.verbose = 0;
  try {
    fasttext::FastText ft;
    ft.train(a);
    ft.saveModel(tmp_model);
  } catch (const std::exception& e) {
    ::unlink(tmp_train.c_str());
    ::unlink(tmp_model.c_str());
    return Error{ErrorKind::kRuntime, fmt::format("{}: fastText training failed: {}", annotations, e.what())};
  }
  ::unlink(tmp_train.c_str());
  if (std::rename(tmp_model.c_str(), o.out.c_str()) != 0) {
    ::unlink(tmp_model.c_str());
    return Error{ErrorKind::kIo, fmt::format("{}: cannot rename the model into place: {}", o.out, std::strerror(errno))};
  }
  auto model = Model::load(o.out);
  if (!model) return model.error();
  r.eval = score(**model, *set, held);
  json params = {{"holdout", o.holdout}, {"epoch", o.epoch}, {"dim", o.dim}, {"word_ngrams", o.word_ngrams}, {"bucket", a.bucket},
                 {"lr", o.lr},           {"seed", o.seed},   {"threads", o.threads}};
  Manifest m;
  m.step = "model";
  m.version = version_id({{"step", "model"}, {"annotations", set->version}, {"parameters", params}});
  params["annotations"] = {{"version", set->version}, {"dir", fs::absolute(annotations).string()}, {"source", set->source}};
  params["model"] = fs::absolute(o.out).string();
  params["model_xxh3"] = (*model)->xxh3();
  params["labels"] = set->labels;
  m.parameters = params;
  m.counts = {{"train", r.train_samples}, {"heldout", r.heldout_samples}, {"ties", r.ties}, {"accuracy", r.eval.accuracy}};
  m.created = utc_iso_now();
  if (Status st = store.write(m); !st) return st.error();
  r.version = std::move(m);
  return r;
}

Expected<EvalReport> evaluate(const std::string& model, const std::string& annotations, double holdout, bool strict) {
  if (!(holdout >= 0 && holdout < 1)) return Error{ErrorKind::kUsage, fmt::format("--holdout {}: expected [0, 1)", holdout)};
  auto m = Model::load(model);
  if (!m) return m.error();
  auto set = read_annotations(annotations, strict);
  if (!set) return set.error();
  std::vector<const Annotated*> picked;
  for (const auto& a : set->samples)
    if (holdout == 0 || held_out(a.id, holdout)) picked.push_back(&a);
  return score(**m, *set, picked);
}

json to_json(const EvalReport& r) {
  json per = json::array();
  for (const auto& p : r.per_label)
    per.push_back({{"label", p.label}, {"precision", p.precision}, {"recall", p.recall}, {"f1", p.f1}, {"support", p.support}});
  return {{"schema", "pacer.curate.eval/1"}, {"model", r.model},   {"annotations", r.annotations}, {"samples", r.samples},
          {"labels", r.labels},               {"confusion", r.confusion}, {"per_label", per},  {"accuracy", r.accuracy},
          {"unknown_labels", r.unknown_labels}};
}

json to_json(const TrainReport& r) {
  return {{"schema", "pacer.curate.train/1"}, {"version", r.version.version}, {"model", r.version.parameters["model"]},
          {"model_xxh3", r.version.parameters["model_xxh3"]}, {"train_samples", r.train_samples}, {"heldout_samples", r.heldout_samples},
          {"ties", r.ties}, {"parameters", r.version.parameters}, {"eval", to_json(r.eval)}};
}

}  // namespace pacer::curate
