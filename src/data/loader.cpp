// The loader: ordered prefetch of one rank's batches by reader threads, bounded in batches and bytes.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <limits>
#include <optional>
#include <thread>

#include "pacer/core/host_buffer.hpp"
#include "pacer/data.hpp"
#include "pacer/hw/cuda_host.hpp"
#include "loader_internal.hpp"

namespace pacer::data {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// BatchBuffer

BatchBuffer::~BatchBuffer() {
  if (pinned_) hw::unpin_host_memory(mem_.data());
}

void BatchBuffer::reserve(std::size_t bytes) {
  if (bytes <= mem_.size()) return;
  // Whole huge pages (one at least): a buffer's first touch faults once per
  // 2 MiB, and so does its first write after the process forked (a
  // DataLoader starting workers, a subprocess) once the child has exited or
  // exec'd: a fork write-protects every page, and with 4 KiB pages the next
  // epoch took a fault per 4 KiB of every pooled buffer
  // (bench/results/loader_fresh-2026-12-05.md). While a child still shares
  // a page, a write copies it either way. Pooled, buffers live long enough
  // to be worth the compaction risk HostBuffer names.
  std::size_t cap = std::max<std::size_t>(mem_.size(), 2u << 20);
  while (cap < bytes) cap *= 2;
  HostBuffer fresh(cap, /*huge=*/true);
  if (size_) std::memcpy(fresh.data(), mem_.data(), size_);
  if (pinned_) hw::unpin_host_memory(mem_.data());
  mem_ = std::move(fresh);
  pinned_ = pin_ && hw::pin_host_memory(mem_.data(), mem_.size());
}

std::size_t BatchBuffer::append(std::size_t n) {
  const std::size_t at = (size_ + 7) & ~std::size_t{7};
  reserve(at + n);
  size_ = at + n;
  return at;
}

Dataset::Sample Batch::sample(std::size_t i) const {
  Dataset::Sample s;
  s.key = keys.at(i);
  for (std::size_t k = first_field.at(i); k < first_field.at(i + 1); ++k) s.fields.emplace_back(exts[fields[k].ext], std::string(bytes(fields[k])));
  return s;
}

namespace {

// Buffers come back here when the last Batch holding one lets go, so the
// steady state reuses memory whose pages are already mapped (and pinned).
// One pool per pin setting for the whole process, as PyTorch's caching host
// allocator keeps pinned blocks: a new loader takes the buffers a closed one
// left, where fresh ones cost it a page fault per 4 KiB on first touch (tens
// of microseconds each on the 2-core VM) and, pinned, a registration each.
// Never destroyed: pinned buffers must not be unpinned after CUDA's teardown.
class BufferPool {
 public:
  static BufferPool& shared(bool pin) {
    static BufferPool* pools[2] = {new BufferPool(false), new BufferPool(true)};
    return *pools[pin ? 1 : 0];
  }
  std::shared_ptr<BatchBuffer> acquire() {
    BatchBuffer* b = nullptr;
    {
      std::lock_guard g(mu_);
      if (!free_.empty()) {
        b = free_.back().release();
        free_.pop_back();
        idle_bytes_ -= b->capacity();
      }
    }
    if (!b) b = new BatchBuffer(pin_);
    b->clear();
    return std::shared_ptr<BatchBuffer>(b, [this](BatchBuffer* p) { give_back(p); });
  }

 private:
  explicit BufferPool(bool pin) : pin_(pin) {}
  void give_back(BatchBuffer* b) {
    std::lock_guard g(mu_);
    // Enough for a loader's prefetch window and a few batches in the
    // caller's hands; beyond that memory is returned to the system.
    if (free_.size() < 16 && idle_bytes_ + b->capacity() <= (256u << 20)) {
      idle_bytes_ += b->capacity();
      free_.emplace_back(b);
    } else {
      delete b;
    }
  }
  bool pin_;
  std::mutex mu_;
  std::vector<std::unique_ptr<BatchBuffer>> free_;
  std::size_t idle_bytes_ = 0;
};

}  // namespace

namespace {

class SampleSource : public Loader::Source {
 public:
  SampleSource(std::shared_ptr<Dataset> ds, const LoaderOptions& o) : ds_(std::move(ds)), shuffle_(o.shuffle), skip_bad_(o.skip_bad) {}
  std::string name() const override { return ds_->name(); }
  std::uint64_t items() const override { return ds_->size(); }
  std::string order() const override { return shuffle_ ? "samples" : "samples in order"; }
  std::uint64_t epoch_size(std::uint64_t, std::uint64_t) override { return ds_->size(); }

  Status fill(std::uint64_t seed, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t& bytes,
              std::uint64_t& skipped) override {
    const Permutation perm(ds_->size(), seed, epoch);
    b.keys.reserve(hi - lo);
    b.first_field.reserve(hi - lo + 1);
    const std::size_t keys0 = b.keys.size(), fields0 = b.fields.size(), firsts0 = b.first_field.size(), exts0 = b.exts.size(),
                      buffer0 = b.buffer->size();
    const std::uint64_t bytes0 = bytes, skipped0 = skipped;
    // Shard sizes are checked once for the batch (a system call per sample
    // costs as much as the copy); when one shrank under the batch, the batch
    // is read again checking each sample, so exactly the samples whose bytes
    // are gone fail (or are skipped), as they would with one read each.
    Dataset::ReadCheck check;
    if (Status st = read_range(perm, lo, hi, b, bytes, skipped, &check); !st) return st;
    if (ds_->confirm(check)) return {};
    b.keys.resize(keys0);
    b.fields.resize(fields0);
    b.first_field.resize(firsts0);
    b.exts.resize(exts0);
    b.buffer->truncate(buffer0);
    bytes = bytes0;
    skipped = skipped0;
    return read_range(perm, lo, hi, b, bytes, skipped, nullptr);
  }

 private:
  Status read_range(const Permutation& perm, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t& bytes, std::uint64_t& skipped,
                    Dataset::ReadCheck* check) const {
    std::vector<std::uint64_t> at;
    // Shuffled samples lie anywhere in the shards and the index: the entry
    // of the sample 4 ahead, the field list of the one 2 ahead and the bytes
    // of the next are asked for now, so their memory latency overlaps this
    // copy (bench/results/loader_speed-2026-12-01.md).
    constexpr std::uint64_t kAhead = 4;
    std::uint64_t ring[kAhead] = {};
    auto index_at = [&](std::uint64_t pos) { return shuffle_ ? perm(pos) : pos; };
    for (std::uint64_t pos = lo; pos < std::min(hi, lo + kAhead); ++pos) {
      ring[pos % kAhead] = index_at(pos);
      ds_->prefetch(ring[pos % kAhead], 2);
    }
    for (std::uint64_t pos = lo; pos < hi; ++pos) {
      const std::uint64_t idx = ring[pos % kAhead];
      if (pos + kAhead < hi) {
        ring[pos % kAhead] = index_at(pos + kAhead);
        ds_->prefetch(ring[pos % kAhead], 2);
      }
      if (pos + 2 < hi) ds_->prefetch(ring[(pos + 2) % kAhead], 1);
      if (pos + 1 < hi) ds_->prefetch(ring[(pos + 1) % kAhead], 0);
      const std::size_t mark = b.buffer->size();
      auto e = ds_->read_fields(idx, *b.buffer, check, at);
      if (!e) {
        if (skip_bad_) {
          ++skipped;
          b.buffer->truncate(mark);  // drop the partial read, keep what came before
          continue;
        }
        return e.error();
      }
      const SampleTable& t = *e->table;
      b.keys.emplace_back(t.key(e->row));
      const auto* f = t.fields_begin(e->row);
      for (std::size_t k = 0; k < at.size(); ++k, ++f) {
        const std::string& ext = t.ext(f->ext);
        std::uint32_t x = 0;
        while (x < b.exts.size() && b.exts[x] != ext) ++x;
        if (x == b.exts.size()) b.exts.push_back(ext);
        b.fields.push_back({x, at[k], f->size});
        bytes += f->size;
      }
      b.first_field.push_back(b.fields.size());
    }
    return {};
  }

  std::shared_ptr<Dataset> ds_;
  bool shuffle_;
  bool skip_bad_;
};

// Token data: documents, shuffled per epoch, either one per row (cut to
// seq_len, optionally bucketed by length) or packed into seq_len-token rows.
// An epoch's order is materialized once (8 bytes per document, plus the
// packing plan), as Megatron's sample index is, and kept for two epochs so
// prefetching across an epoch boundary does not recompute it.
class TokenSource : public Loader::Source {
 public:
  TokenSource(std::shared_ptr<TokenDataset> ds, const LoaderOptions& o) : ds_(std::move(ds)), o_(o) {}
  std::string name() const override { return ds_->prefix(); }
  std::uint64_t items() const override { return ds_->documents(); }
  std::string order() const override {
    const char* sh = o_.shuffle ? "" : " in order";
    if (o_.pack) return fmt::format("packed seq_len={} window={}{}", o_.seq_len, o_.pack_window, sh);
    // Bucket windows hold whole global batches, so the order depends on the global batch too.
    if (o_.bucket_window)
      return fmt::format("documents bucketed window={} global_batch={} seq_len={}{}", o_.bucket_window, global_batch(), o_.seq_len, sh);
    return fmt::format("documents seq_len={}{}", o_.seq_len, sh);
  }
  std::string legacy_order() const override {
    if (o_.pack || !o_.bucket_window) return "";
    return fmt::format("documents bucketed window={} seq_len={}{}", o_.bucket_window, o_.seq_len, o_.shuffle ? "" : " in order");
  }
  std::uint64_t global_batch() const { return o_.batch_size * static_cast<std::uint64_t>(o_.world_size); }
  std::uint64_t epoch_size(std::uint64_t seed, std::uint64_t epoch) override {
    auto p = plan(seed, epoch);
    return o_.pack ? p->packing.rows() : p->docs.size();
  }
  // Planning a shuffled epoch of 68,000 documents took ~0.026 CPU s of the
  // epoch's ~0.14, on the consumer's thread with the readers idle
  // (bench/results/tokens_speed-2026-12-01.md).
  // One thread: the other readers are still reading the epoch's last batches.
  void prepare(std::uint64_t seed, std::uint64_t epoch) override { (void)plan(seed, epoch, 1); }

  Status fill(std::uint64_t seed, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t& bytes,
              std::uint64_t&) override {
    const std::uint64_t rows = hi - lo;
    const std::uint64_t cols = token_cols(seed, epoch, lo, hi);
    allocate_token_rows(b, rows, cols, token_labels());
    std::vector<std::uint64_t> dest(rows);
    for (std::uint64_t r = 0; r < rows; ++r) dest[r] = r;
    std::vector<TokenRow> meta(rows);
    if (Status st = fill_token_rows(seed, epoch, lo, hi, b, cols, dest.data(), meta.data()); !st) return st;
    append_token_rows(b, cols, meta);
    bytes += rows * cols * sizeof(std::int64_t);
    return {};
  }

  bool token_labels() const override { return ds_->loss_mask() != nullptr; }

  std::uint64_t token_cols(std::uint64_t seed, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi) override {
    if (o_.pack) return o_.seq_len;
    auto p = plan(seed, epoch);
    std::uint64_t longest = 0;
    for (std::uint64_t pos = lo; pos < hi; ++pos) longest = std::max(longest, ds_->document_tokens(p->docs[pos]));
    return o_.seq_len ? std::min(o_.seq_len, longest) : longest;
  }

  Status fill_token_rows(std::uint64_t seed, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t cols,
                         const std::uint64_t* dest, TokenRow* meta) override {
    auto p = plan(seed, epoch);
    const TokenDataset* mask = ds_->loss_mask();
    auto* tokens = reinterpret_cast<std::int64_t*>(b.buffer->data() + b.tokens_offset);
    auto* positions = reinterpret_cast<std::int32_t*>(b.buffer->data() + b.positions_offset);
    std::vector<std::int64_t> trained;
    // The .bin files' sizes are checked once for the batch, after its copies
    // (docs/data.md, "Token datasets").
    std::uint64_t furthest = 0, mask_furthest = 0;
    for (std::uint64_t k = 0; k < hi - lo; ++k) {
      const std::uint64_t r = dest[k];
      TokenRow& m = meta[r];
      std::int64_t* row = tokens + r * cols;
      std::int32_t* pos = positions + r * cols;
      std::int64_t* labels = nullptr;
      std::uint8_t* loss = nullptr;
      if (mask) {
        labels = reinterpret_cast<std::int64_t*>(b.buffer->data() + b.labels_offset) + r * cols;
        loss = b.buffer->data() + b.loss_mask_offset + r * cols;
        std::fill(labels, labels + cols, kIgnoreLabel);
        std::fill(loss, loss + cols, std::uint8_t{0});
      }
      std::uint64_t at = 0;
      auto segment = [&](std::int64_t doc, std::uint64_t n) {
        // A local pointer and a 32-bit count (n <= seq_len < 2^31): the loop
        // vectorizes to one add per four positions instead of two 64-bit adds
        // and a shuffle.
        std::int32_t* q = pos + at;
        const auto count = static_cast<std::int32_t>(n);
        for (std::int32_t i = 0; i < count; ++i) q[i] = i;
        at += n;
        m.segments.emplace_back(at, doc);
      };
      // Token j's label is token j+1 when that one is trained and in the
      // same segment: nothing is learnt across a document boundary.
      auto label = [&](std::uint64_t d, std::uint64_t offset, std::uint64_t n) -> Status {
        if (!mask || n == 0) return {};
        trained.resize(n);
        if (Status st = mask->copy_tokens(d, offset, n, trained.data(), &mask_furthest); !st) return st;
        for (std::uint64_t i = 0; i + 1 < n; ++i)
          if (trained[i + 1]) {
            labels[at + i] = row[at + i + 1];
            loss[at + i] = 1;
          }
        return {};
      };
      if (o_.pack) {
        const PackPlan& pp = p->packing;
        // Pieces of shuffled documents lie anywhere in the .idx arrays and the
        // .bin: the index entry of the piece 6 ahead, its sequence 4 ahead and
        // the tokens of the piece 2 ahead are asked for while this one is
        // widened (1, 2 or 4 pieces apart measured the same).
        const std::uint64_t pieces_end = pp.first_piece[hi];
        constexpr std::uint64_t kPieceAhead = 2;
        auto ahead = [&](std::uint64_t j, int stage) {
          if (j < pieces_end) ds_->prefetch(pp.pieces[j].document, pp.pieces[j].offset, stage);
        };
        if (k == 0)
          for (std::uint64_t j = pp.first_piece[lo]; j < std::min(pieces_end, pp.first_piece[lo] + kPieceAhead); ++j) {
            ahead(j, 2);
            ahead(j, 1);
            ahead(j, 0);
          }
        for (std::uint64_t j = pp.first_piece[lo + k]; j < pp.first_piece[lo + k + 1]; ++j) {
          const PackPiece& piece = pp.pieces[j];
          ahead(j + 3 * kPieceAhead, 2);
          ahead(j + 2 * kPieceAhead, 1);
          ahead(j + kPieceAhead, 0);
          if (Status st = ds_->copy_tokens(piece.document, piece.offset, piece.length, row + at, &furthest); !st) return st;
          if (Status st = label(piece.document, piece.offset, piece.length); !st) return st;
          segment(static_cast<std::int64_t>(piece.document), piece.length);
        }
      } else {
        const std::uint64_t d = p->docs[lo + k];
        const std::uint64_t n = ds_->document_tokens(d);
        const std::uint64_t keep = std::min(n, cols);
        if (Status st = ds_->copy_tokens(d, 0, keep, row, &furthest); !st) return st;
        if (Status st = label(d, 0, keep); !st) return st;
        m.truncated += n - keep;
        segment(static_cast<std::int64_t>(d), keep);
      }
      m.length = at;
      if (at < cols) {
        // Only the tail is padded: the tokens before it were just written.
        std::fill(row + at, row + cols, o_.pad_id);
        segment(-1, cols - at);
      }
    }
    if (Status st = ds_->check_size(furthest); !st) return st;
    if (mask)
      if (Status st = mask->check_size(mask_furthest); !st) return st;
    return {};
  }

 private:
  struct Plan {
    std::vector<std::uint64_t> docs;  // unpacked: the document at each position
    PackPlan packing;                 // packed
  };

  // A plan asked for when a batch needs it is made on as many threads as the
  // loader has readers, which wait for it meanwhile: a new loader's first
  // plan (~0.026 CPU s for 68,000 documents) held every reader back
  // (bench/results/tokens_speed-2026-12-01.md).
  std::shared_ptr<const Plan> plan(std::uint64_t seed, std::uint64_t epoch, int threads = 0) {
    std::lock_guard g(mu_);
    const auto key = std::make_pair(seed, epoch);
    if (auto it = plans_.find(key); it != plans_.end()) return it->second;
    if (threads <= 0) threads = o_.threads;
    auto p = std::make_shared<Plan>();
    const std::uint64_t n = ds_->documents();
    std::vector<std::uint64_t> order(n);
    const Permutation perm(n, seed, epoch);
    auto fill = [&](std::uint64_t lo, std::uint64_t hi) {
      if (o_.shuffle) perm.fill(lo, hi, order.data() + lo);
      else
        for (std::uint64_t i = lo; i < hi; ++i) order[i] = i;
    };
    const std::uint64_t parts = std::min<std::uint64_t>(static_cast<std::uint64_t>(std::max(1, threads)), n / 16384);
    if (parts <= 1) {
      fill(0, n);
    } else {
      std::vector<std::thread> pool;
      for (std::uint64_t t = 1; t < parts; ++t) pool.emplace_back(fill, n * t / parts, n * (t + 1) / parts);
      fill(0, n / parts);
      for (auto& t : pool) t.join();
    }
    if (o_.pack) {
      // Validated at open (seq_len > 0, documents in range), so planning cannot fail.
      p->packing = std::move(*plan_packing(*ds_, order, o_.seq_len, o_.pack_window, threads));
    } else {
      if (o_.bucket_window) bucket(order, seed, epoch);
      p->docs = std::move(order);
    }
    while (plans_.size() >= 2) plans_.erase(plans_.begin());
    plans_.emplace(key, p);
    return p;
  }

  // Within each window of bucket_window global batches, sorts documents by
  // length (so a batch holds documents of similar length and little
  // padding), then shuffles the window's global batches so lengths do not
  // ramp within the window.
  void bucket(std::vector<std::uint64_t>& order, std::uint64_t seed, std::uint64_t epoch) const {
    const std::uint64_t gb = global_batch();
    const std::uint64_t w = o_.bucket_window * gb;
    std::vector<std::uint64_t> tmp;
    for (std::uint64_t start = 0; start < order.size(); start += w) {
      const std::uint64_t end = std::min<std::uint64_t>(order.size(), start + w);
      auto first = order.begin() + static_cast<long>(start);
      auto last = order.begin() + static_cast<long>(end);
      std::stable_sort(first, last, [&](std::uint64_t a, std::uint64_t b) { return ds_->document_tokens(a) < ds_->document_tokens(b); });
      // Only whole global batches move, so the last partial one stays last.
      const std::uint64_t full = (end - start) / gb;
      if (full < 2 || !o_.shuffle) continue;
      const Permutation bp(full, seed ^ 0x6275636b6574ULL, epoch * 0x100000001b3ULL + start / w);
      tmp.assign(first, first + static_cast<long>(full * gb));
      for (std::uint64_t k = 0; k < full; ++k)
        std::copy_n(tmp.begin() + static_cast<long>(bp(k) * gb), gb, first + static_cast<long>(k * gb));
    }
  }

  std::shared_ptr<TokenDataset> ds_;
  LoaderOptions o_;
  std::mutex mu_;
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::shared_ptr<const Plan>> plans_;
};

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
  std::unique_ptr<Source> src;
  BufferPool* pool = nullptr;
  LoaderOptions opt;

  mutable std::mutex mu;
  std::condition_variable cv;        // readers: a slot to read, or room under max_bytes
  std::condition_variable ready_cv;  // the consumer: the slots it waits for are ready
  std::deque<std::shared_ptr<Slot>> window;  // scheduled, in order
  std::vector<std::thread> readers;
  bool stopping = false;
  std::uint64_t generation = 0;   // bumped on seek: stale reads are dropped
  std::uint64_t ready_bytes = 0;

  // Position of the consumer.
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;     // items of this epoch consumed by all ranks together
  // Where scheduling stands (ahead of the consumer).
  std::uint64_t sched_epoch = 0;
  std::uint64_t sched_base = 0;   // the epoch position its batches count from
  std::uint64_t sched_next = 0;   // next global batch to schedule
  bool sched_done = false;        // epoch fully scheduled and not looping
  // The epoch a reader is to prepare (Source::prepare) once idle, if any.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> prepare;  // seed, epoch
  bool moved_on = false;  // seek() went to another epoch than the consumer's
  // How many slots at the front of the window the waiting consumer waits for
  // (0: it is not waiting).
  std::size_t consumer_wants = 0;

  LoaderStats stats;
  std::optional<Clock::time_point> first_next;

  Partition partition(std::uint64_t e, std::uint64_t base) const {
    const std::uint64_t n = src->epoch_size(opt.seed, e);
    Partition p;
    p.samples = n - std::min(base, n);
    p.batch_size = opt.batch_size;
    p.rank = opt.rank;
    p.world_size = opt.world_size;
    p.drop_last = opt.drop_last;
    return p;
  }

  // Called with mu held: top the window up to prefetch_batches.
  void schedule() {
    std::size_t added = 0;
    while (!sched_done && window.size() < opt.prefetch_batches) {
      const Partition p = partition(sched_epoch, sched_base);
      if (sched_next >= p.batches()) {
        if (!opt.loop) {
          sched_done = true;
          // A loader that went on to another epoch once is likely to again
          // (set_epoch, or a new loop over it): an idle reader prepares the
          // next one meanwhile. One read for a single epoch and dropped does
          // not pay for a plan it never uses (that cost a new loader's epoch
          // ~0.03 s of its 2 cores, measured).
          if (moved_on) {
            prepare = std::make_pair(opt.seed, sched_epoch + 1);
            cv.notify_one();
          }
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
      ++added;
    }
    // A slot is work for one reader: waking every reader for one slot sent
    // the others straight back to sleep.
    if (added == 1) cv.notify_one();
    else if (added > 1) cv.notify_all();
  }

  void reader_loop() {
    std::unique_lock lock(mu);
    for (;;) {
      cv.wait(lock, [&] {
        if (stopping || (prepare && !first_untaken())) return true;
        // Bounded memory: wait while ready batches hold max_bytes, unless the
        // consumer is waiting for the very first one.
        if (ready_bytes >= opt.max_bytes && !(window.size() && !window.front()->ready && !window.front()->taken)) return false;
        return first_untaken() != nullptr;
      });
      if (stopping) return;
      if (prepare && !first_untaken()) {
        const auto [seed, e] = *prepare;
        prepare.reset();
        lock.unlock();
        src->prepare(seed, e);
        lock.lock();
        continue;
      }
      std::shared_ptr<Slot> s = first_untaken();
      if (!s) continue;
      s->taken = true;
      const std::uint64_t gen = generation;
      lock.unlock();
      fill(*s);
      lock.lock();
      if (gen != generation) continue;  // a seek dropped this slot
      s->ready = true;
      ready_bytes += s->bytes;
      // Only the consumer waits for slots, and only for those at the front: a
      // wake-up of every thread per batch cost ~2 context switches a batch
      // (on a VM, several microseconds each; 22,000 for 8,192 token batches).
      if (consumer_wants && front_ready(consumer_wants)) ready_cv.notify_one();
    }
  }

  // Called with mu held: the first scheduled slot no reader has, if any.
  std::shared_ptr<Slot> first_untaken() const {
    for (const auto& w : window)
      if (!w->taken) return w;
    return nullptr;
  }

  // Called with mu held.
  bool front_ready(std::size_t n) const {
    if (window.size() < n) return false;
    for (std::size_t i = 0; i < n; ++i)
      if (!window[i]->ready) return false;
    return true;
  }

  void fill(Slot& s) {
    s.batch.epoch = s.epoch;
    s.batch.global_batch = s.global_batch;
    s.batch.buffer = pool->acquire();
    if (Status st = src->fill(s.seed, s.epoch, s.lo, s.hi, s.batch, s.bytes, s.skipped); !st) s.error = st.error();
  }

  // Drops everything scheduled and restarts from (epoch, position).
  void seek(std::uint64_t e, std::uint64_t pos) {
    std::lock_guard g(mu);
    ++generation;
    prepare.reset();
    if (e != epoch) moved_on = true;
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
  impl_->ready_cv.notify_all();
  for (auto& t : impl_->readers) t.join();
}

Status check_loader_options(const LoaderOptions& o, std::uint64_t items, const char* what, const std::string& name) {
  if (o.batch_size == 0) return Error{ErrorKind::kUsage, "batch_size must be positive"};
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return Error{ErrorKind::kUsage, fmt::format("rank {} is not in a world of {}", o.rank, o.world_size)};
  if (items < static_cast<std::uint64_t>(o.world_size))
    return Error{ErrorKind::kUsage, fmt::format("{}: the dataset has {} {}, fewer than the {} ranks that share it", name, items, what, o.world_size)};
  // Positions are counted in u64: a global batch (or a bucket window of
  // them) that does not fit would wrap, and a window of 0 never advances.
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  const auto world = static_cast<std::uint64_t>(o.world_size);
  if (o.batch_size > kMax / world)
    return Error{ErrorKind::kUsage, fmt::format("batch_size {} x world_size {} does not fit 64 bits", o.batch_size, o.world_size)};
  if (o.bucket_window && o.bucket_window > kMax / (o.batch_size * world))
    return Error{ErrorKind::kUsage, fmt::format("bucket_window {} global batches of {} does not fit 64 bits", o.bucket_window, o.batch_size * world)};
  return {};
}

Status check_state_counts(const json& s, std::initializer_list<const char*> keys, std::string_view where) {
  auto count = [](const json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0); };
  for (const char* k : keys) {
    if (!s.contains(k)) continue;
    const json& v = s.at(k);
    const bool ok = v.is_array() ? std::all_of(v.begin(), v.end(), count) : count(v);
    if (!ok)
      return Error{ErrorKind::kConfig, fmt::format("{}{}{}: {} is not {}", where, where.empty() ? "" : ".", k, v.dump(),
                                                   v.is_array() ? "a list of non-negative integers" : "a non-negative integer")};
  }
  return {};
}

Expected<std::unique_ptr<Loader>> Loader::start(std::unique_ptr<Source> src, LoaderOptions o) {
  if (o.threads < 0) o.threads = 0;
  if (o.prefetch_batches < 1) o.prefetch_batches = 1;
  auto impl = std::make_unique<Loader::Impl>();
  impl->src = std::move(src);
  impl->pool = &BufferPool::shared(o.pin_memory);
  impl->opt = o;
  // Looping over epochs without a single batch would schedule forever.
  if (o.loop && impl->partition(0, 0).batches() == 0)
    return Error{ErrorKind::kUsage, fmt::format("{}: the dataset's {} items make no full global batch of {} (drop_last), so a looping loader has nothing to read",
                                                impl->src->name(), impl->src->epoch_size(o.seed, 0), o.batch_size * static_cast<std::uint64_t>(o.world_size))};
  Impl* raw = impl.get();
  for (int i = 0; i < o.threads; ++i) raw->readers.emplace_back([raw] { raw->reader_loop(); });
  raw->seek(0, 0);
  return std::unique_ptr<Loader>(new Loader(std::move(impl)));
}

Expected<std::unique_ptr<Loader::Source>> make_sample_source(std::shared_ptr<Dataset> ds, const LoaderOptions& o) {
  if (!ds) return Error{ErrorKind::kUsage, "no dataset"};
  return std::unique_ptr<Loader::Source>(std::make_unique<SampleSource>(std::move(ds), o));
}

Expected<std::unique_ptr<Loader::Source>> make_token_source(std::shared_ptr<TokenDataset> ds, LoaderOptions o) {
  if (!ds) return Error{ErrorKind::kUsage, "no dataset"};
  if (ds->dtype() == "float32" || ds->dtype() == "float64")
    return Error{ErrorKind::kUsage, fmt::format("{}: dtype {} holds no token ids", ds->prefix(), ds->dtype())};
  if (o.pack && o.seq_len == 0) return Error{ErrorKind::kUsage, "pack needs seq_len, the length of a packed row"};
  if (o.seq_len > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) return Error{ErrorKind::kUsage, "seq_len too large"};
  if (o.pack && o.bucket_window) return Error{ErrorKind::kUsage, "bucket_window is for unpacked rows; packed rows are all seq_len long"};
  if (o.pack && o.pack_window == 0) o.pack_window = 1;
  return std::unique_ptr<Loader::Source>(std::make_unique<TokenSource>(std::move(ds), o));
}

Expected<std::unique_ptr<Loader>> Loader::open(std::shared_ptr<Dataset> ds, LoaderOptions o) {
  if (!ds) return Error{ErrorKind::kUsage, "no dataset"};
  if (Status st = check_loader_options(o, ds->size(), "samples", ds->name()); !st) return st.error();
  auto src = make_sample_source(std::move(ds), o);
  if (!src) return src.error();
  return start(std::move(*src), o);
}

Expected<std::unique_ptr<Loader>> Loader::open(std::shared_ptr<TokenDataset> ds, LoaderOptions o) {
  if (!ds) return Error{ErrorKind::kUsage, "no dataset"};
  if (Status st = check_loader_options(o, ds->documents(), "documents", ds->prefix()); !st) return st.error();
  if (o.pack && o.pack_window == 0) o.pack_window = 1;
  auto src = make_token_source(std::move(ds), o);
  if (!src) return src.error();
  return start(std::move(*src), o);
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
  // A consumer that would wait reads a batch itself, as one more reader: on
  // a machine with as many cores as readers, a sleeping consumer left a core
  // idle while it waited and took one from a reader when it woke (2 readers
  // on the 2-core VM, an epoch of 2,055 packed batches: ~1,700 sleeps and
  // ~800 preemptions of the three threads, ~150 and ~30 once it reads).
  // It takes the first slot no reader has, within max_bytes. With no reader
  // threads at all (threads 0) it reads every batch itself, as PyTorch's
  // DataLoader does with num_workers=0.
  while (!s->ready && !im.stopping) {
    std::shared_ptr<Slot> t;
    if (!s->taken) t = s;  // as the readers may, whatever max_bytes holds
    else if (im.ready_bytes < im.opt.max_bytes) t = im.first_untaken();
    if (!t) break;
    t->taken = true;
    lock.unlock();
    im.fill(*t);
    lock.lock();
    // Only the consumer seeks, so no seek dropped this slot meanwhile.
    t->ready = true;
    im.ready_bytes += t->bytes;
    ++im.stats.consumer_reads;
  }
  if (!s->ready) {
    // A consumer faster than its readers would sleep and be woken once per
    // batch, each a futex call on both sides and often an IPI (~15% of a
    // packed-token epoch's CPU time on the 2-core VM). It waits for the next
    // slot too when a reader already has it, which will be ready without
    // further scheduling, so it wakes once per two batches; the readers never
    // wait for it, so the rate is the same. Not for the first batch, whose
    // latency a training loop sees.
    std::size_t want = 1;
    if (im.stats.batches > 0 && im.window.size() > 1 && im.window[1]->taken) want = 2;
    im.consumer_wants = want;
    im.ready_cv.wait(lock, [&] { return im.front_ready(want); });
    im.consumer_wants = 0;
  }
  im.window.pop_front();
  // Readers held back by max_bytes may go on (schedule() wakes them only for new slots).
  if (im.ready_bytes >= im.opt.max_bytes) im.cv.notify_all();
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
  const Batch& b = s->batch;
  ++im.stats.batches;
  im.stats.samples += b.size();
  im.stats.bytes += s->bytes;
  if (b.rows) {
    for (auto n : b.lengths) im.stats.tokens += static_cast<std::uint64_t>(n);
    im.stats.padding += b.padding;
    im.stats.truncated += b.truncated;
  }
  im.stats.elapsed_s = std::chrono::duration<double>(Clock::now() - *im.first_next).count();
  im.schedule();
  return std::optional<Batch>(std::move(s->batch));
}

json Loader::state() const {
  std::lock_guard g(impl_->mu);
  json s = {{"schema", "pacer.loader/1"},
            {"seed", impl_->opt.seed},
            {"epoch", impl_->epoch},
            {"position", impl_->position},
            {"global_batch", impl_->opt.batch_size * static_cast<std::uint64_t>(impl_->opt.world_size)},
            {"samples", impl_->src->items()},
            {"order", impl_->src->order()}};
  impl_->src->save_state(s, impl_->epoch, impl_->position);
  return s;
}

Status Loader::load_state(const json& s) {
  try {
    if (s.value("schema", "") != "pacer.loader/1") return Error{ErrorKind::kConfig, "not a pacer loader state (schema pacer.loader/1)"};
    if (Status st = check_state_counts(s, {"seed", "epoch", "position", "samples", "global_batch"}, "loader state"); !st) return st;
    const auto seed = s.at("seed").get<std::uint64_t>();
    const auto epoch = s.at("epoch").get<std::uint64_t>();
    const auto position = s.at("position").get<std::uint64_t>();
    const auto samples = s.at("samples").get<std::uint64_t>();
    if (Status st = impl_->src->check_state(s, seed, epoch, position); !st) return st;
    if (samples != impl_->src->items())
      return Error{ErrorKind::kConfig, fmt::format("state is for a dataset of {} items, this one has {}", samples, impl_->src->items())};
    // States saved before "order" existed are sample-order states.
    const std::string order = s.value("order", std::string(impl_->opt.shuffle ? "samples" : "samples in order"));
    const std::uint64_t gb = impl_->opt.batch_size * static_cast<std::uint64_t>(impl_->opt.world_size);
    const bool legacy = !impl_->src->legacy_order().empty() && order == impl_->src->legacy_order() && s.contains("global_batch") &&
                        s.at("global_batch").get<std::uint64_t>() == gb;
    if (order != impl_->src->order() && !legacy) {
      std::string why = fmt::format("state is for order '{}', this loader reads '{}'", order, impl_->src->order());
      if (s.contains("global_batch") && s.at("global_batch").get<std::uint64_t>() != gb)
        why += fmt::format(" (saved at global batch {}, this loader's is {})", s.at("global_batch").get<std::uint64_t>(), gb);
      return Error{ErrorKind::kConfig, why};
    }
    const std::uint64_t n = impl_->src->epoch_size(seed, epoch);
    if (position > n) return Error{ErrorKind::kConfig, fmt::format("position {} past the {} items of epoch {}", position, n, epoch)};
    {
      std::lock_guard g(impl_->mu);  // readers and state() read it
      impl_->opt.seed = seed;
    }
    impl_->src->apply_state(s, epoch, position);
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

std::uint64_t Loader::batches_per_epoch() const {
  std::lock_guard g(impl_->mu);
  return impl_->partition(impl_->epoch, 0).batches();
}

}  // namespace pacer::data
