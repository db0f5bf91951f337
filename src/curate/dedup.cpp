// dedup (exact normalised hash; MinHash with LSH banding, verified by exact
// Jaccard) and decontaminate (n-gram overlap with benchmark files).
#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "curate_internal.hpp"
#include "pacer/data.hpp"

namespace pacer::curate {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The hashes of a text's word n-grams (each the hash of its n word hashes),
// sorted and unique. A text shorter than n words is one n-gram of all its
// words (so short near-identical samples still compare); no words, none.
std::vector<std::uint64_t> ngram_hashes(const std::string& text, int n, bool short_as_one) {
  const auto w = words(text);
  std::vector<std::uint64_t> wh(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) wh[i] = XXH3_64bits(w[i].data(), w[i].size());
  std::vector<std::uint64_t> out;
  const std::size_t k = static_cast<std::size_t>(n);
  if (wh.size() < k) {
    if (short_as_one && !wh.empty()) out.push_back(XXH3_64bits(wh.data(), wh.size() * 8));
    return out;
  }
  out.reserve(wh.size() - k + 1);
  for (std::size_t i = 0; i + k <= wh.size(); ++i) out.push_back(XXH3_64bits(wh.data() + i, k * 8));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

double jaccard(const std::vector<std::uint64_t>& a, const std::vector<std::uint64_t>& b) {
  if (a.empty() && b.empty()) return 1.0;
  std::size_t i = 0, j = 0, both = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) ++both, ++i, ++j;
    else if (a[i] < b[j]) ++i;
    else ++j;
  }
  return double(both) / double(a.size() + b.size() - both);
}

struct UnionFind {
  std::vector<std::size_t> parent;
  explicit UnionFind(std::size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  std::size_t find(std::size_t x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  }
  // The smaller index stays the root: the earliest sample is the one kept.
  void join(std::size_t a, std::size_t b) {
    a = find(a), b = find(b);
    if (a == b) return;
    if (b < a) std::swap(a, b);
    parent[b] = a;
  }
};

// splitmix64: the per-permutation multipliers and offsets of MinHash.
std::uint64_t mix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The text of a benchmark line: a JSON object's text or messages, else all
// its strings joined; anything else is the line itself.
std::string benchmark_text(const std::string& line) {
  if (line.empty() || line[0] != '{') return line;
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return line;
  if (auto t = sample_text(j)) return *t;
  std::string out;
  std::function<void(const json&)> walk = [&](const json& v) {
    if (v.is_string()) out += v.get<std::string>() + "\n";
    else if (v.is_structured())
      for (const auto& x : v) walk(x);
  };
  walk(j);
  return out;
}

}  // namespace

Expected<DedupReport> dedup(const Store& store, const Manifest& parent, const DedupOptions& o) {
  if (o.shingle < 1 || o.shingle > 64) return Error{ErrorKind::kUsage, fmt::format("--shingle {}: expected 1..64 words", o.shingle)};
  if (o.bands < 1 || o.rows < 1 || o.bands * o.rows > 1024)
    return Error{ErrorKind::kUsage, fmt::format("--bands {} --rows {}: expected at least 1 each, at most 1024 hashes", o.bands, o.rows)};
  if (!(o.threshold > 0 && o.threshold <= 1)) return Error{ErrorKind::kUsage, fmt::format("--threshold {}: expected (0, 1]", o.threshold)};
  DedupReport r;
  std::vector<Sample> all;
  json against = json::array();
  for (const auto& src : o.against) {
    auto m = store.resolve({src});
    if (!m) return m.error();
    auto vs = load_samples(store, *m, true, o.strict);
    if (!vs) return vs.error();
    r.against_samples += vs->samples.size();
    against.push_back(m->version);
    for (auto& s : vs->samples) all.push_back(std::move(s));
  }
  const std::size_t first_own = all.size();
  auto own = load_samples(store, parent, true, o.strict);
  if (!own) return own.error();
  r.malformed = own->malformed;
  for (auto& s : own->samples) all.push_back(std::move(s));
  r.samples = all.size() - first_own;
  const int threads = worker_count(o.jobs);

  json params = {{"against", against}, {"near", o.near}, {"shingle", o.shingle}, {"bands", o.bands}, {"rows", o.rows}, {"threshold", o.threshold}};
  r.version = derive(parent, "dedup", params, params);

  UnionFind uf(all.size());
  std::vector<char> exact(all.size(), 0);
  {
    std::vector<XXH128_hash_t> h(all.size());
    parallel_blocks(all.size(), threads, 256, [&](int, std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        const std::string n = normalise(all[i].text);
        h[i] = XXH3_128bits(n.data(), n.size());
      }
    });
    std::unordered_map<std::uint64_t, std::vector<std::size_t>> first;
    for (std::size_t i = 0; i < all.size(); ++i) {
      auto& bucket = first[h[i].low64];
      bool found = false;
      for (std::size_t j : bucket)
        if (h[j].high64 == h[i].high64) {
          uf.join(j, i);
          exact[i] = 1;
          found = true;
          break;
        }
      if (!found) bucket.push_back(i);
    }
  }
  std::vector<char> near(all.size(), 0);
  if (o.near) {
    const std::size_t perms = static_cast<std::size_t>(o.bands * o.rows);
    std::vector<std::uint64_t> a(perms), c(perms);
    std::uint64_t seed = 0x5eed;
    for (std::size_t k = 0; k < perms; ++k) a[k] = mix(seed) | 1, c[k] = mix(seed);
    std::vector<std::vector<std::uint64_t>> sh(all.size());
    std::vector<std::uint32_t> sig(all.size() * perms, 0xffffffffu);
    parallel_blocks(all.size(), threads, 64, [&](int, std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        if (exact[i]) continue;
        sh[i] = ngram_hashes(all[i].text, o.shingle, true);
        std::uint32_t* s = sig.data() + i * perms;
        for (std::uint64_t x : sh[i])
          for (std::size_t k = 0; k < perms; ++k) s[k] = std::min(s[k], static_cast<std::uint32_t>((a[k] * x + c[k]) >> 32));
      }
    });
    std::unordered_set<std::uint64_t> tried;
    auto consider = [&](std::size_t x, std::size_t y) {
      if (x > y) std::swap(x, y);
      if (!tried.insert((static_cast<std::uint64_t>(x) << 32) ^ y).second) return;
      ++r.candidates;
      if (uf.find(x) == uf.find(y)) return;
      if (jaccard(sh[x], sh[y]) >= o.threshold) {
        uf.join(x, y);
        near[std::max(x, y)] = 1;
      }
    };
    for (int band = 0; band < o.bands; ++band) {
      std::unordered_map<std::uint64_t, std::vector<std::size_t>> buckets;
      for (std::size_t i = 0; i < all.size(); ++i) {
        if (exact[i] || sh[i].empty()) continue;
        const std::uint32_t* s = sig.data() + i * perms + static_cast<std::size_t>(band * o.rows);
        buckets[XXH3_64bits(s, static_cast<std::size_t>(o.rows) * 4)].push_back(i);
      }
      for (const auto& [k, v] : buckets) {
        if (v.size() < 2) continue;
        // Every pair of a small bucket; a large one (boilerplate) against its first members only, so it stays linear.
        const std::size_t heads = v.size() <= 64 ? v.size() : 4;
        for (std::size_t p = 0; p < heads; ++p)
          for (std::size_t q = p + 1; q < v.size(); ++q) consider(v[p], v[q]);
      }
    }
  }
  auto dup = null_columns(own->rows), dup_of = null_columns(own->rows), kind = null_columns(own->rows);
  for (std::size_t i = first_own; i < all.size(); ++i) {
    const Sample& s = all[i];
    const std::size_t at = row_index(parent.inputs[s.input], s.row);
    const std::size_t root = uf.find(i);
    const bool d = root != i;
    dup[s.input][at] = d;
    if (d) {
      dup_of[s.input][at] = all[root].id;
      kind[s.input][at] = exact[i] ? "exact" : "near";
      ++(exact[i] ? r.exact : r.near);
    }
  }
  json source = {{"kind", "dedup"}, {"parameters", params}};
  for (auto& [name, vals] : {std::pair{"dup", &dup}, std::pair{"dup_of", &dup_of}, std::pair{"dup_kind", &kind}}) {
    auto col = write_column(parent.inputs, name, r.version.version, *vals, source);
    if (!col) return col.error();
    set_column(r.version, std::move(*col));
  }
  r.version.counts = parent.counts;
  r.version.counts["dup_exact"] = r.exact;
  r.version.counts["dup_near"] = r.near;
  if (Status st = store.write(r.version); !st) return st.error();
  return r;
}

json to_json(const DedupReport& r) {
  return {{"schema", "pacer.curate.dedup/1"}, {"version", r.version.version}, {"parent", r.version.parent},
          {"samples", r.samples},             {"exact", r.exact},             {"near", r.near},
          {"candidates", r.candidates},       {"against_samples", r.against_samples}, {"parameters", r.version.parameters},
          {"malformed", to_json(r.malformed)}};
}

Expected<DecontaminateReport> decontaminate(const Store& store, const Manifest& parent, const DecontaminateOptions& o) {
  if (o.n < 1 || o.n > 64) return Error{ErrorKind::kUsage, fmt::format("--ngram {}: expected 1..64 words", o.n)};
  if (o.benchmarks.empty()) return Error{ErrorKind::kUsage, "decontaminate: no --bench file"};
  DecontaminateReport r;
  std::unordered_set<std::uint64_t> grams;
  json benches = json::array();
  for (const auto& b : o.benchmarks) {
    std::ifstream f(b, std::ios::binary);
    if (!f) return Error{ErrorKind::kUsage, fmt::format("{}: cannot open the benchmark file", b)};
    auto h = data::file_xxh3(b);
    if (!h) return h.error();
    benches.push_back({{"path", fs::absolute(b).string()}, {"xxh3", fmt::format("{:016x}", *h)}});
    std::string line;
    while (std::getline(f, line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      ++r.benchmark_lines;
      const auto g = ngram_hashes(benchmark_text(line), o.n, false);
      if (g.empty()) ++r.short_lines;
      grams.insert(g.begin(), g.end());
    }
  }
  r.benchmark_ngrams = grams.size();
  json identity = {{"n", o.n}, {"min_overlap", o.min_overlap}, {"benchmarks", json::array()}};
  for (const auto& b : benches) identity["benchmarks"].push_back(b["xxh3"]);
  r.version = derive(parent, "decontaminate", identity, {{"n", o.n}, {"min_overlap", o.min_overlap}, {"benchmarks", benches}});
  auto own = load_samples(store, parent, true, o.strict);
  if (!own) return own.error();
  r.malformed = own->malformed;
  r.samples = own->samples.size();
  auto flag = null_columns(own->rows), hits = null_columns(own->rows);
  std::vector<std::uint64_t> count(own->samples.size(), 0);
  parallel_blocks(own->samples.size(), worker_count(0), 64, [&](int, std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i)
      for (std::uint64_t g : ngram_hashes(own->samples[i].text, o.n, false)) count[i] += grams.count(g);
  });
  for (std::size_t i = 0; i < own->samples.size(); ++i) {
    const Sample& s = own->samples[i];
    const std::size_t at = row_index(parent.inputs[s.input], s.row);
    const bool c = count[i] >= o.min_overlap;
    flag[s.input][at] = c;
    hits[s.input][at] = count[i];
    r.contaminated += c;
  }
  json source = {{"kind", "decontaminate"}, {"parameters", r.version.parameters}};
  for (auto& [name, vals] : {std::pair{"contaminated", &flag}, std::pair{"contam_ngrams", &hits}}) {
    auto col = write_column(parent.inputs, name, r.version.version, *vals, source);
    if (!col) return col.error();
    set_column(r.version, std::move(*col));
  }
  r.version.counts = parent.counts;
  r.version.counts["contaminated"] = r.contaminated;
  if (Status st = store.write(r.version); !st) return st.error();
  return r;
}

json to_json(const DecontaminateReport& r) {
  return {{"schema", "pacer.curate.decontaminate/1"},
          {"version", r.version.version},
          {"parent", r.version.parent},
          {"samples", r.samples},
          {"contaminated", r.contaminated},
          {"benchmark_lines", r.benchmark_lines},
          {"benchmark_ngrams", r.benchmark_ngrams},
          {"short_benchmark_lines", r.short_lines},
          {"parameters", r.version.parameters},
          {"malformed", to_json(r.malformed)}};
}

}  // namespace pacer::curate
