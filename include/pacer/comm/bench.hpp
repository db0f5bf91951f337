// pacer comm bench and tune: collective timings, the α-β model fitted to them, and bucket-size advice.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/comm/collectives.hpp"
#include "pacer/core/error.hpp"

namespace pacer::comm {

inline constexpr const char* kBenchSchema = "pacer.comm.bench/1";
inline constexpr const char* kTuneSchema = "pacer.comm.tune/1";

// The collectives `pacer comm bench` measures, by their names in the CLI, JSON and docs.
const std::vector<std::string>& bench_collectives();  // all_reduce, reduce_scatter, all_gather, broadcast, all_to_all

// t(bytes) = alpha_s + beta_s_per_byte * bytes, fitted by least squares on
// relative residuals (every size counts alike, from bytes to hundreds of
// MiB), constrained to alpha, beta >= 0; r2 is the coefficient of
// determination of that weighted fit (1: a perfect line).
struct AlphaBeta {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
  double r2 = 0;
  std::size_t points = 0;
  double time_s(double bytes) const { return alpha_s + beta_s_per_byte * bytes; }
};
// Needs two or more distinct sizes.
Expected<AlphaBeta> fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds);

struct BenchOptions {
  std::vector<std::string> collectives = bench_collectives();
  std::size_t min_bytes = 8;
  std::size_t max_bytes = 64u << 20;
  double step_factor = 2;  // each size is the previous times this
  int warmup = 3;
  int iters = 20;
  DType dtype = DType::kF32;
  double timeout_s = 300;
};

// One message size. `bytes` counts as nccl-tests does: the whole buffer
// (per rank for all_reduce and broadcast; all ranks' blocks together for
// reduce_scatter, all_gather and all_to_all). Times are the slowest rank's.
struct BenchPoint {
  std::size_t bytes = 0;
  std::size_t count = 0;       // elements per rank in the call
  double median_s = 0, p99_s = 0, min_s = 0;
  double algbw_gbps = 0;       // bytes / median_s / 1e9
  double busbw_gbps = 0;       // algbw * busbw_factor
  bool correct = true;         // checked on every rank against the exact expected values
};

struct BenchCollective {
  std::string name;
  double busbw_factor = 0;
  std::vector<BenchPoint> points;
  AlphaBeta fit;
  bool fitted = false;
};

// The α-β fit of a collective's median times over sizes >= min_bytes.
Expected<AlphaBeta> fit_points(const BenchCollective& c, std::size_t min_bytes = 0);

// Buckets are never smaller than this in tune's sweep, and tune fits the
// all-reduce over these sizes only: small messages run in another regime
// (latency, caches) that would bend the line where buckets live.
inline constexpr std::size_t kTuneMinBucketBytes = 64 * 1024;

struct BenchReport {
  std::string backend;
  int ranks = 1;
  std::string host;       // rank 0's
  std::string date_utc;   // ISO 8601
  DType dtype = DType::kF32;
  int iters = 0, warmup = 0;
  std::vector<BenchCollective> collectives;
  bool ok() const;        // every point correct
};

// Runs on every rank (collective); every rank returns the same report.
// `on_point` (may be empty) is called after each size, for progress lines.
Expected<BenchReport> run_bench(Collectives& comm, const BenchOptions& options,
                                const std::function<void(const BenchCollective&, const BenchPoint&)>& on_point = {});

nlohmann::json to_json(const BenchReport& r);
// Reads a report written by to_json; `source` names the file in errors.
Expected<BenchReport> bench_from_json(const nlohmann::json& j, const std::string& source);

// --- tune ---------------------------------------------------------------

// The model (docs/comm.md): backward produces gradient bytes at a constant
// rate over backward_s; a bucket is all-reduced once its last byte exists and
// the previous bucket's all-reduce ended; each takes alpha + beta * bytes.
// Exposed time = end of the last all-reduce - end of backward.
struct TuneInput {
  AlphaBeta all_reduce;
  double elements = 0;     // gradient elements (parameters)
  DType dtype = DType::kF32;
  double backward_s = 0;
  int ranks = 1;           // data-parallel size (Megatron's default bucket depends on it)
};

struct Schedule {
  double first_bucket_bytes = 0, bucket_bytes = 0;
  std::size_t buckets = 0;
  double comm_s = 0;       // sum of the all-reduce times
  double exposed_s = 0;
  double hidden_fraction = 0;  // 1 - exposed_s / comm_s
};
Schedule simulate(const TuneInput& in, double first_bucket_bytes, double bucket_bytes);

struct FrameworkSetting {
  std::string framework;   // "pytorch_ddp", "megatron", "deepspeed"
  std::string option;      // "bucket_cap_mb", "--ddp-bucket-size", "reduce_bucket_size"
  std::string unit;        // "MiB", "elements"
  double recommended = 0;
  double default_value = 0;
  Schedule at_recommended, at_default;
  std::string note;
};

struct TuneReport {
  TuneInput input;
  double gradient_bytes = 0;
  double single_all_reduce_s = 0;  // everything in one message, after backward: nothing hidden
  Schedule best;                   // over bucket sizes, first bucket = bucket
  std::vector<Schedule> sweep;
  std::vector<FrameworkSetting> settings;
};
Expected<TuneReport> tune(const TuneInput& in);
nlohmann::json to_json(const TuneReport& r);

}  // namespace pacer::comm
