// Synthetic backward with the GradientReducer: how much all-reduce hides behind compute, on CPU ranks under mpirun.
// Also times pacer's all_reduce against MPI_Allreduce called directly, in the same run.
// Build (after cmake --build build --target pacer_comm):
//   mpicxx -O2 -std=c++20 -Iinclude -Ibuild/generated bench/comm_overlap.cpp build/lib/libpacer_comm.a \
//     build/lib/libpacer_hw.a build/lib/libpacer_core.a -lfmt -ldl -lpthread -o build/comm_overlap
// Run: mpirun -np 2 build/comm_overlap LAYERS LAYER_MIB COMPUTE_MS KIND(spin|sleep) ROUNDS BUCKET_MIB
// Prints one JSON object (rank 0).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "pacer/comm.hpp"

using namespace pacer::comm;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// A fixed amount of arithmetic (spin) or an idle wait (sleep: the host
// thread of a GPU job while kernels run). Spin work is counted in
// iterations, calibrated once, so CPU stolen by communication shows up as
// longer compute, as it would in a CPU job.
volatile float g_sink;
void spin(long iters) {
  float a = 1.0f, b = 0.999999f, c = 1e-7f;
  for (long i = 0; i < iters; ++i) a = a * b + c;
  g_sink = a;
}

struct Setup {
  int layers;
  std::size_t layer_floats;
  double compute_s;
  bool sleep;
  long spin_iters = 0;
};

// Backward of one layer, in `chunks` pieces with `between` called after each.
template <class F>
void layer_compute(const Setup& s, float* grad, int chunks, F&& between) {
  for (int c = 0; c < chunks; ++c) {
    if (s.sleep) std::this_thread::sleep_for(std::chrono::duration<double>(s.compute_s / chunks));
    else spin(s.spin_iters / chunks);
    between();
  }
  for (std::size_t i = 0; i < s.layer_floats; ++i) grad[i] = float(i % 13);
}

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s LAYERS LAYER_MIB COMPUTE_MS spin|sleep ROUNDS BUCKET_MIB\n", argv[0]);
    return 2;
  }
  Setup s{std::atoi(argv[1]), std::size_t(std::atof(argv[2]) * (1 << 20) / 4), std::atof(argv[3]) / 1e3,
          std::string(argv[4]) == "sleep"};
  const int rounds = std::atoi(argv[5]);
  const double bucket_mib = std::atof(argv[6]);
  auto comm = pacer::unwrap(mpi_collectives());
  const int rank = comm->rank(), n = comm->size();

  // Calibrate spin iterations for compute_s per layer on rank 0; all ranks use them.
  if (!s.sleep) {
    long iters = 1 << 20;
    if (rank == 0) {
      for (;;) {
        auto t = Clock::now();
        spin(iters);
        const double dt = since(t);
        if (dt > 0.02) {
          iters = long(iters * s.compute_s / dt);
          break;
        }
        iters *= 2;
      }
    }
    MPI_Bcast(&iters, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    s.spin_iters = iters;
  }

  ReducerOptions base;
  base.bucket_bytes = std::size_t(bucket_mib * (1 << 20));
  base.first_bucket_bytes = std::min<std::size_t>(base.bucket_bytes, 1 << 20);
  base.average = true;
  auto make = [&](ProgressMode mode) {
    ReducerOptions o = base;
    o.progress = mode;
    auto r = std::make_unique<GradientReducer>(*comm, o);
    for (int l = 0; l < s.layers; ++l) (void)r->add(s.layer_floats);
    pacer::unwrap(r->seal());
    return r;
  };
  auto thread_r = make(ProgressMode::kThread);
  auto caller_r = make(ProgressMode::kCaller);
  std::vector<float> flat(s.layer_floats * s.layers);

  std::vector<double> t_compute, t_comm, t_seq, t_thread, t_caller, ex_thread, ex_caller;
  auto step_compute = [&] {
    for (int l = 0; l < s.layers; ++l) layer_compute(s, flat.data() + l * s.layer_floats, 1, [] {});
  };
  for (int round = 0; round < rounds; ++round) {
    barrier();
    auto t = Clock::now();
    step_compute();
    t_compute.push_back(since(t));

    barrier();
    t = Clock::now();
    (void)comm->all_reduce(flat.data(), flat.data(), flat.size(), DType::kF32, ReduceOp::kSum).value().wait();
    t_comm.push_back(since(t));

    barrier();
    t = Clock::now();
    step_compute();
    (void)comm->all_reduce(flat.data(), flat.data(), flat.size(), DType::kF32, ReduceOp::kSum).value().wait();
    t_seq.push_back(since(t));

    for (auto* r : {thread_r.get(), caller_r.get()}) {
      const bool caller = r == caller_r.get();
      barrier();
      t = Clock::now();
      for (int l = 0; l < s.layers; ++l) {
        // The caller-driven reducer gets a progress() call between compute
        // chunks, as a training loop could make between kernels.
        layer_compute(s, r->gradient(l), caller ? 8 : 1, [&] {
          if (caller) (void)r->progress();
        });
        pacer::unwrap(r->mark_ready(l));
      }
      pacer::unwrap(r->finish());
      (caller ? t_caller : t_thread).push_back(since(t));
      (caller ? ex_caller : ex_thread).push_back(r->stats().finish_wait_s);
    }
  }

  // pacer's all_reduce + wait against MPI_Allreduce, same sizes, alternating.
  std::vector<std::pair<std::size_t, double>> ratio;
  for (std::size_t bytes : {std::size_t(64) << 10, std::size_t(1) << 20, std::size_t(16) << 20}) {
    std::vector<float> buf(bytes / 4, 1.0f);
    std::vector<double> tp, tm;
    for (int i = 0; i < 30; ++i) {
      barrier();
      auto t = Clock::now();
      (void)comm->all_reduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum).value().wait();
      tp.push_back(since(t));
      barrier();
      t = Clock::now();
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), int(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      tm.push_back(since(t));
    }
    ratio.emplace_back(bytes, median(tm) / median(tp));  // busbw ratio pacer / MPI
  }

  if (rank == 0) {
    const double c = median(t_compute), m = median(t_comm);
    auto hidden = [&](double total) { return 1.0 - (total - c) / m; };
    std::printf("{\"ranks\": %d, \"layers\": %d, \"gradient_mib\": %.1f, \"bucket_mib\": %.2f, \"compute\": \"%s\", "
                "\"rounds\": %d, \"compute_ms_per_layer\": %g, \"compute_s\": %.5f, \"comm_s\": %.5f, \"sequential_s\": %.5f, "
                "\"overlap_thread_s\": %.5f, \"overlap_caller_s\": %.5f, \"finish_wait_thread_s\": %.5f, "
                "\"finish_wait_caller_s\": %.5f, \"hidden_no_overlap\": %.3f, \"hidden_thread\": %.3f, "
                "\"hidden_caller\": %.3f, \"busbw_ratio_vs_mpi\": {",
                n, s.layers, flat.size() * 4.0 / (1 << 20), bucket_mib, s.sleep ? "sleep" : "spin", rounds, s.compute_s * 1e3, c, m,
                median(t_seq), median(t_thread), median(t_caller), median(ex_thread), median(ex_caller),
                hidden(median(t_seq)), hidden(median(t_thread)), hidden(median(t_caller)));
    for (std::size_t i = 0; i < ratio.size(); ++i)
      std::printf("%s\"%zu\": %.3f", i ? ", " : "", ratio[i].first, ratio[i].second);
    std::printf("}}\n");
  }
  return 0;
}
