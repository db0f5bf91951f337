// Bucketed gradient all-reduce that overlaps communication with the backward pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "pacer/comm/collectives.hpp"
#include "pacer/core/error.hpp"

namespace pacer::comm {

enum class Compression {
  kNone,  // fp32 all-reduce: the exact sum (bit for bit when sums are exact)
  kBF16,  // each bucket sent as bf16 (half the bytes), summed, expanded back
  kTopK,  // each rank sends its top_k_ratio largest |g| (+ error feedback)
};

// How non-blocking collectives make progress while the caller computes.
enum class ProgressMode {
  kThread,  // a reducer thread launches buckets and drives them
  kCaller,  // mark_ready() and progress() test the requests in flight
};

struct ReducerOptions {
  std::size_t bucket_bytes = 25u << 20;      // fp32 bytes per bucket (a gradient larger than this gets its own)
  std::size_t first_bucket_bytes = 1u << 20; // the first bucket closes early so communication starts soon
  Compression compression = Compression::kNone;
  double top_k_ratio = 0.01;                 // kTopK: fraction of each bucket's elements sent
  bool average = true;                       // divide by the world size in finish()
  ProgressMode progress = ProgressMode::kThread;
  // kThread: the reducer thread's nice value (Linux threads have their own);
  // above 0 it gives way to the training thread whenever both want a core.
  int progress_nice = 10;
  // Per collective. 0 waits forever and lets the MPI backend run the blocking
  // (faster) collective on the reducer thread; > 0 takes MPI's non-blocking
  // path, which can give up and name this rank (see docs/comm.md).
  double timeout_s = 0;
};

struct ReducerStats {
  std::size_t buckets = 0;
  std::size_t bytes_sent = 0;     // per rank, this step, as handed to the collectives
  double finish_wait_s = 0;       // time finish() waited: the communication left exposed
  int buckets_done_before_finish = 0;
};

// Gradients live in one flat fp32 buffer the reducer owns (host memory, or
// device memory when the collectives need it); add() hands out each
// gradient's slice, so bucketing copies nothing.
//
// Use per step, from one thread: mark_ready(i) for every gradient in any
// order as backward produces it; a bucket launches as soon as it and every
// bucket before it are complete (every rank launches buckets in the same
// order, as MPI and NCCL require); finish() waits for all, averages when
// asked, and resets for the next step. With ProgressMode::kThread no MPI call
// may be made by other threads between the first mark_ready() and finish().
class GradientReducer {
 public:
  GradientReducer(Collectives& comm, ReducerOptions options);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Registers a gradient of `count` fp32 elements, in the order backward
  // produces them; returns its index. Zero-size gradients are allowed (they
  // are always ready). Only before seal().
  Expected<std::size_t> add(std::size_t count);
  // Builds buckets and the flat buffer; collective: checks that every rank
  // registered the same gradients (counts, options) and fails naming the
  // first gradient that differs, instead of hanging or corrupting data.
  Status seal();

  // The slice of gradient i (after seal()); where backward writes it.
  float* gradient(std::size_t i);
  std::size_t count(std::size_t i) const;
  float* flat() { return flat_; }
  std::size_t total_count() const { return total_; }
  // Buckets as [first, last) gradient index ranges, for tests and reports.
  std::vector<std::pair<std::size_t, std::size_t>> bucket_ranges() const;

  Status mark_ready(std::size_t i);
  // Tests requests in flight (ProgressMode::kCaller); cheap, call it between
  // compute chunks.
  Status progress();
  Status finish();
  // Buckets whose all-reduce has completed this step (cheap; any time).
  std::size_t buckets_completed();
  const ReducerStats& stats() const { return stats_; }

 private:
  struct State;
  void start_worker();
  std::unique_ptr<State> s_;
  Collectives& comm_;
  ReducerOptions opt_;
  float* flat_ = nullptr;
  std::size_t total_ = 0;
  ReducerStats stats_;
};

}  // namespace pacer::comm
