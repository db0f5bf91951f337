#include "pacer/comm/reducer.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace pacer::comm {

namespace {

// What top-k sends per element: where and how much.
struct Sparse {
  std::uint32_t index;
  float value;
};
static_assert(sizeof(Sparse) == 8);

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

struct GradientReducer::State {
  struct Bucket {
    std::size_t first = 0, last = 0;    // gradient indices [first, last)
    std::size_t offset = 0, count = 0;  // elements in the flat buffer
    std::size_t pending = 0;            // gradients not yet marked ready this step
    std::vector<std::uint16_t> bf16;    // kBF16: the wire copy
    std::vector<float> residual;        // kTopK: what earlier steps did not send
    std::vector<Sparse> send, recv;     // kTopK
    Request request;
  };
  static Status launch(Collectives& comm, const ReducerOptions& opt, float* flat, Bucket& b, std::size_t& bytes_sent);
  static Status complete(Collectives& comm, const ReducerOptions& opt, float* flat, Bucket& b);
  std::vector<std::size_t> counts, offsets, bucket_of;
  std::vector<char> ready;
  std::vector<Bucket> buckets;
  std::size_t next_launch = 0;  // buckets launch in order on every rank
  std::size_t completed = 0;
  bool sealed = false;
  bool stepping = false;
  Status failure;

  // ProgressMode::kThread: mark_ready() queues buckets, the worker launches
  // and completes them.
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::size_t> queue;
  bool stop = false;
};

GradientReducer::GradientReducer(Collectives& comm, ReducerOptions options)
    : s_(std::make_unique<State>()), comm_(comm), opt_(options) {}

GradientReducer::~GradientReducer() {
  if (s_->worker.joinable()) {
    {
      std::lock_guard lk(s_->mu);
      s_->stop = true;
    }
    s_->cv.notify_all();
    s_->worker.join();
  }
  for (auto& b : s_->buckets) (void)b.request.wait(opt_.timeout_s);
  if (flat_) comm_.release(flat_);
}

Expected<std::size_t> GradientReducer::add(std::size_t count) {
  if (s_->sealed) return Error{ErrorKind::kUsage, "GradientReducer::add after seal()"};
  s_->counts.push_back(count);
  return s_->counts.size() - 1;
}

std::size_t GradientReducer::count(std::size_t i) const { return s_->counts.at(i); }
float* GradientReducer::gradient(std::size_t i) { return flat_ + s_->offsets.at(i); }

std::vector<std::pair<std::size_t, std::size_t>> GradientReducer::bucket_ranges() const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (const auto& b : s_->buckets) out.emplace_back(b.first, b.last);
  return out;
}

Status GradientReducer::seal() {
  if (s_->sealed) return Error{ErrorKind::kUsage, "GradientReducer::seal called twice"};
  if (opt_.bucket_bytes == 0) return Error{ErrorKind::kUsage, "GradientReducer: bucket_bytes must be positive"};
  if (opt_.compression == Compression::kTopK && !(opt_.top_k_ratio > 0 && opt_.top_k_ratio <= 1))
    return Error{ErrorKind::kUsage, "GradientReducer: top_k_ratio must be in (0, 1]"};
  if (opt_.compression != Compression::kNone && comm_.device_buffers())
    return Error{ErrorKind::kUsage, std::string("GradientReducer: compression runs on the CPU; the ") + comm_.backend() +
                                        " backend keeps gradients on the GPU"};
  if (opt_.progress == ProgressMode::kThread && !comm_.other_threads_may_call())
    return Error{ErrorKind::kUsage, "GradientReducer on rank " + std::to_string(comm_.rank()) +
                                        ": the progress thread needs MPI initialised with at least MPI_THREAD_SERIALIZED;"
                                        " initialise it so, or use ProgressMode::kCaller"};
  auto& s = *s_;

  // Every rank must bucket identically, or collectives pair up wrong buffers:
  // compare the layout across ranks (min == max) before the first step.
  std::vector<double> mine = {double(s.counts.size()), double(opt_.bucket_bytes), double(opt_.first_bucket_bytes),
                              double(static_cast<int>(opt_.compression)), opt_.top_k_ratio};
  mine.insert(mine.end(), s.counts.begin(), s.counts.end());
  auto reduce = [&](std::vector<double>& v, ReduceOp op) { return all_reduce_host(comm_, v, op, opt_.timeout_s); };
  std::vector<double> head_lo(mine.begin(), mine.begin() + 5), head_hi = head_lo;
  if (auto st = reduce(head_lo, ReduceOp::kMin); !st) return st;
  if (auto st = reduce(head_hi, ReduceOp::kMax); !st) return st;
  const char* names[] = {"gradient count", "bucket_bytes", "first_bucket_bytes", "compression", "top_k_ratio"};
  for (int i = 0; i < 5; ++i)
    if (head_lo[i] != head_hi[i])
      return Error{ErrorKind::kUsage, "GradientReducer on rank " + std::to_string(comm_.rank()) + ": " + names[i] +
                                          " differs across ranks (" + std::to_string(head_lo[i]) + " to " +
                                          std::to_string(head_hi[i]) + ")"};
  std::vector<double> lo(s.counts.begin(), s.counts.end()), hi = lo;
  if (!lo.empty()) {
    if (auto st = reduce(lo, ReduceOp::kMin); !st) return st;
    if (auto st = reduce(hi, ReduceOp::kMax); !st) return st;
    for (std::size_t i = 0; i < lo.size(); ++i)
      if (lo[i] != hi[i])
        return Error{ErrorKind::kUsage, "GradientReducer on rank " + std::to_string(comm_.rank()) + ": gradient " +
                                            std::to_string(i) + " has " + std::to_string(s.counts[i]) +
                                            " elements here but between " + std::to_string(std::size_t(lo[i])) +
                                            " and " + std::to_string(std::size_t(hi[i])) + " across ranks"};
  }

  // Greedy buckets in registration (= backward) order; the first closes at
  // first_bucket_bytes so the network starts while most of backward remains.
  std::size_t off = 0;
  State::Bucket cur;
  auto close = [&](std::size_t last) {
    cur.last = last;
    cur.count = off - cur.offset;
    s.buckets.push_back(std::move(cur));
    cur = State::Bucket{};
    cur.first = last;
    cur.offset = off;
  };
  for (std::size_t i = 0; i < s.counts.size(); ++i) {
    s.offsets.push_back(off);
    s.bucket_of.push_back(s.buckets.size());
    off += s.counts[i];
    const std::size_t cap = s.buckets.empty() ? std::min(opt_.first_bucket_bytes, opt_.bucket_bytes) : opt_.bucket_bytes;
    if ((off - cur.offset) * sizeof(float) >= std::max<std::size_t>(cap, 1)) close(i + 1);
  }
  if (cur.first < s.counts.size() || s.buckets.empty()) close(s.counts.size());
  total_ = off;
  auto mem = comm_.allocate(std::max<std::size_t>(total_, 1) * sizeof(float));
  if (!mem) return mem.error();
  flat_ = static_cast<float*>(*mem);
  if (!comm_.device_buffers()) std::fill(flat_, flat_ + total_, 0.0f);
  for (auto& b : s.buckets) {
    if (opt_.compression == Compression::kBF16) b.bf16.resize(b.count);
    if (opt_.compression == Compression::kTopK && b.count) {
      const std::size_t k = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(opt_.top_k_ratio * b.count)));
      b.residual.assign(b.count, 0.0f);
      b.send.resize(std::min(k, b.count));
      b.recv.resize(b.send.size() * comm_.size());
    }
  }
  s.ready.assign(s.counts.size(), 0);
  s.sealed = true;
  stats_.buckets = s.buckets.size();
  return {};
}

// Begins bucket b's collective, encoding it first when compressed.
Status GradientReducer::State::launch(Collectives& comm, const ReducerOptions& opt, float* flat, Bucket& b,
                                     std::size_t& bytes_sent) {
  if (b.count == 0) return {};
  float* g = flat + b.offset;
  Expected<Request> r = Request{};
  switch (opt.compression) {
    case Compression::kNone:
      r = comm.all_reduce(g, g, b.count, DType::kF32, ReduceOp::kSum);
      bytes_sent += b.count * sizeof(float);
      break;
    case Compression::kBF16:
      for (std::size_t i = 0; i < b.count; ++i) b.bf16[i] = to_bf16(g[i]);
      r = comm.all_reduce(b.bf16.data(), b.bf16.data(), b.count, DType::kBF16, ReduceOp::kSum);
      bytes_sent += b.count * 2;
      break;
    case Compression::kTopK: {
      // Error feedback: what was not sent last step is added to this step's
      // gradient, so every component is eventually sent.
      for (std::size_t i = 0; i < b.count; ++i) b.residual[i] += g[i];
      const std::size_t k = b.send.size();
      std::vector<std::uint32_t> idx(b.count);
      for (std::size_t i = 0; i < b.count; ++i) idx[i] = static_cast<std::uint32_t>(i);
      std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), [&](std::uint32_t x, std::uint32_t y) {
        const float ax = std::fabs(b.residual[x]), ay = std::fabs(b.residual[y]);
        return ax != ay ? ax > ay : x < y;
      });
      for (std::size_t j = 0; j < k; ++j) {
        b.send[j] = {idx[j], b.residual[idx[j]]};
        b.residual[idx[j]] = 0.0f;
      }
      r = comm.all_gather(b.send.data(), b.recv.data(), k * sizeof(Sparse), DType::kU8);
      bytes_sent += k * sizeof(Sparse);
      break;
    }
  }
  if (!r) return r.error();
  b.request = std::move(*r);
  return {};
}

// Waits for bucket b and writes its result into the flat buffer.
Status GradientReducer::State::complete(Collectives& comm, const ReducerOptions& opt, float* flat, Bucket& b) {
  if (auto st = b.request.wait(opt.timeout_s); !st) return st;
  if (b.count == 0) return {};
  float* g = flat + b.offset;
  if (opt.compression == Compression::kBF16)
    for (std::size_t i = 0; i < b.count; ++i) g[i] = from_bf16(b.bf16[i]);
  if (opt.compression == Compression::kTopK) {
    std::fill(g, g + b.count, 0.0f);
    // Summed in rank order, so every rank gets the same bits.
    for (const Sparse& e : b.recv) g[e.index] += e.value;
  }
  if (opt.average && comm.size() > 1) {
    if (comm.device_buffers()) return {};  // averaged by the caller's kernels; see docs/comm.md
    const float inv = 1.0f / static_cast<float>(comm.size());
    for (std::size_t i = 0; i < b.count; ++i) g[i] *= inv;
  }
  return {};
}

Status GradientReducer::mark_ready(std::size_t i) {
  auto& s = *s_;
  if (!s.sealed) return Error{ErrorKind::kUsage, "GradientReducer::mark_ready before seal()"};
  if (i >= s.counts.size())
    return Error{ErrorKind::kUsage, "GradientReducer::mark_ready(" + std::to_string(i) + "): only " +
                                        std::to_string(s.counts.size()) + " gradients registered"};
  if (s.ready[i]) return Error{ErrorKind::kUsage, "GradientReducer::mark_ready(" + std::to_string(i) + ") twice in one step"};
  if (!s.stepping) {
    s.stepping = true;
    for (auto& b : s.buckets) b.pending = b.last - b.first;
    stats_.bytes_sent = 0;
    stats_.finish_wait_s = 0;
    stats_.buckets_done_before_finish = 0;
    if (opt_.progress == ProgressMode::kThread && !s.worker.joinable()) start_worker();
  }
  s.ready[i] = 1;
  --s.buckets[s.bucket_of[i]].pending;
  // Launch every complete bucket whose predecessors have launched.
  while (s.next_launch < s.buckets.size() && s.buckets[s.next_launch].pending == 0) {
    const std::size_t b = s.next_launch++;
    if (opt_.progress == ProgressMode::kThread) {
      {
        std::lock_guard lk(s.mu);
        s.queue.push_back(b);
      }
      s.cv.notify_all();
    } else if (auto st = State::launch(comm_, opt_, flat_, s.buckets[b], stats_.bytes_sent); !st) {
      return st;
    }
  }
  return progress();
}

Status GradientReducer::progress() {
  auto& s = *s_;
  if (opt_.progress == ProgressMode::kThread) return {};
  for (std::size_t b = s.completed; b < s.next_launch; ++b) {
    auto r = s.buckets[b].request.test();
    if (!r) return r.error();
  }
  return {};
}

std::size_t GradientReducer::buckets_completed() {
  auto& s = *s_;
  if (opt_.progress == ProgressMode::kThread) {
    std::lock_guard lk(s.mu);
    return s.completed;
  }
  std::size_t n = 0;
  for (std::size_t b = 0; b < s.next_launch; ++b) n += s.buckets[b].request.pending() ? 0 : 1;
  return n;
}

void GradientReducer::start_worker() {
  auto& s = *s_;
  s.worker = std::thread([this] {
    auto& s = *s_;
    if (opt_.progress_nice > 0) {
      // MPI's progress polls a core while a bucket is in flight. At a lower
      // priority it yields that core at once to the training thread waking
      // up (to launch the next kernels, or to compute), instead of delaying
      // it by a scheduler slice; an idle core still runs it at full speed.
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), opt_.progress_nice);
    }
    for (;;) {
      std::size_t b;
      {
        std::unique_lock lk(s.mu);
        s.cv.wait(lk, [&] { return s.stop || !s.queue.empty(); });
        if (s.queue.empty()) return;
        b = s.queue.front();
        s.queue.pop_front();
      }
      std::size_t sent = 0;
      Status st = State::launch(comm_, opt_, flat_, s.buckets[b], sent);
      if (st) st = State::complete(comm_, opt_, flat_, s.buckets[b]);
      {
        std::lock_guard lk(s.mu);
        stats_.bytes_sent += sent;
        if (!st && s.failure) s.failure = st;
        ++s.completed;
      }
      s.cv.notify_all();
    }
  });
}

Status GradientReducer::finish() {
  auto& s = *s_;
  if (!s.sealed) return Error{ErrorKind::kUsage, "GradientReducer::finish before seal()"};
  if (!s.stepping) {
    // Every gradient is zero-size (or none was marked): nothing is pending
    // only when there is nothing to send.
    bool all_empty = std::all_of(s.counts.begin(), s.counts.end(), [](std::size_t c) { return c == 0; });
    if (!all_empty) return Error{ErrorKind::kUsage, "GradientReducer::finish before any mark_ready"};
    for (std::size_t i = 0; i < s.counts.size(); ++i)
      if (auto st = mark_ready(i); !st) return st;
    if (!s.stepping) return {};
  }
  for (std::size_t i = 0; i < s.ready.size(); ++i)
    if (!s.ready[i])
      return Error{ErrorKind::kUsage, "GradientReducer::finish: gradient " + std::to_string(i) + " was never marked ready"};
  const auto start = std::chrono::steady_clock::now();
  Status result;
  if (opt_.progress == ProgressMode::kThread) {
    std::unique_lock lk(s.mu);
    stats_.buckets_done_before_finish = static_cast<int>(s.completed);
    s.cv.wait(lk, [&] { return s.completed == s.buckets.size(); });
    result = s.failure;
    s.failure = Status{};
  } else {
    for (std::size_t b = s.completed; b < s.buckets.size(); ++b)
      if (!s.buckets[b].request.pending()) ++stats_.buckets_done_before_finish;
    for (std::size_t b = s.completed; b < s.buckets.size(); ++b) {
      Status st = State::complete(comm_, opt_, flat_, s.buckets[b]);
      if (!st && result) result = st;
    }
  }
  stats_.finish_wait_s = seconds_since(start);
  s.completed = 0;
  s.next_launch = 0;
  s.stepping = false;
  std::fill(s.ready.begin(), s.ready.end(), 0);
  return result;
}

}  // namespace pacer::comm
