// Agreement between annotators: Cohen's kappa for two, Fleiss' kappa for more.
#include <fmt/format.h>

#include <map>
#include <set>

#include "pacer/annotate.hpp"
#include "pacer/core/table.hpp"

namespace pacer::annotate {

using nlohmann::json;

Kappa cohen_kappa(const std::vector<std::pair<std::string, std::string>>& pairs) {
  Kappa k;
  k.samples = static_cast<std::int64_t>(pairs.size());
  if (pairs.empty()) return k;
  std::map<std::string, std::int64_t> a, b;
  std::int64_t same = 0;
  for (const auto& [x, y] : pairs) {
    ++a[x];
    ++b[y];
    same += x == y;
  }
  const double n = static_cast<double>(pairs.size());
  k.observed = static_cast<double>(same) / n;
  for (const auto& [label, count] : a)
    if (auto it = b.find(label); it != b.end()) k.expected += (static_cast<double>(count) / n) * (static_cast<double>(it->second) / n);
  if (k.expected < 1.0) k.kappa = (k.observed - k.expected) / (1.0 - k.expected);
  return k;
}

Kappa fleiss_kappa(const std::vector<std::vector<std::int64_t>>& counts) {
  Kappa k;
  std::vector<double> totals;
  double ratings = 0, agreement = 0;
  for (const auto& row : counts) {
    std::int64_t n = 0;
    for (auto c : row) n += c;
    if (n < 2) continue;
    if (totals.size() < row.size()) totals.resize(row.size(), 0.0);
    double sq = 0;
    for (std::size_t j = 0; j < row.size(); ++j) {
      sq += static_cast<double>(row[j]) * static_cast<double>(row[j]);
      totals[j] += static_cast<double>(row[j]);
    }
    const double nd = static_cast<double>(n);
    agreement += (sq - nd) / (nd * (nd - 1));
    ratings += nd;
    ++k.samples;
  }
  if (k.samples == 0) return k;
  k.observed = agreement / static_cast<double>(k.samples);
  for (double t : totals) k.expected += (t / ratings) * (t / ratings);
  if (k.expected < 1.0) k.kappa = (k.observed - k.expected) / (1.0 - k.expected);
  return k;
}

Expected<AgreementReport> agreement(Store& store, const std::string& guideline_version) {
  auto rows = store.all_labels(guideline_version);
  if (!rows) return rows.error();
  auto labels = store.labels();
  if (!labels) return labels.error();
  AgreementReport r;
  r.store = store.path();
  r.labels = *labels;
  r.guideline_version = guideline_version;
  // sample -> annotator -> label, samples in store order.
  std::vector<std::string> order;
  std::map<std::string, std::map<std::string, std::string>> by_sample;
  std::set<std::string> annotators;
  for (const auto& l : *rows) {
    auto [it, fresh] = by_sample.try_emplace(l.sample);
    if (fresh) order.push_back(l.sample);
    it->second[l.annotator] = l.label;
    annotators.insert(l.annotator);
  }
  r.annotators.assign(annotators.begin(), annotators.end());
  for (std::size_t i = 0; i < r.annotators.size(); ++i)
    for (std::size_t j = i + 1; j < r.annotators.size(); ++j) {
      std::vector<std::pair<std::string, std::string>> pairs;
      for (const auto& s : order) {
        const auto& m = by_sample[s];
        auto a = m.find(r.annotators[i]), b = m.find(r.annotators[j]);
        if (a != m.end() && b != m.end()) pairs.emplace_back(a->second, b->second);
      }
      r.pairs.push_back({r.annotators[i], r.annotators[j], cohen_kappa(pairs)});
    }
  if (r.annotators.size() < 2) {
    r.method = "none";
  } else if (r.annotators.size() == 2) {
    r.method = "cohen";
    r.overall = r.pairs.front().kappa;
  } else {
    r.method = "fleiss";
    std::map<std::string, std::size_t> column;
    for (const auto& l : r.labels) column.emplace(l, column.size());
    std::vector<std::vector<std::int64_t>> counts;
    for (const auto& s : order) {
      std::vector<std::int64_t> row(column.size(), 0);
      for (const auto& [who, label] : by_sample[s]) {
        auto [it, fresh] = column.emplace(label, column.size());
        if (fresh) row.resize(column.size(), 0);
        ++row[it->second];
      }
      counts.push_back(std::move(row));
    }
    r.overall = fleiss_kappa(counts);
  }
  return r;
}

namespace {
json kappa_json(const Kappa& k) {
  return {{"kappa", k.kappa ? json(*k.kappa) : json(nullptr)}, {"observed", k.observed}, {"expected", k.expected}, {"samples", k.samples}};
}
std::string fmt_kappa(const Kappa& k) { return k.kappa ? fmt::format("{:.3f}", *k.kappa) : "-"; }
}  // namespace

json to_json(const AgreementReport& r) {
  json j = {{"schema", "pacer.annotate.agreement/1"}, {"store", r.store}, {"method", r.method},
            {"annotators", r.annotators}, {"labels", r.labels},
            {"guideline_version", r.guideline_version.empty() ? json(nullptr) : json(r.guideline_version)}};
  j.update(kappa_json(r.overall));
  j["pairs"] = json::array();
  for (const auto& p : r.pairs) {
    json e = {{"a", p.a}, {"b", p.b}};
    e.update(kappa_json(p.kappa));
    j["pairs"].push_back(e);
  }
  return j;
}

std::string to_text(const AgreementReport& r) {
  Table t({{"annotators"}, {"samples", true}, {"observed", true}, {"expected", true}, {"kappa", true}});
  for (const auto& p : r.pairs)
    t.add_row({p.a + " / " + p.b, std::to_string(p.kappa.samples), fmt::format("{:.3f}", p.kappa.observed),
               fmt::format("{:.3f}", p.kappa.expected), fmt_kappa(p.kappa)});
  std::string out = t.render();
  if (r.method == "none") return out + fmt::format("FAILED: {} annotator(s) labelled; agreement needs two\n", r.annotators.size());
  const char* name = r.method == "cohen" ? "Cohen's" : "Fleiss'";
  if (!r.overall.kappa)
    return out + fmt::format("FAILED: {} kappa undefined over {} samples (no shared samples, or every label the same)\n", name,
                             r.overall.samples);
  return out + fmt::format("OK: {} kappa {:.3f} over {} samples, {} annotators\n", name, *r.overall.kappa, r.overall.samples,
                           r.annotators.size());
}

}  // namespace pacer::annotate
