// The C API over Recorder: one process-wide recorder, errors as a thread-local message.
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>

#include "pacer/telemetry.hpp"
#include "pacer/telemetry_c.h"

namespace {

std::mutex g_mu;
std::unique_ptr<pacer::telemetry::Recorder> g_recorder;
thread_local std::string t_error;

std::optional<double> given(double v) { return std::isnan(v) ? std::nullopt : std::optional<double>(v); }

}  // namespace

extern "C" {

pacer_step pacer_step_init(int64_t step) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return pacer_step{step, 0, -1, nan, nan, nan, nan, nan, nan};
}

int pacer_telemetry_open(const char* db) {
  pacer::telemetry::RecorderOptions o;
  if (db) o.db = db;
  std::lock_guard lk(g_mu);
  g_recorder.reset();
  auto r = pacer::telemetry::Recorder::open(o);
  if (!r) {
    t_error = r.error().message;
    return -1;
  }
  g_recorder = std::move(*r);
  t_error.clear();
  return 0;
}

int pacer_telemetry_step(const pacer_step* s) {
  // The mutex only guards against a concurrent open/close; step() itself is thread-safe.
  std::lock_guard lk(g_mu);
  if (!g_recorder || !s) {
    t_error = g_recorder ? "null step" : "pacer_telemetry_open was not called";
    return -1;
  }
  pacer::telemetry::StepRecord r;
  r.step = s->step;
  r.t = s->t;
  r.rank = s->rank;
  r.step_time_s = given(s->step_time_s);
  r.loss = given(s->loss);
  r.tokens = given(s->tokens);
  r.data_wait_s = given(s->data_wait_s);
  r.comm_s = given(s->comm_s);
  r.flops = given(s->flops);
  return g_recorder->step(std::move(r)) ? 0 : -1;
}

int pacer_telemetry_flush(void) {
  std::lock_guard lk(g_mu);
  if (!g_recorder) return 0;
  if (auto s = g_recorder->flush(); !s) {
    t_error = s.error().message;
    return -1;
  }
  return 0;
}

void pacer_telemetry_close(void) {
  std::lock_guard lk(g_mu);
  g_recorder.reset();
}

uint64_t pacer_telemetry_dropped(void) {
  std::lock_guard lk(g_mu);
  return g_recorder ? g_recorder->dropped() : 0;
}

const char* pacer_telemetry_error(void) { return t_error.c_str(); }

}  // extern "C"
