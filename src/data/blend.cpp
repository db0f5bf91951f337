// Blends: a quota schedule over weighted datasets, read through the loader as one stream.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>

#include "loader_internal.hpp"
#include "pacer/data.hpp"

namespace pacer::data {

using nlohmann::json;

namespace {
using u128 = unsigned __int128;
constexpr double kQuantum = 4294967296.0;  // 2^32: weights are rounded to this many parts of their sum
}  // namespace

Expected<BlendSchedule> BlendSchedule::make(const std::vector<double>& weights, const std::vector<std::string>& names) {
  auto name = [&](std::size_t i) { return i < names.size() ? names[i] : fmt::format("dataset {}", i); };
  if (weights.empty()) return Error{ErrorKind::kUsage, "a blend needs at least one dataset"};
  double sum = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    if (!std::isfinite(weights[i]) || weights[i] < 0)
      return Error{ErrorKind::kUsage, fmt::format("blend weight {} of {} is not a finite number >= 0", weights[i], name(i))};
    sum += weights[i];
  }
  if (!(sum > 0) || !std::isfinite(sum))
    return Error{ErrorKind::kUsage, fmt::format("blend weights sum to {}, not a positive number", sum)};
  BlendSchedule s;
  for (double w : weights) {
    auto q = static_cast<std::uint64_t>(std::llround(w / sum * kQuantum));
    if (w > 0 && q == 0) q = 1;  // a tiny positive weight still draws now and then
    s.q_.push_back(q);
    s.total_ += q;
  }
  s.counts_.assign(weights.size(), 0);
  return s;
}

std::size_t BlendSchedule::next() {
  // Draw number h = draws_ + 1. Eligible: c_i < w_i h (upper quota); among
  // them the largest q_i / (c_i + 1), ties to the first. Sums stay below
  // 2^33 and counts below 2^64, so products fit 128 bits.
  const u128 h = static_cast<u128>(draws_) + 1;
  std::size_t best = q_.size();
  for (std::size_t i = 0; i < q_.size(); ++i) {
    if (static_cast<u128>(counts_[i]) * total_ >= static_cast<u128>(q_[i]) * h) continue;
    if (best == q_.size() || static_cast<u128>(q_[i]) * (counts_[best] + 1) > static_cast<u128>(q_[best]) * (counts_[i] + 1)) best = i;
  }
  // sum c_i = h - 1 < h = sum q_i h / total, so some dataset is eligible.
  ++counts_[best];
  ++draws_;
  return best;
}

void BlendSchedule::set_counts(std::vector<std::uint64_t> counts) {
  counts_ = std::move(counts);
  counts_.resize(q_.size(), 0);
  draws_ = 0;
  for (auto c : counts_) draws_ += c;
}

std::vector<double> BlendSchedule::weights() const {
  std::vector<double> w;
  for (auto q : q_) w.push_back(static_cast<double>(q) / static_cast<double>(total_));
  return w;
}

namespace {

// How a blend's state names a dataset: by absolute, normalized paths, so a
// state matches the same files however they were spelled ("a-{0..2}.tar",
// "./a-0.tar", ...): a pickled loader reopens its datasets by absolute path.
std::string absolute_path(const std::string& p) {
  std::error_code ec;
  const std::filesystem::path a = std::filesystem::absolute(p, ec);
  return (ec ? std::filesystem::path(p) : a).lexically_normal().string();
}

// Which dataset and which of its items each blend position reads. Positions
// count from epoch 0 (epoch * samples_per_epoch + position); the weights in
// force since position `base`, when dataset i had given consumed0[i] items,
// decide positions from there on.
class BlendSource : public Loader::Source {
 public:
  struct Child {
    std::unique_ptr<Loader::Source> src;
    std::string name;    // in the state: absolute paths (absolute_path)
    std::string legacy;  // as the user spelled it, which states before 2026-12-05 recorded
    std::uint64_t seed = 0;
    bool fixed = true;                      // every epoch has `items` positions
    std::uint64_t items = 0;                // positions in epoch 0
    std::vector<std::uint64_t> starts{0};  // variable epochs: the first count of each epoch
  };

  BlendSource(std::vector<Child> kids, BlendSchedule sched, std::uint64_t per_epoch, const LoaderOptions& o, bool tokens)
      : kids_(std::move(kids)), configured_(std::move(sched)), per_epoch_(per_epoch), o_(o), tokens_(tokens), seed_(o.seed) {
    phase_.sched = configured_;
    phase_.consumed0.assign(kids_.size(), 0);
    snapshots_[0] = std::vector<std::uint64_t>(kids_.size(), 0);
  }

  std::string name() const override {
    std::string s = "blend of";
    for (const auto& k : kids_) s += " " + k.name;
    return s;
  }
  std::uint64_t items() const override {
    std::uint64_t n = 0;
    for (const auto& k : kids_) n += k.src->items();
    return n;
  }
  std::string order() const override { return fmt::format("blend samples_per_epoch={} of {}", per_epoch_, kids_[0].src->order()); }
  std::uint64_t epoch_size(std::uint64_t, std::uint64_t) override { return per_epoch_; }

  Status fill(std::uint64_t, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t& bytes,
              std::uint64_t& skipped) override {
    std::vector<Draw> draws;
    if (Status st = schedule(epoch, lo, hi, draws); !st) return st;
    return tokens_ ? fill_rows(draws, b, bytes) : fill_samples(draws, b, bytes, skipped);
  }

  void save_state(json& s, std::uint64_t epoch, std::uint64_t position) override {
    std::lock_guard g(mu_);
    const std::uint64_t n = absolute(epoch, position);
    std::vector<std::uint64_t> counts;
    json blend;
    if (n >= phase_.base) {
      BlendSchedule sched = at(n - phase_.base);
      counts = sched.counts();
    } else {
      counts.assign(kids_.size(), 0);  // only after set_epoch to before a weight change: nothing is known there
    }
    json names = json::array(), items = json::array(), consumed = json::array();
    for (std::size_t i = 0; i < kids_.size(); ++i) {
      names.push_back(kids_[i].name);
      items.push_back(kids_[i].src->items());
      consumed.push_back(phase_.consumed0[i] + counts[i]);
    }
    s["blend"] = {{"datasets", names}, {"items", items}, {"weights", phase_.sched.weights()}, {"consumed", consumed}, {"scheduled", counts}};
  }

  Status check_state(const json& s, std::uint64_t seed, std::uint64_t epoch, std::uint64_t position) override {
    if (!s.contains("blend") || !s.at("blend").is_object())
      return Error{ErrorKind::kConfig, "state has no \"blend\" key: it is not the state of a blend's loader"};
    const json& b = s.at("blend");
    if (Status st = check_state_counts(b, {"items", "consumed", "scheduled"}, "blend"); !st) return st;
    if (seed != seed_)
      return Error{ErrorKind::kConfig, fmt::format("state is for a blend with seed {}, this blend's seed is {}", seed, seed_)};
    const auto names = b.at("datasets").get<std::vector<std::string>>();
    const auto items = b.at("items").get<std::vector<std::uint64_t>>();
    const auto consumed = b.at("consumed").get<std::vector<std::uint64_t>>();
    const auto scheduled = b.at("scheduled").get<std::vector<std::uint64_t>>();
    b.at("weights").get<std::vector<double>>();
    if (names.size() != kids_.size())
      return Error{ErrorKind::kConfig, fmt::format("state is for a blend of {} datasets ({}), this one has {}", names.size(), fmt::join(names, ", "),
                                                   kids_.size())};
    if (items.size() != kids_.size() || consumed.size() != kids_.size() || scheduled.size() != kids_.size())
      return Error{ErrorKind::kConfig, fmt::format("blend.items, blend.consumed and blend.scheduled must have {} entries", kids_.size())};
    std::uint64_t drawn = 0;
    u128 total = 0;
    for (std::size_t i = 0; i < kids_.size(); ++i) {
      total += consumed[i];
      if (names[i] != kids_[i].name && names[i] != kids_[i].legacy)
        return Error{ErrorKind::kConfig, fmt::format("state's blend dataset {} is {}, this blend's is {}", i, names[i], kids_[i].name)};
      if (items[i] != kids_[i].src->items())
        return Error{ErrorKind::kConfig,
                     fmt::format("blend dataset {} had {} items when the state was saved, it has {} now", names[i], items[i], kids_[i].src->items())};
      if (scheduled[i] > consumed[i])
        return Error{ErrorKind::kConfig, fmt::format("blend.scheduled of {} ({}) exceeds its blend.consumed ({})", names[i], scheduled[i], consumed[i])};
      drawn += scheduled[i];
    }
    const u128 n = static_cast<u128>(epoch) * per_epoch_ + position;
    if (n >> 63) return Error{ErrorKind::kConfig, fmt::format("epoch {} is out of range", epoch)};
    // Every position before the state's drew one item.
    if (total != n)
      return Error{ErrorKind::kConfig, fmt::format("blend.consumed sums to {} items, but {} positions come before the state", static_cast<std::uint64_t>(total),
                                                   static_cast<std::uint64_t>(n))};
    if (drawn > static_cast<std::uint64_t>(n))
      return Error{ErrorKind::kConfig, fmt::format("blend.scheduled counts {} draws, more than the {} positions before the state", drawn,
                                                   static_cast<std::uint64_t>(n))};
    return {};
  }

  void apply_state(const json& s, std::uint64_t epoch, std::uint64_t position) override {
    const json& b = s.at("blend");
    const auto consumed = b.at("consumed").get<std::vector<std::uint64_t>>();
    auto scheduled = b.at("scheduled").get<std::vector<std::uint64_t>>();
    const bool same = b.at("weights").get<std::vector<double>>() == configured_.weights();
    std::lock_guard g(mu_);
    const std::uint64_t n = absolute(epoch, position);
    Phase p;
    p.sched = configured_;
    if (!same) scheduled.assign(kids_.size(), 0);  // new weights: a new schedule from here, on top of what was read
    std::uint64_t drawn = 0;
    for (auto c : scheduled) drawn += c;
    p.base = n - drawn;
    for (std::size_t i = 0; i < kids_.size(); ++i) p.consumed0.push_back(consumed[i] - scheduled[i]);
    phase_ = std::move(p);
    snapshots_.clear();
    snapshots_[0] = std::vector<std::uint64_t>(kids_.size(), 0);
    snapshots_[drawn] = scheduled;
  }

 private:
  struct Draw {
    std::size_t child;
    std::uint64_t count;  // the child's item count before this draw (since its first epoch)
  };
  struct Phase {
    BlendSchedule sched;
    std::uint64_t base = 0;
    std::vector<std::uint64_t> consumed0;
  };
  static constexpr std::uint64_t kSnapshotEvery = 4096;
  static constexpr std::size_t kSnapshots = 256;
  static constexpr std::uint64_t kMaxChildEpochs = 65536;

  std::uint64_t absolute(std::uint64_t epoch, std::uint64_t position) const { return epoch * per_epoch_ + position; }

  // The schedule after m draws of the current phase, from the nearest
  // snapshot at or before m (mu_ held). Readers ask for nearby positions in
  // increasing order, so this walks a batch forward, not from the start.
  BlendSchedule at(std::uint64_t m) {
    auto it = snapshots_.upper_bound(m);
    --it;  // key 0 is always there
    BlendSchedule s = phase_.sched;
    s.set_counts(it->second);
    for (std::uint64_t k = it->first; k < m; ++k) {
      s.next();
      if ((k + 1) % kSnapshotEvery == 0) remember(k + 1, s.counts());
    }
    return s;
  }
  void remember(std::uint64_t m, const std::vector<std::uint64_t>& counts) {
    snapshots_[m] = counts;
    while (snapshots_.size() > kSnapshots) snapshots_.erase(std::next(snapshots_.begin()));  // keep key 0
  }

  Status schedule(std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, std::vector<Draw>& out) {
    std::lock_guard g(mu_);
    const std::uint64_t n = absolute(epoch, lo);
    if (n < phase_.base)
      return Error{ErrorKind::kUsage, fmt::format("blend position {} (epoch {}) comes before the weight change at position {}: the blend cannot go back there",
                                                  n, epoch, phase_.base)};
    BlendSchedule s = at(n - phase_.base);
    out.reserve(hi - lo);
    for (std::uint64_t k = lo; k < hi; ++k) {
      const std::size_t i = s.next();
      out.push_back({i, phase_.consumed0[i] + s.counts()[i] - 1});
      if (s.draws() % kSnapshotEvery == 0) remember(s.draws(), s.counts());
    }
    return {};
  }

  // The (epoch, position) of the child's count-th item.
  Expected<std::pair<std::uint64_t, std::uint64_t>> locate(Child& c, std::uint64_t count) {
    if (c.fixed) return std::make_pair(count / c.items, count % c.items);
    std::lock_guard g(mu_);
    while (c.starts.back() <= count) {
      const std::uint64_t e = c.starts.size() - 1;
      // Packed epochs differ in rows, so finding one walks them all: bounded, so a crafted state cannot make it endless.
      if (e >= kMaxChildEpochs)
        return Error{ErrorKind::kUsage, fmt::format("blend dataset {}: item {} lies past its first {} epochs, more than a packed blend dataset reads",
                                                    c.name, count, kMaxChildEpochs)};
      const std::uint64_t n = c.src->epoch_size(c.seed, e);
      if (n == 0) return Error{ErrorKind::kConfig, fmt::format("blend dataset {} has no items in its epoch {}", c.name, e)};
      c.starts.push_back(c.starts.back() + n);
    }
    const auto e = static_cast<std::uint64_t>(std::upper_bound(c.starts.begin(), c.starts.end(), count) - c.starts.begin()) - 1;
    return std::make_pair(e, count - c.starts[e]);
  }

  Status fill_samples(const std::vector<Draw>& draws, Batch& b, std::uint64_t& bytes, std::uint64_t& skipped) {
    for (const Draw& d : draws) {
      Child& c = kids_[d.child];
      auto where = locate(c, d.count);
      if (!where) return where.error();
      const std::size_t before = b.keys.size();
      if (Status st = c.src->fill(c.seed, where->first, where->second, where->second + 1, b, bytes, skipped); !st) return st;
      if (b.keys.size() > before) b.datasets.push_back(static_cast<std::int32_t>(d.child));
    }
    return {};
  }

  // Each child writes its rows, in runs of consecutive positions, straight
  // into their places in the batch (padded to the longest of the batch,
  // unpacked rows), as one source would lay them.
  Status fill_rows(const std::vector<Draw>& draws, Batch& b, std::uint64_t& bytes) {
    struct Run {
      std::size_t child;
      std::uint64_t epoch, lo, hi;
      std::vector<std::uint64_t> dest;  // batch rows, in the run's order
    };
    std::vector<Run> runs;
    std::vector<bool> placed(draws.size(), false);
    for (std::size_t k = 0; k < draws.size(); ++k) {
      if (placed[k]) continue;
      Child& c = kids_[draws[k].child];
      auto where = locate(c, draws[k].count);
      if (!where) return where.error();
      // The run: this child's later draws of the batch have the next counts;
      // they join while they stay in the same epoch of it.
      Run run{draws[k].child, where->first, where->second, where->second + 1, {k}};
      for (std::size_t j = k + 1; j < draws.size(); ++j) {
        if (draws[j].child != draws[k].child) continue;
        auto w = locate(c, draws[j].count);
        if (!w) return w.error();
        if (w->first != run.epoch || w->second != run.hi) break;
        run.dest.push_back(j);
        ++run.hi;
      }
      for (auto r : run.dest) placed[r] = true;
      runs.push_back(std::move(run));
    }
    std::uint64_t cols = o_.pack ? o_.seq_len : 0;
    for (const auto& r : runs) cols = std::max(cols, kids_[r.child].src->token_cols(kids_[r.child].seed, r.epoch, r.lo, r.hi));
    const std::uint64_t nrows = draws.size();
    allocate_token_rows(b, nrows, cols, !kids_.empty() && kids_[0].src->token_labels());
    std::vector<Loader::Source::TokenRow> meta(nrows);
    for (const auto& r : runs) {
      Child& c = kids_[r.child];
      if (Status st = c.src->fill_token_rows(c.seed, r.epoch, r.lo, r.hi, b, cols, r.dest.data(), meta.data()); !st) return st;
    }
    append_token_rows(b, cols, meta);
    for (std::uint64_t r = 0; r < nrows; ++r) b.datasets.push_back(static_cast<std::int32_t>(draws[r].child));
    bytes += nrows * cols * sizeof(std::int64_t);
    return {};
  }

  std::vector<Child> kids_;
  BlendSchedule configured_;  // the weights this blend was opened with
  std::uint64_t per_epoch_;
  LoaderOptions o_;
  bool tokens_;
  std::uint64_t seed_;
  std::mutex mu_;
  Phase phase_;
  std::map<std::uint64_t, std::vector<std::uint64_t>> snapshots_;  // draws of the phase -> counts
};

}  // namespace

Expected<std::unique_ptr<Loader>> Loader::open(const Blend& blend, LoaderOptions o) {
  const bool tokens = !blend.token_datasets.empty();
  if (tokens && !blend.datasets.empty()) return Error{ErrorKind::kUsage, "a blend holds tar-shard datasets or token datasets, not both"};
  const std::size_t n = tokens ? blend.token_datasets.size() : blend.datasets.size();
  if (n == 0) return Error{ErrorKind::kUsage, "a blend needs at least one dataset"};
  if (blend.weights.size() != n) return Error{ErrorKind::kUsage, fmt::format("a blend of {} datasets needs {} weights, got {}", n, n, blend.weights.size())};
  std::vector<BlendSource::Child> kids;
  std::vector<std::string> names;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    BlendSource::Child c;
    // Each dataset its own order; Permutation mixes the seed, so adjacent seeds are unrelated orders.
    c.seed = o.seed + (i + 1) * 0x9e3779b97f4a7c15ULL;
    Expected<std::unique_ptr<Loader::Source>> src = Error{ErrorKind::kUsage, "no dataset"};
    if (tokens) {
      if (!blend.token_datasets[i]) return Error{ErrorKind::kUsage, fmt::format("blend dataset {} is missing", i)};
      c.legacy = blend.token_datasets[i]->prefix();
      c.name = absolute_path(c.legacy);
      src = make_token_source(blend.token_datasets[i], o);
      c.fixed = !o.pack;
      if (i > 0 && (blend.token_datasets[i]->loss_mask() != nullptr) != (blend.token_datasets[0]->loss_mask() != nullptr))
        return Error{ErrorKind::kUsage, fmt::format("blend dataset {} {} a loss mask and {} {}: an SFT blend needs masks everywhere", c.name,
                                                    blend.token_datasets[i]->loss_mask() ? "has" : "has no", names[0],
                                                    blend.token_datasets[0]->loss_mask() ? "has one" : "has none")};
    } else {
      if (!blend.datasets[i]) return Error{ErrorKind::kUsage, fmt::format("blend dataset {} is missing", i)};
      c.legacy = blend.datasets[i]->name();
      const auto& shards = blend.datasets[i]->shards();
      c.name = shards.size() == 1 ? absolute_path(shards.front())
                                  : fmt::format("{} .. {} ({} shards)", absolute_path(shards.front()), absolute_path(shards.back()), shards.size());
      src = make_sample_source(blend.datasets[i], o);
    }
    if (!src) return src.error();
    c.src = std::move(*src);
    if (c.src->items() == 0) return Error{ErrorKind::kUsage, fmt::format("blend dataset {} is empty", c.name)};
    c.items = c.src->epoch_size(c.seed, 0);
    if (c.items == 0) return Error{ErrorKind::kUsage, fmt::format("blend dataset {} has no items to read in its first epoch", c.name)};
    total += c.items;  // packed token datasets: rows, not documents
    names.push_back(c.name);
    kids.push_back(std::move(c));
  }
  auto sched = BlendSchedule::make(blend.weights, names);
  if (!sched) return sched.error();
  const std::uint64_t per_epoch = blend.samples_per_epoch ? blend.samples_per_epoch : total;
  if (Status st = check_loader_options(o, per_epoch, "blend positions per epoch", "blend"); !st) return st.error();
  if (o.pack && o.pack_window == 0) o.pack_window = 1;
  return start(std::make_unique<BlendSource>(std::move(kids), std::move(*sched), per_epoch, o, tokens), o);
}

}  // namespace pacer::data
