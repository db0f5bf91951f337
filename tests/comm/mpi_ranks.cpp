// The collectives and the GradientReducer across real MPI ranks.
// Run as: mpirun -np N comm_mpi_test
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "pacer/comm.hpp"

namespace {

using namespace pacer::comm;

int failures = 0;
int g_rank = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", g_rank, what.c_str());
  }
}

// Gradient sizes with the awkward cases: zero-size, single elements, one
// larger than most buckets.
const std::vector<std::size_t> kSizes = {1000, 1, 0, 37, 5000, 123, 20000, 7, 3000, 0, 4096};

// Small integers: every sum over ranks is exact in fp32 (and in bf16).
float value(int rank, int step, std::size_t i) { return float(int((rank + 1) * 7 + step * 3 + i * 5) % 17 - 8); }

void fill(GradientReducer& r, int rank, int step) {
  std::size_t base = 0;
  for (std::size_t g = 0; g < kSizes.size(); ++g) {
    float* p = r.gradient(g);
    for (std::size_t i = 0; i < kSizes[g]; ++i) p[i] = value(rank, step, base + i);
    base += kSizes[g];
  }
}

std::vector<float> plain_all_reduce(Collectives& c, int step, std::size_t total, bool average) {
  std::vector<float> v(total);
  for (std::size_t i = 0; i < total; ++i) v[i] = value(c.rank(), step, i);
  check(bool(c.all_reduce(v.data(), v.data(), total, DType::kF32, ReduceOp::kSum).value().wait(60)), "plain all-reduce");
  if (average) {
    const float inv = 1.0f / float(c.size());
    for (float& x : v) x *= inv;
  }
  return v;
}

std::string name(const ReducerOptions& o) {
  return "bucket " + std::to_string(o.bucket_bytes) + " first " + std::to_string(o.first_bucket_bytes) +
         (o.progress == ProgressMode::kThread ? " thread" : " caller") + " compression " +
         std::to_string(int(o.compression)) + (o.average ? " avg" : " sum");
}

// Marks gradients in an order that differs per rank, so buckets complete in
// different orders on different ranks; launches must still line up.
std::vector<std::size_t> mark_order(int rank) {
  std::vector<std::size_t> order(kSizes.size());
  std::iota(order.begin(), order.end(), 0);
  if (rank % 2) std::swap(order[1], order[3]), std::swap(order[5], order[6]);
  return order;
}

void exact_sum(Collectives& c) {
  for (std::size_t bucket : {4ul, 64ul, 4096ul, 40000ul, 1ul << 20})
    for (std::size_t first : {bucket, std::max<std::size_t>(4, bucket / 8)})
      for (ProgressMode mode : {ProgressMode::kThread, ProgressMode::kCaller})
        for (Compression comp : {Compression::kNone, Compression::kBF16}) {
          ReducerOptions o;
          o.bucket_bytes = bucket;
          o.first_bucket_bytes = first;
          o.progress = mode;
          o.compression = comp;
          o.average = bucket % 8 == 0;
          // Both MPI paths: blocking on the reducer thread (no timeout) and non-blocking.
          o.timeout_s = first == bucket ? 0 : 60;
          GradientReducer r(c, o);
          for (auto n : kSizes) check(r.add(n).has_value(), "add");
          if (!r.seal()) return check(false, "seal " + name(o));
          for (int step = 0; step < 2; ++step) {
            fill(r, c.rank(), step);
            for (std::size_t g : mark_order(c.rank())) check(bool(r.mark_ready(g)), "mark_ready");
            check(bool(r.finish()), "finish " + name(o));
            const auto want = plain_all_reduce(c, step, r.total_count(), o.average);
            // Sums of small integers are exact in bf16 too, so compression
            // changes nothing here, bit for bit.
            check(std::memcmp(want.data(), r.flat(), want.size() * sizeof(float)) == 0,
                  "result differs from one plain all-reduce: " + name(o) + " step " + std::to_string(step));
          }
        }
}

// top-k against a reference that sees every rank's gradient: each rank's
// selection (largest |residual + g|, lower index on ties) summed in rank order.
void top_k(Collectives& c) {
  ReducerOptions o;
  o.bucket_bytes = 8192;
  o.first_bucket_bytes = 1024;
  o.compression = Compression::kTopK;
  o.top_k_ratio = 0.1;
  o.average = false;
  o.timeout_s = 60;
  GradientReducer r(c, o);
  for (auto n : kSizes) (void)r.add(n);
  if (!r.seal()) return check(false, "seal top-k");
  const int n = c.size();
  std::vector<std::vector<float>> residual(n, std::vector<float>(r.total_count(), 0.0f));
  for (int step = 0; step < 3; ++step) {
    fill(r, c.rank(), step);
    for (std::size_t g = 0; g < kSizes.size(); ++g) check(bool(r.mark_ready(g)), "mark_ready top-k");
    check(bool(r.finish()), "finish top-k");
    std::vector<float> want(r.total_count(), 0.0f);
    for (auto [first, last] : r.bucket_ranges()) {
      const std::size_t off = r.gradient(first) - r.flat();
      const std::size_t len = (last < kSizes.size() ? std::size_t(r.gradient(last) - r.flat()) : r.total_count()) - off;
      if (!len) continue;
      const std::size_t k = std::min(len, std::max<std::size_t>(1, std::size_t(std::ceil(o.top_k_ratio * len))));
      for (int p = 0; p < n; ++p) {
        auto& res = residual[p];
        for (std::size_t i = 0; i < len; ++i) res[off + i] += value(p, step, off + i);
        std::vector<std::size_t> idx(len);
        std::iota(idx.begin(), idx.end(), 0);
        std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
          const float x = std::fabs(res[off + a]), y = std::fabs(res[off + b]);
          return x != y ? x > y : a < b;
        });
        for (std::size_t j = 0; j < k; ++j) {
          want[off + idx[j]] += res[off + idx[j]];
          res[off + idx[j]] = 0.0f;
        }
      }
    }
    check(std::memcmp(want.data(), r.flat(), want.size() * sizeof(float)) == 0,
          "top-k result differs from the reference at step " + std::to_string(step));
  }
}

// Overlap: the first bucket's all-reduce completes while later gradients are
// still missing, driven by the progress thread or by progress() calls.
void overlap(Collectives& c) {
  for (ProgressMode mode : {ProgressMode::kThread, ProgressMode::kCaller}) {
    ReducerOptions o;
    o.bucket_bytes = 4096;
    o.first_bucket_bytes = 4096;
    o.progress = mode;
    o.timeout_s = 60;
    GradientReducer r(c, o);
    for (auto n : kSizes) (void)r.add(n);
    if (!r.seal()) return check(false, "seal overlap");
    fill(r, c.rank(), 0);
    check(r.bucket_ranges().size() > 2, "several buckets");
    const auto [first, last] = r.bucket_ranges()[0];
    for (std::size_t g = first; g < last; ++g) (void)r.mark_ready(g);
    bool done = false;
    for (int i = 0; i < 200000 && !done; ++i) {
      (void)r.progress();
      done = r.buckets_completed() >= 1;
      if (!done) usleep(100);
    }
    check(done, std::string("first bucket completed before the rest of backward (") +
                    (mode == ProgressMode::kThread ? "thread" : "caller") + ")");
    for (std::size_t g = last; g < kSizes.size(); ++g) (void)r.mark_ready(g);
    check(bool(r.finish()), "finish overlap");
    check(r.stats().buckets_done_before_finish >= 1, "stats count the bucket done before finish");
  }
}

void mismatched_layout(Collectives& c) {
  ReducerOptions o;
  o.timeout_s = 60;
  GradientReducer r(c, o);
  for (std::size_t g = 0; g < kSizes.size(); ++g) (void)r.add(g == 2 && c.rank() == 1 ? 99 : kSizes[g]);
  auto st = r.seal();
  check(!st, "a gradient of different size on rank 1 is refused");
  if (!st) check(st.error().message.find("gradient 2 ") != std::string::npos, "the error names gradient 2: " + st.error().message);
}

void zero_size(Collectives& c) {
  GradientReducer r(c, ReducerOptions{});
  (void)r.add(0);
  (void)r.add(0);
  check(bool(r.seal()), "seal zero-size");
  check(bool(r.finish()), "finish with only zero-size gradients");
}

void bench_correct(Collectives& c) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kI32, DType::kU8}) {
    BenchOptions o;
    o.min_bytes = 1;
    o.max_bytes = 40000;
    o.step_factor = 7;
    o.iters = 2;
    o.warmup = 0;
    o.dtype = t;
    auto r = run_bench(c, o);
    check(r.has_value(), "bench runs");
    if (!r) continue;
    check(r->ok(), std::string("every collective checked correct for ") + dtype_name(t));
    check(r->collectives.size() == 5, "five collectives");
    for (const auto& col : r->collectives) check(col.points.size() >= 3 && col.fitted, col.name + " fitted");
  }
}

// The last rank never joins in time: every other rank times out, and the
// error names the missing rank and the ranks stuck alongside.
void timeout(Collectives& c) {
  static float buf[4] = {1, 2, 3, 4};
  const int last = c.size() - 1;
  // The stuck ranks hear each other only while each listens after giving up
  // (a quarter of the timeout, at least 0.5 s: 1 s here), so they start
  // together: an all-reduce completes on no rank before every rank has joined
  // it. The last rank then stays away for more than twice the timeout, so a
  // rank slowed by a busy machine still gives up before the last one comes.
  float sync = 1;
  check(bool(c.all_reduce(&sync, &sync, 1, DType::kF32, ReduceOp::kSum).value().wait(60)), "the ranks meet before the timeout");
  constexpr double kTimeout = 4.0;
  if (c.rank() != last) {
    auto req = c.all_reduce(buf, buf, 4, DType::kF32, ReduceOp::kSum);
    auto st = req.value().wait(kTimeout);
    check(!st, "a collective another rank has not joined times out");
    if (!st) {
      const std::string& m = st.error().message;
      check(m.find("on rank " + std::to_string(c.rank())) != std::string::npos, "timeout names this rank: " + m);
      check(m.find("rank " + std::to_string(last) + " did not reach it") != std::string::npos, "timeout names the missing rank: " + m);
      if (c.size() > 2) check(m.find("stuck in it too") != std::string::npos, "timeout names the other stuck ranks: " + m);
    }
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(2.25 * kTimeout));
    (void)c.all_reduce(buf, buf, 4, DType::kF32, ReduceOp::kSum).value().wait(60);
  }
}

}  // namespace

int main() {
  auto comm = mpi_collectives().value();
  g_rank = comm->rank();
  bench_correct(*comm);
  exact_sum(*comm);
  top_k(*comm);
  overlap(*comm);
  mismatched_layout(*comm);
  zero_size(*comm);
  timeout(*comm);
  auto world = mpi_world().value();
  const bool all = world->all_ok(failures == 0);
  if (g_rank == 0) std::printf("%s: %d ranks\n", all ? "OK" : "FAILED", comm->size());
  return all ? 0 : 1;
}
