#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>

#include "pacer/comm/bench.hpp"
#include "pacer/core/stats.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/core/time.hpp"

namespace pacer::comm {

const std::vector<std::string>& bench_collectives() {
  static const std::vector<std::string> names = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"};
  return names;
}

Expected<AlphaBeta> fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.size() < 2)
    return Error{ErrorKind::kUsage, "an alpha-beta fit needs two or more (size, time) points"};
  // Weighted least squares with w = 1/y^2: minimises relative residuals.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!(y[i] > 0)) return Error{ErrorKind::kUsage, "an alpha-beta fit needs positive times"};
    const double w = 1.0 / (y[i] * y[i]);
    sw += w, sx += w * x[i], sy += w * y[i], sxx += w * x[i] * x[i], sxy += w * x[i] * y[i];
  }
  const double det = sw * sxx - sx * sx;
  if (!(std::fabs(det) > 0)) return Error{ErrorKind::kUsage, "an alpha-beta fit needs two or more distinct sizes"};
  AlphaBeta f;
  f.beta_s_per_byte = (sw * sxy - sx * sy) / det;
  f.alpha_s = (sy - f.beta_s_per_byte * sx) / sw;
  // Times that grow faster than linearly (caches, then memory) put the
  // unconstrained intercept below zero; a negative latency means nothing, so
  // the fit is constrained to alpha, beta >= 0 (the boundary solutions).
  if (f.alpha_s < 0) {
    f.alpha_s = 0;
    f.beta_s_per_byte = sxy / sxx;
  } else if (f.beta_s_per_byte < 0) {
    f.beta_s_per_byte = 0;
    f.alpha_s = sy / sw;
  }
  const double mean = sy / sw;
  double ss_res = 0, ss_tot = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double w = 1.0 / (y[i] * y[i]);
    ss_res += w * std::pow(y[i] - f.time_s(x[i]), 2);
    ss_tot += w * std::pow(y[i] - mean, 2);
  }
  f.r2 = ss_tot > 0 ? 1.0 - ss_res / ss_tot : 1.0;
  f.points = x.size();
  return f;
}

Expected<AlphaBeta> fit_points(const BenchCollective& c, std::size_t min_bytes) {
  std::vector<double> xs, ys;
  for (const auto& p : c.points)
    if (p.bytes >= min_bytes) xs.push_back(double(p.bytes)), ys.push_back(p.median_s);
  return fit_alpha_beta(xs, ys);
}

bool BenchReport::ok() const {
  for (const auto& c : collectives)
    for (const auto& p : c.points)
      if (!p.correct) return false;
  return true;
}

namespace {

// Small integers: every sum over ranks is exact in every dtype we test.
int pattern(int rank, std::size_t i) { return static_cast<int>((rank * 7 + i * 3) % 13) + 1; }

void put(void* buf, DType t, std::size_t i, double v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(buf)[i] = float(v); break;
    case DType::kF64: static_cast<double*>(buf)[i] = v; break;
    case DType::kBF16: static_cast<std::uint16_t*>(buf)[i] = to_bf16(float(v)); break;
    case DType::kI32: static_cast<std::int32_t*>(buf)[i] = std::int32_t(v); break;
    case DType::kU8: static_cast<std::uint8_t*>(buf)[i] = std::uint8_t(std::int64_t(v) & 0xff); break;
  }
}

double get(const void* buf, DType t, std::size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(buf)[i];
    case DType::kF64: return static_cast<const double*>(buf)[i];
    case DType::kBF16: return from_bf16(static_cast<const std::uint16_t*>(buf)[i]);
    case DType::kI32: return static_cast<const std::int32_t*>(buf)[i];
    case DType::kU8: return static_cast<const std::uint8_t*>(buf)[i];
  }
  return 0;
}

bool equal(double got, double want, DType t) {
  if (t == DType::kU8) return std::int64_t(got) == (std::int64_t(want) & 0xff);
  return got == want;
}

// Device or host buffers for one collective, freed on scope exit.
struct Buffers {
  Collectives& comm;
  void* send = nullptr;
  void* recv = nullptr;
  void* sync = nullptr;
  ~Buffers() {
    for (void* p : {send, recv, sync})
      if (p) comm.release(p);
  }
};

struct Shape {
  std::size_t count;       // elements per rank passed to the call
  std::size_t send_elems;  // elements in the send buffer
  std::size_t recv_elems;
  std::size_t bytes;       // nccl-tests' size
};

Shape shape(const std::string& c, std::size_t bytes, DType t, int n) {
  const std::size_t e = dtype_bytes(t);
  if (c == "all_reduce" || c == "broadcast") {
    const std::size_t count = std::max<std::size_t>(1, bytes / e);
    return {count, count, count, count * e};
  }
  const std::size_t block = std::max<std::size_t>(1, bytes / (e * n));
  if (c == "reduce_scatter") return {block, block * n, block, block * n * e};
  if (c == "all_gather") return {block, block, block * n, block * n * e};
  return {block, block * n, block * n, block * n * e};  // all_to_all
}

Expected<Request> issue(Collectives& comm, const std::string& c, const Shape& s, void* send, void* recv, DType t) {
  if (c == "all_reduce") return comm.all_reduce(send, recv, s.count, t, ReduceOp::kSum);
  if (c == "reduce_scatter") return comm.reduce_scatter(send, recv, s.count, t, ReduceOp::kSum);
  if (c == "all_gather") return comm.all_gather(send, recv, s.count, t);
  if (c == "broadcast") return comm.broadcast(recv, s.count, t, 0);
  return comm.all_to_all(send, recv, s.count, t);
}

// The value element i of rank `r`'s result must hold.
double expected(const std::string& c, const Shape& s, int r, int n, std::size_t i) {
  if (c == "all_reduce") {
    double v = 0;
    for (int p = 0; p < n; ++p) v += pattern(p, i);
    return v;
  }
  if (c == "reduce_scatter") {
    double v = 0;
    for (int p = 0; p < n; ++p) v += pattern(p, r * s.count + i);
    return v;
  }
  if (c == "all_gather") return pattern(static_cast<int>(i / s.count), i % s.count);
  if (c == "broadcast") return pattern(0, i);
  return pattern(static_cast<int>(i / s.count), r * s.count + i % s.count);  // all_to_all
}

// One untimed call on patterned data, checked element by element.
Expected<bool> check(Collectives& comm, const std::string& c, const Shape& s, Buffers& b, DType t, double timeout_s) {
  const int r = comm.rank(), n = comm.size();
  const std::size_t e = dtype_bytes(t);
  std::vector<unsigned char> host(std::max(s.send_elems, s.recv_elems) * e);
  // broadcast works in place on recv: the root's pattern must win over the others'.
  const std::size_t fill = c == "broadcast" ? s.recv_elems : s.send_elems;
  for (std::size_t i = 0; i < fill; ++i) put(host.data(), t, i, pattern(r, i));
  if (auto st = comm.copy_from_host(c == "broadcast" ? b.recv : b.send, host.data(), fill * e); !st) return st.error();
  auto req = issue(comm, c, s, b.send, b.recv, t);
  if (!req) return req.error();
  if (auto st = req->wait(timeout_s); !st) return st.error();
  if (auto st = comm.copy_to_host(host.data(), b.recv, s.recv_elems * e); !st) return st.error();
  bool ok = true;
  for (std::size_t i = 0; i < s.recv_elems && ok; ++i) ok = equal(get(host.data(), t, i), expected(c, s, r, n, i), t);
  return ok;
}

}  // namespace

Expected<BenchReport> run_bench(Collectives& comm, const BenchOptions& o,
                                const std::function<void(const BenchCollective&, const BenchPoint&)>& on_point) {
  if (o.min_bytes == 0 || o.max_bytes < o.min_bytes)
    return Error{ErrorKind::kUsage, "message sizes: need 0 < min_bytes <= max_bytes"};
  if (!(o.step_factor > 1)) return Error{ErrorKind::kUsage, "step factor must be greater than 1"};
  if (o.iters < 1 || o.warmup < 0) return Error{ErrorKind::kUsage, "iters must be at least 1 and warmup at least 0"};
  const int n = comm.size();
  BenchReport rep;
  rep.backend = comm.backend();
  rep.ranks = n;
  rep.host = hw::hostname();
  rep.date_utc = utc_iso_now();
  rep.dtype = o.dtype;
  rep.iters = o.iters;
  rep.warmup = o.warmup;

  std::vector<std::size_t> sizes;
  for (double s = double(o.min_bytes); s <= double(o.max_bytes) * (1 + 1e-9); s = std::ceil(s * o.step_factor))
    sizes.push_back(static_cast<std::size_t>(s));

  Buffers buf{comm};
  const std::size_t cap = (o.max_bytes + dtype_bytes(o.dtype) * n) + 64;
  for (void** p : {&buf.send, &buf.recv}) {
    auto m = comm.allocate(cap);
    if (!m) return m.error();
    *p = *m;
  }
  auto m = comm.allocate(sizeof(std::int32_t));
  if (!m) return m.error();
  buf.sync = *m;
  const std::int32_t zero = 0;
  if (auto st = comm.copy_from_host(buf.sync, &zero, sizeof zero); !st) return st.error();
  // A one-element all-reduce lines the ranks up before each timed call, so a
  // call's time is the collective's, not the skew between ranks.
  auto line_up = [&]() -> Status {
    auto r = comm.all_reduce(buf.sync, buf.sync, 1, DType::kI32, ReduceOp::kSum);
    return r ? r->wait(o.timeout_s) : Status(r.error());
  };

  for (const auto& name : o.collectives) {
    auto factor = busbw_factor(name, n);
    if (!factor) return factor.error();
    BenchCollective col{name, *factor, {}, {}, false};
    std::size_t last_bytes = 0;
    for (std::size_t size : sizes) {
      const Shape s = shape(name, size, o.dtype, n);
      if (s.bytes == last_bytes) continue;  // rounding to whole elements made it a repeat
      last_bytes = s.bytes;
      BenchPoint pt;
      pt.bytes = s.bytes;
      pt.count = s.count;
      auto ok = check(comm, name, s, buf, o.dtype, o.timeout_s);
      if (!ok) return ok.error();
      std::vector<double> times;
      for (int it = 0; it < o.warmup + o.iters; ++it) {
        if (auto st = line_up(); !st) return st.error();
        const auto t0 = std::chrono::steady_clock::now();
        auto req = issue(comm, name, s, buf.send, buf.recv, o.dtype);
        if (!req) return req.error();
        // No timeout here: a wait without one runs MPI's blocking (tuned)
        // collective, the one training code gets; a dead rank is caught by
        // line_up's deadline before the next call.
        if (auto st = req->wait(); !st) return st.error();
        if (it >= o.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      // The slowest rank's time per iteration; the correctness flag of every rank.
      times.push_back(*ok ? 1.0 : 0.0);
      std::vector<double> worst(times.begin(), times.end() - 1), flags = {times.back()};
      if (auto st = all_reduce_host(comm, worst, ReduceOp::kMax, o.timeout_s); !st) return st.error();
      if (auto st = all_reduce_host(comm, flags, ReduceOp::kMin, o.timeout_s); !st) return st.error();
      std::sort(worst.begin(), worst.end());
      const std::size_t k = worst.size();
      pt.median_s = median(worst);
      pt.p99_s = worst[static_cast<std::size_t>(std::ceil(0.99 * k)) - 1];
      pt.min_s = worst.front();
      pt.algbw_gbps = pt.median_s > 0 ? double(pt.bytes) / pt.median_s / 1e9 : 0;
      pt.busbw_gbps = pt.algbw_gbps * col.busbw_factor;
      pt.correct = flags[0] == 1.0;
      col.points.push_back(pt);
      if (on_point) on_point(col, pt);
    }
    if (auto f = fit_points(col)) {
      col.fit = *f;
      col.fitted = true;
    }
    rep.collectives.push_back(std::move(col));
  }
  return rep;
}

nlohmann::json to_json(const BenchReport& r) {
  using nlohmann::json;
  json cols = json::array();
  for (const auto& c : r.collectives) {
    json pts = json::array();
    for (const auto& p : c.points)
      pts.push_back({{"bytes", p.bytes}, {"count", p.count}, {"median_s", p.median_s}, {"p99_s", p.p99_s},
                     {"min_s", p.min_s}, {"algbw_gbps", p.algbw_gbps}, {"busbw_gbps", p.busbw_gbps},
                     {"correct", p.correct}});
    json fit = nullptr;
    if (c.fitted)
      fit = {{"alpha_s", c.fit.alpha_s}, {"beta_s_per_byte", c.fit.beta_s_per_byte},
             {"bandwidth_gbps", c.fit.beta_s_per_byte > 0 ? 1e-9 / c.fit.beta_s_per_byte : 0.0}, {"r2", c.fit.r2},
             {"points", c.fit.points}};
    cols.push_back({{"name", c.name}, {"busbw_factor", c.busbw_factor}, {"fit", fit}, {"points", pts}});
  }
  return {{"schema", kBenchSchema}, {"backend", r.backend}, {"ranks", r.ranks}, {"host", r.host},
          {"date_utc", r.date_utc}, {"dtype", dtype_name(r.dtype)}, {"iters", r.iters}, {"warmup", r.warmup},
          {"ok", r.ok()}, {"collectives", cols}};
}

Expected<BenchReport> bench_from_json(const nlohmann::json& j, const std::string& source) {
  auto bad = [&](const std::string& what) { return Error{ErrorKind::kConfig, source + ": " + what}; };
  if (!j.is_object() || j.value("schema", "") != kBenchSchema)
    return bad(std::string("not a pacer comm bench report (expected \"schema\": \"") + kBenchSchema + "\")");
  try {
    BenchReport r;
    r.backend = j.at("backend").get<std::string>();
    r.ranks = j.at("ranks").get<int>();
    r.host = j.value("host", "");
    r.date_utc = j.value("date_utc", "");
    auto t = parse_dtype(j.at("dtype").get<std::string>());
    if (!t) return bad("dtype: " + t.error().message);
    r.dtype = *t;
    r.iters = j.value("iters", 0);
    r.warmup = j.value("warmup", 0);
    for (const auto& c : j.at("collectives")) {
      BenchCollective col;
      col.name = c.at("name").get<std::string>();
      col.busbw_factor = c.at("busbw_factor").get<double>();
      for (const auto& p : c.at("points")) {
        BenchPoint pt;
        pt.bytes = p.at("bytes").get<std::size_t>();
        pt.count = p.at("count").get<std::size_t>();
        pt.median_s = p.at("median_s").get<double>();
        pt.p99_s = p.at("p99_s").get<double>();
        pt.min_s = p.at("min_s").get<double>();
        pt.algbw_gbps = p.at("algbw_gbps").get<double>();
        pt.busbw_gbps = p.at("busbw_gbps").get<double>();
        pt.correct = p.at("correct").get<bool>();
        col.points.push_back(pt);
      }
      if (c.contains("fit") && c["fit"].is_object()) {
        col.fit.alpha_s = c["fit"].at("alpha_s").get<double>();
        col.fit.beta_s_per_byte = c["fit"].at("beta_s_per_byte").get<double>();
        col.fit.r2 = c["fit"].at("r2").get<double>();
        col.fit.points = c["fit"].at("points").get<std::size_t>();
        col.fitted = true;
      }
      r.collectives.push_back(std::move(col));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return bad(std::string("malformed report: ") + e.what());
  }
}

}  // namespace pacer::comm
