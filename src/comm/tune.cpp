#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "pacer/comm/bench.hpp"

namespace pacer::comm {

Schedule simulate(const TuneInput& in, double first_bucket_bytes, double bucket_bytes) {
  Schedule s;
  s.first_bucket_bytes = first_bucket_bytes;
  s.bucket_bytes = bucket_bytes;
  const double total = in.elements * double(dtype_bytes(in.dtype));
  double pos = 0, end = 0;
  while (pos < total) {
    const double size = std::min(total - pos, s.buckets == 0 ? std::min(first_bucket_bytes, bucket_bytes) : bucket_bytes);
    pos += size;
    const double ready = in.backward_s * pos / total;
    const double t = in.all_reduce.time_s(size);
    end = std::max(ready, end) + t;
    s.comm_s += t;
    ++s.buckets;
  }
  s.exposed_s = std::max(0.0, end - in.backward_s);
  s.hidden_fraction = s.comm_s > 0 ? 1.0 - s.exposed_s / s.comm_s : 1.0;
  return s;
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kDdpFirstBucketBytes = 1 * kMiB;  // torch.distributed's first bucket
constexpr double kDdpDefaultCapMb = 25;
constexpr double kDeepSpeedDefaultElements = 5e8;
constexpr double kTieFraction = 0.01;

// The largest bucket whose exposed time is within 1% of the communication
// time of the minimum: the model has no per-bucket cost beyond alpha (hooks,
// kernel launches, allocator), so among near-equal schedules fewer buckets win.
Schedule best_of(const std::vector<Schedule>& v) {
  Schedule min = v.front();
  for (const auto& s : v)
    if (s.exposed_s < min.exposed_s) min = s;
  Schedule best = min;
  for (const auto& s : v)
    if (s.exposed_s <= min.exposed_s + kTieFraction * min.comm_s && s.bucket_bytes > best.bucket_bytes) best = s;
  return best;
}

}  // namespace

Expected<TuneReport> tune(const TuneInput& in) {
  if (!(in.elements > 0)) return Error{ErrorKind::kUsage, "gradient size must be positive"};
  if (!(in.backward_s >= 0)) return Error{ErrorKind::kUsage, "backward time must not be negative"};
  if (!(in.all_reduce.beta_s_per_byte >= 0) || !(in.all_reduce.alpha_s >= 0))
    return Error{ErrorKind::kUsage, "the all_reduce fit has a negative alpha or beta; re-run pacer comm bench with more sizes"};
  TuneReport r;
  r.input = in;
  const double e = double(dtype_bytes(in.dtype));
  r.gradient_bytes = in.elements * e;
  r.single_all_reduce_s = in.all_reduce.time_s(r.gradient_bytes);

  // Candidate bucket sizes: 64 KiB upwards in quarter-octave steps, and the
  // whole gradient as one bucket.
  std::vector<double> sizes;
  for (double b = kTuneMinBucketBytes; b < r.gradient_bytes; b *= std::pow(2.0, 0.25)) sizes.push_back(std::round(b));
  sizes.push_back(r.gradient_bytes);
  std::vector<Schedule> ddp;
  for (double b : sizes) {
    r.sweep.push_back(simulate(in, b, b));
    ddp.push_back(simulate(in, kDdpFirstBucketBytes, b));
  }
  r.best = best_of(r.sweep);

  FrameworkSetting d{"pytorch_ddp", "bucket_cap_mb", "MiB", 0, kDdpDefaultCapMb, {}, {}, ""};
  const Schedule ddp_best = best_of(ddp);
  d.recommended = std::stod(fmt::format("{:.4g}", ddp_best.bucket_bytes / kMiB));
  d.at_recommended = simulate(in, kDdpFirstBucketBytes, d.recommended * kMiB);
  d.at_default = simulate(in, kDdpFirstBucketBytes, kDdpDefaultCapMb * kMiB);
  d.note = "bytes of the gradient dtype; DDP's first bucket stays at 1 MiB";
  r.settings.push_back(d);

  const double megatron_default = std::max(40e6, 1e6 * in.ranks);
  FrameworkSetting m{"megatron", "--ddp-bucket-size", "elements", std::round(r.best.bucket_bytes / e), megatron_default, {}, {}, ""};
  m.at_recommended = simulate(in, m.recommended * e, m.recommended * e);
  m.at_default = simulate(in, megatron_default * e, megatron_default * e);
  m.note = "parameters per bucket; needs --overlap-grad-reduce (without it nothing is hidden)";
  r.settings.push_back(m);

  FrameworkSetting ds{"deepspeed", "reduce_bucket_size", "elements", std::round(r.best.bucket_bytes / e),
                      kDeepSpeedDefaultElements, {}, {}, ""};
  ds.at_recommended = simulate(in, ds.recommended * e, ds.recommended * e);
  ds.at_default = simulate(in, kDeepSpeedDefaultElements * e, kDeepSpeedDefaultElements * e);
  ds.note = "elements, not bytes; needs \"overlap_comm\": true; ZeRO reduces with reduce-scatter, modelled here as all-reduce";
  r.settings.push_back(ds);
  // Within the tie tolerance a default can beat the pick: keep the default then.
  for (auto& f : r.settings)
    if (f.at_default.exposed_s <= f.at_recommended.exposed_s) {
      f.recommended = f.default_value;
      f.at_recommended = f.at_default;
    }
  return r;
}

nlohmann::json to_json(const TuneReport& r) {
  using nlohmann::json;
  auto sched = [](const Schedule& s) {
    return json{{"first_bucket_bytes", s.first_bucket_bytes}, {"bucket_bytes", s.bucket_bytes}, {"buckets", s.buckets},
                {"comm_s", s.comm_s}, {"exposed_s", s.exposed_s}, {"hidden_fraction", s.hidden_fraction}};
  };
  json settings = json::array();
  for (const auto& f : r.settings)
    settings.push_back({{"framework", f.framework}, {"option", f.option}, {"unit", f.unit},
                        {"recommended", f.recommended}, {"default", f.default_value},
                        {"at_recommended", sched(f.at_recommended)}, {"at_default", sched(f.at_default)},
                        {"note", f.note}});
  json sweep = json::array();
  for (const auto& s : r.sweep) sweep.push_back(sched(s));
  return {{"schema", kTuneSchema},
          {"input", {{"elements", r.input.elements}, {"dtype", dtype_name(r.input.dtype)}, {"backward_s", r.input.backward_s},
                     {"ranks", r.input.ranks},
                     {"all_reduce", {{"alpha_s", r.input.all_reduce.alpha_s}, {"beta_s_per_byte", r.input.all_reduce.beta_s_per_byte},
                                     {"r2", r.input.all_reduce.r2}}}}},
          {"gradient_bytes", r.gradient_bytes},
          {"single_all_reduce_s", r.single_all_reduce_s},
          {"best", sched(r.best)},
          {"settings", settings},
          {"sweep", sweep}};
}

}  // namespace pacer::comm
