// The loader: ordered prefetch of one rank's batches by reader threads, bounded in batches and bytes.
#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "pacer/data.hpp"

namespace pacer::data {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// One global batch of one epoch, read by one reader thread.
struct Slot {
  std::uint64_t seed = 0;          // opt.seed when scheduled: load_state may change it while this is read
  std::uint64_t epoch = 0;
  std::uint64_t global_batch = 0;  // counted from the epoch's base position
  std::uint64_t end_position = 0;  // the epoch position once this batch is consumed
  std::uint64_t lo = 0, hi = 0;    // this rank's positions in the epoch
  bool taken = false;              // a reader is on it
  bool ready = false;
  std::optional<Error> error;
  Batch batch;
  std::uint64_t bytes = 0;
  std::uint64_t skipped = 0;
};

}  // namespace

struct Loader::Impl {
  std::shared_ptr<Dataset> ds;
  LoaderOptions opt;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Slot>> window;  // scheduled, in order
  std::vector<std::thread> readers;
  bool stopping = false;
  std::uint64_t generation = 0;   // bumped on seek: stale reads are dropped
  std::uint64_t ready_bytes = 0;

  // Position of the consumer.
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;     // samples of this epoch consumed by all ranks together
  // Where scheduling stands (ahead of the consumer).
  std::uint64_t sched_epoch = 0;
  std::uint64_t sched_base = 0;   // the epoch position its batches count from
  std::uint64_t sched_next = 0;   // next global batch to schedule
  bool sched_done = false;        // epoch fully scheduled and not looping

  LoaderStats stats;
  std::optional<Clock::time_point> first_next;

  Partition partition(std::uint64_t base) const {
    Partition p;
    p.samples = ds->size() - std::min(base, ds->size());
    p.batch_size = opt.batch_size;
    p.rank = opt.rank;
    p.world_size = opt.world_size;
    p.drop_last = opt.drop_last;
    return p;
  }

  // Called with mu held: top the window up to prefetch_batches.
  void schedule() {
    while (!sched_done && window.size() < opt.prefetch_batches) {
      const Partition p = partition(sched_base);
      if (sched_next >= p.batches()) {
        if (!opt.loop) {
          sched_done = true;
          break;
        }
        ++sched_epoch;
        sched_base = 0;
        sched_next = 0;
        continue;
      }
      auto s = std::make_shared<Slot>();
      s->seed = opt.seed;
      s->epoch = sched_epoch;
      s->global_batch = sched_next;
      auto [lo, hi] = p.range(sched_next);
      s->lo = sched_base + lo;
      s->hi = sched_base + hi;
      s->end_position = sched_base + std::min((sched_next + 1) * p.global_batch(), p.samples);
      window.push_back(s);
      ++sched_next;
    }
    cv.notify_all();
  }

  void reader_loop() {
    std::unique_lock lock(mu);
    for (;;) {
      std::shared_ptr<Slot> s;
      cv.wait(lock, [&] {
        if (stopping) return true;
        // Bounded memory: wait while ready batches hold max_bytes, unless the
        // consumer is waiting for the very first one.
        if (ready_bytes >= opt.max_bytes && !(window.size() && !window.front()->ready && !window.front()->taken)) return false;
        for (auto& w : window)
          if (!w->taken) return true;
        return false;
      });
      if (stopping) return;
      for (auto& w : window)
        if (!w->taken) {
          s = w;
          break;
        }
      if (!s) continue;
      s->taken = true;
      const std::uint64_t gen = generation;
      lock.unlock();
      fill(*s);
      lock.lock();
      if (gen != generation) continue;  // a seek dropped this slot
      s->ready = true;
      ready_bytes += s->bytes;
      cv.notify_all();
    }
  }

  void fill(Slot& s) {
    const Permutation perm(ds->size(), s.seed, s.epoch);
    s.batch.epoch = s.epoch;
    s.batch.global_batch = s.global_batch;
    s.batch.samples.reserve(s.hi - s.lo);
    for (std::uint64_t pos = s.lo; pos < s.hi; ++pos) {
      const std::uint64_t idx = opt.shuffle ? perm(pos) : pos;
      auto sample = ds->read(idx);
      if (!sample) {
        if (opt.skip_bad) {
          ++s.skipped;
          continue;
        }
        s.error = sample.error();
        return;
      }
      for (const auto& [ext, bytes] : sample->fields) s.bytes += bytes.size();
      s.batch.samples.push_back(std::move(*sample));
    }
  }

  // Drops everything scheduled and restarts from (epoch, position).
  void seek(std::uint64_t e, std::uint64_t pos) {
    std::lock_guard g(mu);
    ++generation;
    window.clear();
    ready_bytes = 0;
    epoch = e;
    position = pos;
    sched_epoch = e;
    sched_base = pos;
    sched_next = 0;
    sched_done = false;
    schedule();
  }
};

Loader::Loader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Loader::~Loader() {
  {
    std::lock_guard g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  for (auto& t : impl_->readers) t.join();
}

Expected<std::unique_ptr<Loader>> Loader::open(std::shared_ptr<Dataset> ds, LoaderOptions o) {
  if (!ds) return Error{ErrorKind::kUsage, "no dataset"};
  if (o.batch_size == 0) return Error{ErrorKind::kUsage, "batch_size must be positive"};
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return Error{ErrorKind::kUsage, fmt::format("rank {} is not in a world of {}", o.rank, o.world_size)};
  if (ds->size() < static_cast<std::uint64_t>(o.world_size))
    return Error{ErrorKind::kUsage, fmt::format("the dataset has {} samples, fewer than the {} ranks that share it", ds->size(), o.world_size)};
  // Looping over epochs without a single batch would schedule forever.
  if (o.loop && Partition{ds->size(), o.batch_size, 0, o.world_size, o.drop_last}.batches() == 0)
    return Error{ErrorKind::kUsage, fmt::format("the dataset's {} samples make no full global batch of {} (drop_last), so a looping loader has nothing to read",
                                                ds->size(), o.batch_size * static_cast<std::uint64_t>(o.world_size))};
  if (o.threads < 1) o.threads = 1;
  if (o.prefetch_batches < 1) o.prefetch_batches = 1;
  auto impl = std::make_unique<Impl>();
  impl->ds = std::move(ds);
  impl->opt = o;
  Impl* raw = impl.get();
  for (int i = 0; i < o.threads; ++i) impl->readers.emplace_back([raw] { raw->reader_loop(); });
  impl->seek(0, 0);
  return std::unique_ptr<Loader>(new Loader(std::move(impl)));
}

Expected<std::optional<Batch>> Loader::next() {
  Impl& im = *impl_;
  const auto t0 = Clock::now();
  if (!im.first_next) im.first_next = t0;
  std::unique_lock lock(im.mu);
  if (im.window.empty()) {
    im.stats.last_wait_s = 0;
    return std::optional<Batch>();
  }
  std::shared_ptr<Slot> s = im.window.front();
  im.cv.wait(lock, [&] { return s->ready; });
  im.window.pop_front();
  im.ready_bytes -= s->bytes;
  std::uint64_t depth = 0;
  for (auto& w : im.window) depth += w->ready ? 1 : 0;
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  im.stats.last_wait_s = waited;
  im.stats.wait_s += waited;
  im.stats.queue_depth = depth;
  im.stats.skipped += s->skipped;
  if (s->error) {
    im.schedule();
    return *s->error;
  }
  im.epoch = s->epoch;
  im.position = s->end_position;
  ++im.stats.batches;
  im.stats.samples += s->batch.samples.size();
  im.stats.bytes += s->bytes;
  im.stats.elapsed_s = std::chrono::duration<double>(Clock::now() - *im.first_next).count();
  im.schedule();
  return std::optional<Batch>(std::move(s->batch));
}

json Loader::state() const {
  std::lock_guard g(impl_->mu);
  return {{"schema", "pacer.loader/1"},
          {"seed", impl_->opt.seed},
          {"epoch", impl_->epoch},
          {"position", impl_->position},
          {"global_batch", impl_->opt.batch_size * static_cast<std::uint64_t>(impl_->opt.world_size)},
          {"samples", impl_->ds->size()}};
}

Status Loader::load_state(const json& s) {
  try {
    if (s.value("schema", "") != "pacer.loader/1") return Error{ErrorKind::kConfig, "not a pacer loader state (schema pacer.loader/1)"};
    const auto seed = s.at("seed").get<std::uint64_t>();
    const auto epoch = s.at("epoch").get<std::uint64_t>();
    const auto position = s.at("position").get<std::uint64_t>();
    const auto samples = s.at("samples").get<std::uint64_t>();
    if (samples != impl_->ds->size())
      return Error{ErrorKind::kConfig, fmt::format("state is for a dataset of {} samples, this one has {}", samples, impl_->ds->size())};
    if (position > samples) return Error{ErrorKind::kConfig, fmt::format("position {} past the {} samples", position, samples)};
    {
      std::lock_guard g(impl_->mu);  // readers and state() read it
      impl_->opt.seed = seed;
    }
    impl_->seek(epoch, position);
    return {};
  } catch (const json::exception& e) {
    return Error{ErrorKind::kConfig, fmt::format("malformed loader state: {}", e.what())};
  }
}

void Loader::set_epoch(std::uint64_t epoch) { impl_->seek(epoch, 0); }

LoaderStats Loader::stats() const {
  std::lock_guard g(impl_->mu);
  return impl_->stats;
}

std::uint64_t Loader::batches_per_epoch() const { return impl_->partition(0).batches(); }

}  // namespace pacer::data
