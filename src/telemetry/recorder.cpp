#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "pacer/hw/system.hpp"
#include "pacer/telemetry.hpp"
#include "pacer/telemetry/catalog.hpp"

namespace pacer::telemetry {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<long long> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  long long x = 0;
  const char* end = v + std::char_traits<char>::length(v);
  auto [ptr, ec] = std::from_chars(v, end, x);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return x;
}

}  // namespace

int rank_from_env() {
  for (const char* name : {"SLURM_PROCID", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (auto v = env_int(name); v && *v >= 0) return static_cast<int>(*v);
  return 0;
}

std::string catalog_from_env() {
  const char* db = std::getenv("PACER_TELEMETRY_DB");
  return db && *db ? db : default_catalog_name();
}

struct Recorder::Catalogs {
  std::unique_ptr<Catalog> catalog;
  std::int64_t node_id = 0;
};

Expected<std::unique_ptr<Recorder>> Recorder::open(RecorderOptions o) {
  std::unique_ptr<Recorder> r(new Recorder());
  r->db_ = o.db.empty() ? catalog_from_env() : o.db;
  r->rank_ = o.rank >= 0 ? o.rank : rank_from_env();
  r->node_ = o.node.empty() ? hw::hostname() : o.node;
  r->capacity_ = std::max<std::size_t>(o.queue_capacity, 1);
  r->flush_interval_s_ = o.flush_interval_s > 0 ? o.flush_interval_s : 0.5;
  auto cat = Catalog::open(r->db_);
  if (!cat) return cat.error();
  r->cat_ = std::make_unique<Catalogs>();
  r->cat_->catalog = std::move(*cat);
  NodeInfo n;
  n.hostname = r->node_;
  auto nid = r->cat_->catalog->node_id(n);
  if (!nid) return nid.error();
  r->cat_->node_id = *nid;
  r->run_id_ = o.run_id;
  if (r->run_id_ <= 0)
    if (auto v = env_int("PACER_RUN_ID"); v && *v > 0) r->run_id_ = *v;
  if (r->run_id_ <= 0) {
    RunInfo run;
    if (const char* job = std::getenv("SLURM_JOB_ID")) run.job_id = job;
    run.command = "training metrics (no pacer monitor)";
    run.hostname = r->node_;
    run.started = now_s();
    auto id = r->cat_->catalog->begin_run(run);
    if (!id) return id.error();
    r->run_id_ = *id;
  }
  r->steps_.reserve(1024);
  r->writer_ = std::thread([p = r.get()] { p->writer_loop(); });
  return r;
}

Recorder::~Recorder() { close(); }

void Recorder::close() {
  {
    std::lock_guard lk(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

bool Recorder::step(StepRecord record) {
  // Not `t <= 0`: a NaN time (from a caller's arithmetic) must become now too.
  if (!(record.t > 0) || !std::isfinite(record.t)) record.t = now_s();
  if (record.rank < 0) record.rank = rank_;
  if (record.node.empty()) record.node = node_;
  std::lock_guard lk(mu_);
  if (stop_ || steps_.size() + events_.size() >= capacity_) {
    dropped_.fetch_add(1);
    return false;
  }
  steps_.push_back(std::move(record));
  ++enqueued_;
  return true;
}

bool Recorder::event(std::string kind, std::string detail) {
  EventRecord e{now_s(), std::move(kind), std::move(detail), -1, rank_};
  std::lock_guard lk(mu_);
  if (stop_ || steps_.size() + events_.size() >= capacity_) {
    dropped_.fetch_add(1);
    return false;
  }
  events_.push_back(std::move(e));
  ++enqueued_;
  return true;
}

Status Recorder::flush() {
  std::unique_lock lk(mu_);
  const std::uint64_t target = enqueued_;
  flush_requested_ = true;
  cv_.notify_all();
  done_cv_.wait(lk, [&] { return completed_ >= target || (stop_ && !writer_.joinable()); });
  if (has_error_) {
    has_error_ = false;
    return last_error_;
  }
  return {};
}

void Recorder::writer_loop() {
  std::vector<StepRecord> steps;
  std::vector<EventRecord> events;
  const auto period = std::chrono::duration<double>(flush_interval_s_);
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock lk(mu_);
      cv_.wait_for(lk, period, [&] { return stop_ || flush_requested_; });
      flush_requested_ = false;
      stopping = stop_;
      steps.swap(steps_);
      events.swap(events_);
    }
    const std::size_t n = steps.size() + events.size();
    const std::uint64_t skipped_before = cat_->catalog->dropped_records();
    Status s;
    if (!steps.empty()) s = cat_->catalog->write_steps(run_id_, steps);
    for (const auto& e : events) {
      Status es = cat_->catalog->write_event(run_id_, cat_->node_id, e);
      if (s && !es) s = es;
    }
    {
      std::lock_guard lk(mu_);
      // Records the catalog skipped (it stopped writing when the disk filled)
      // count as dropped; so does a batch whose transaction failed.
      std::uint64_t lost = cat_->catalog->dropped_records() - skipped_before;
      if (!s && lost == 0) lost = n;
      dropped_.fetch_add(lost);
      written_.fetch_add(n - std::min<std::uint64_t>(lost, n));
      if (!s && !has_error_) last_error_ = s.error(), has_error_ = true;
      completed_ += n;
    }
    done_cv_.notify_all();
    steps.clear();
    events.clear();
    if (stopping) {
      std::lock_guard lk(mu_);
      if (steps_.empty() && events_.empty()) break;
    }
  }
  std::lock_guard lk(mu_);
  completed_ = enqueued_;
  done_cv_.notify_all();
}

Expected<StepRecord> parse_step_json(std::string_view line) {
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Error{ErrorKind::kConfig, "not valid JSON"};
  if (!j.is_object()) return Error{ErrorKind::kConfig, "not a JSON object"};
  StepRecord r;
  auto it = j.find("step");
  if (it == j.end() || !it->is_number_integer()) return Error{ErrorKind::kConfig, "\"step\" missing or not an integer"};
  r.step = it->get<std::int64_t>();
  nlohmann::json extra = nlohmann::json::object();
  for (auto& item : j.items()) {
    // Named, not a structured binding: clang before 16 (the fuzz build) cannot capture bindings in a lambda.
    const std::string& key = item.key();
    nlohmann::json& value = item.value();
    if (key == "step") continue;
    const auto number = [&](std::optional<double>& out) -> Status {
      if (value.is_null()) return {};
      if (!value.is_number()) return Error{ErrorKind::kConfig, fmt::format("\"{}\" is not a number", key)};
      const double v = value.get<double>();
      if (!std::isfinite(v)) return Error{ErrorKind::kConfig, fmt::format("\"{}\" is not finite", key)};
      out = v;
      return {};
    };
    Status s;
    if (key == "loss") s = number(r.loss);
    else if (key == "tokens") s = number(r.tokens);
    else if (key == "data_wait_s") s = number(r.data_wait_s);
    else if (key == "comm_s") s = number(r.comm_s);
    else if (key == "flops") s = number(r.flops);
    else if (key == "step_time_s") s = number(r.step_time_s);
    else if (key == "t") {
      std::optional<double> t;
      s = number(t);
      r.t = t.value_or(0);
    } else if (key == "rank") {
      if (!value.is_number_integer() || value.get<std::int64_t>() < 0)
        return Error{ErrorKind::kConfig, "\"rank\" is not a non-negative integer"};
      r.rank = value.get<int>();
    } else if (key == "node") {
      if (!value.is_string()) return Error{ErrorKind::kConfig, "\"node\" is not a string"};
      r.node = value.get<std::string>();
    } else {
      extra[key] = value;
    }
    if (!s) return s.error();
  }
  for (const auto* d : {&r.data_wait_s, &r.comm_s, &r.step_time_s})
    if (*d && **d < 0) return Error{ErrorKind::kConfig, "durations must not be negative"};
  if (r.flops && *r.flops < 0) return Error{ErrorKind::kConfig, "\"flops\" must not be negative"};
  if (!extra.empty()) r.extra_json = extra.dump();
  return r;
}

std::vector<StepRecord> StepFileReader::poll(bool final) {
  std::vector<StepRecord> out;
  std::ifstream in(path_, std::ios::binary);
  if (!in) return out;  // not created yet
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  if (size < offset_) {  // truncated or replaced: start over
    offset_ = 0;
    partial_.clear();
  }
  in.seekg(static_cast<std::streamoff>(offset_));
  std::string chunk(size - offset_, '\0');
  in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
  chunk.resize(static_cast<std::size_t>(in.gcount()));
  offset_ += chunk.size();
  partial_ += chunk;
  std::size_t pos = 0;
  const auto take = [&](std::string_view line) {
    ++lines_;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.remove_suffix(1);
    if (line.empty()) return;
    auto r = parse_step_json(line);
    if (r) {
      out.push_back(std::move(*r));
      return;
    }
    ++malformed_;
    if (errors_.size() < 5) errors_.push_back(fmt::format("{}:{}: {}", path_, lines_, r.error().message));
  };
  for (;;) {
    const std::size_t nl = partial_.find('\n', pos);
    if (nl == std::string::npos) break;
    take(std::string_view(partial_).substr(pos, nl - pos));
    pos = nl + 1;
  }
  partial_.erase(0, pos);
  if (final && !partial_.empty()) {
    take(partial_);
    partial_.clear();
  }
  return out;
}

}  // namespace pacer::telemetry
