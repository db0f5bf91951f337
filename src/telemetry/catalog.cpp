#include "pacer/telemetry/catalog.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "pacer/core/posix_io.hpp"
#include "pacer/core/time.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/version.hpp"
#include "sqlite_util.hpp"

namespace pacer::telemetry {

using detail::sqlite_error;
using detail::Stmt;

namespace {

// The busiest thread of the followed process tree per sampling pass
// (ThreadRecord). Added within version 1, so kept apart from kSchema: see
// Catalog::open.
constexpr const char* kThreadsTable = R"sql(
CREATE TABLE IF NOT EXISTS threads(
  run_id INTEGER NOT NULL, t REAL NOT NULL, node_id INTEGER NOT NULL, pid INTEGER, tid INTEGER, comm TEXT,
  main INTEGER, python INTEGER, busy REAL NOT NULL, threads INTEGER, busy_threads INTEGER);
)sql";

// Version 1. Times are Unix seconds (REAL); values are in the metric's unit.
// docs/telemetry.md describes every column.
constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs(
  run_id INTEGER PRIMARY KEY, job_id TEXT NOT NULL DEFAULT '', command TEXT, hostname TEXT,
  started REAL, ended REAL, exit_code INTEGER, interval_s REAL, sampler_cpu_s REAL,
  catalog_status TEXT NOT NULL DEFAULT 'ok', pacer_version TEXT);
CREATE TABLE IF NOT EXISTS nodes(
  node_id INTEGER PRIMARY KEY, hostname TEXT NOT NULL UNIQUE, cpus INTEGER, memory_bytes INTEGER, kernel TEXT);
CREATE TABLE IF NOT EXISTS ranks(
  run_id INTEGER NOT NULL, rank INTEGER NOT NULL, node_id INTEGER, PRIMARY KEY(run_id, rank));
CREATE TABLE IF NOT EXISTS gpus(
  gpu_id INTEGER PRIMARY KEY, node_id INTEGER NOT NULL, gpu_index INTEGER NOT NULL, uuid TEXT, name TEXT,
  memory_bytes INTEGER, UNIQUE(node_id, gpu_index));
CREATE TABLE IF NOT EXISTS metrics(
  metric_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, unit TEXT NOT NULL, kind TEXT NOT NULL, description TEXT);
CREATE TABLE IF NOT EXISTS samples(
  run_id INTEGER NOT NULL, t REAL NOT NULL, node_id INTEGER NOT NULL, gpu_id INTEGER, device TEXT,
  metric_id INTEGER NOT NULL, value REAL NOT NULL);
CREATE INDEX IF NOT EXISTS samples_by_metric_time ON samples(metric_id, t);
CREATE TABLE IF NOT EXISTS steps(
  run_id INTEGER NOT NULL, rank INTEGER NOT NULL, node_id INTEGER, step INTEGER NOT NULL, t REAL NOT NULL,
  step_time_s REAL, loss REAL, tokens REAL, data_wait_s REAL, comm_s REAL, extra TEXT, flops REAL);
CREATE INDEX IF NOT EXISTS steps_by_rank ON steps(run_id, rank, step);
CREATE TABLE IF NOT EXISTS events(
  run_id INTEGER, t REAL NOT NULL, node_id INTEGER, rank INTEGER, gpu_id INTEGER, kind TEXT NOT NULL, detail TEXT);
CREATE TABLE IF NOT EXISTS run_sources(
  run_id INTEGER NOT NULL, job_id TEXT, hostname TEXT, started REAL, command TEXT);
CREATE VIEW IF NOT EXISTS samples_named AS
  SELECT s.run_id, s.t, n.hostname, g.gpu_index, s.device, m.name AS metric, m.unit, s.value
  FROM samples s JOIN metrics m USING(metric_id) JOIN nodes n USING(node_id) LEFT JOIN gpus g ON g.gpu_id = s.gpu_id;
)sql";


bool is_space_error(int rc) {
  const int primary = rc & 0xff;
  return primary == SQLITE_FULL || primary == SQLITE_IOERR;
}

// PRAGMAs a read-only query may run: those that only report. The first
// group takes an argument (a table or index name, a row limit); the others
// only without one, as with one they set something (query_only = 0 would
// undo the read-only guard).
bool read_only_pragma(const char* name, const char* arg) {
  static const char* kWithArgument[] = {"table_info", "table_xinfo", "table_list", "index_info", "index_xinfo",
                                        "index_list", "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check"};
  static const char* kWithoutArgument[] = {"user_version", "schema_version", "application_id", "page_count", "page_size",
                                           "freelist_count", "database_list", "collation_list", "function_list", "pragma_list",
                                           "module_list", "compile_options", "encoding", "data_version", "journal_mode",
                                           "query_only", "max_page_count", "cache_size", "busy_timeout", "foreign_keys",
                                           "auto_vacuum"};
  if (!name) return false;
  const auto is = [&](const char* known) { return sqlite3_stricmp(name, known) == 0; };
  if (std::any_of(std::begin(kWithArgument), std::end(kWithArgument), is)) return true;
  return !arg && std::any_of(std::begin(kWithoutArgument), std::end(kWithoutArgument), is);
}

const char* action_name(int action) {
  switch (action) {
    case SQLITE_INSERT: return "INSERT";
    case SQLITE_UPDATE: return "UPDATE";
    case SQLITE_DELETE: return "DELETE";
    case SQLITE_ATTACH: return "ATTACH";
    case SQLITE_DETACH: return "DETACH";
    case SQLITE_ALTER_TABLE: return "ALTER TABLE";
    case SQLITE_ANALYZE: return "ANALYZE";
    case SQLITE_REINDEX: return "REINDEX";
    case SQLITE_CREATE_VTABLE: return "CREATE VIRTUAL TABLE";
    case SQLITE_DROP_VTABLE: return "DROP VIRTUAL TABLE";
    case SQLITE_CREATE_INDEX: case SQLITE_CREATE_TABLE: case SQLITE_CREATE_TEMP_INDEX: case SQLITE_CREATE_TEMP_TABLE:
    case SQLITE_CREATE_TEMP_TRIGGER: case SQLITE_CREATE_TEMP_VIEW: case SQLITE_CREATE_TRIGGER: case SQLITE_CREATE_VIEW:
      return "CREATE";
    case SQLITE_DROP_INDEX: case SQLITE_DROP_TABLE: case SQLITE_DROP_TEMP_INDEX: case SQLITE_DROP_TEMP_TABLE:
    case SQLITE_DROP_TEMP_TRIGGER: case SQLITE_DROP_TEMP_VIEW: case SQLITE_DROP_TRIGGER: case SQLITE_DROP_VIEW:
      return "DROP";
    default: return "a statement that changes the database";
  }
}

bool has_column(sqlite3* db, const std::string& schema, const char* table, const char* column) {
  Stmt st(db, "SELECT 1 FROM pragma_table_info(?, ?) WHERE name = ?");
  st.bind(1, std::string(table));
  st.bind(2, schema);
  st.bind(3, std::string(column));
  return st.ok() && st.step() == SQLITE_ROW;
}

double now_s() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

Expected<std::unique_ptr<Catalog>> Catalog::open(const std::string& path, CatalogOptions options) {
  sqlite3* db = nullptr;
  const int flags = options.read_only ? SQLITE_OPEN_READONLY : (SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
  if (options.read_only) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) return Error{ErrorKind::kUsage, fmt::format("{}: no such catalog", path)};
  }
  const int rc = sqlite3_open_v2(path.c_str(), &db, flags | SQLITE_OPEN_NOMUTEX, nullptr);
  std::unique_ptr<Catalog> c(new Catalog(path, db));
  if (rc != SQLITE_OK) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, db ? sqlite3_errmsg(db) : "out of memory")};
  c->options_ = options;
  sqlite3_busy_timeout(db, options.busy_timeout_ms);
  if (options.read_only) {
    // SQLITE_OPEN_READONLY alone still lets a query write other files
    // (VACUUM INTO '/any/path', ATTACH of a new file): query_only, no
    // attached databases, defensive mode and an authorizer close those.
    sqlite3_limit(db, SQLITE_LIMIT_ATTACHED, 0);
    sqlite3_db_config(db, SQLITE_DBCONFIG_DEFENSIVE, 1, nullptr);
    if (auto s = c->exec("PRAGMA query_only=1"); !s) return s.error();
    sqlite3_set_authorizer(db, &Catalog::authorize, c.get());
  }
  // The version and whether any table exists, read in one transaction: a
  // process creating this catalog at the same moment commits both at once, so
  // a reader sees neither or both (read apart, it saw tables without a
  // version and called a new catalog foreign).
  int version = -1;
  std::int64_t tables = 0;
  {
    if (auto s = c->exec("BEGIN"); !s)
      return Error{ErrorKind::kConfig, fmt::format("{}: not a pacer catalog: {}", path, s.error().message)};
    Stmt st(db, "PRAGMA user_version");
    const bool read = st.ok() && st.step() == SQLITE_ROW;
    if (read) version = static_cast<int>(st.int64(0));
    Stmt master(db, "SELECT count(*) FROM sqlite_master");
    if (read && master.ok() && master.step() == SQLITE_ROW) tables = master.int64(0);
    const std::string why = sqlite3_errmsg(db);
    (void)c->exec("COMMIT");
    if (!read) return Error{ErrorKind::kConfig, fmt::format("{}: not a pacer catalog: {}", path, why)};
  }
  if (version > kCatalogSchemaVersion)
    return Error{ErrorKind::kConfig,
                 fmt::format("{}: catalog schema version {} is newer than this pacer understands (version {}); "
                             "use a newer pacer to read it",
                             path, version, kCatalogSchemaVersion)};
  if (version == 0) {
    if (tables > 0)
      return Error{ErrorKind::kConfig, fmt::format("{}: not a pacer catalog (an SQLite file without a schema version)", path)};
    if (options.read_only) return Error{ErrorKind::kConfig, fmt::format("{}: empty file, not a pacer catalog", path)};
  }
  if (!options.read_only) {
    // WAL lets the monitor and the training processes write while a query reads.
    // Switching to WAL needs the file to itself and answers "database is
    // locked" at once, without the busy handler, while another process opens
    // it: retried within the busy timeout.
    for (int waited_ms = 0;; waited_ms += 10) {
      Status s = c->exec("PRAGMA journal_mode=WAL");
      if (s) break;
      if (waited_ms >= options.busy_timeout_ms || s.error().message.find("locked") == std::string::npos) return s.error();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (auto s = c->exec("PRAGMA synchronous=NORMAL"); !s) return s.error();
    if (version == 0)
      if (auto s = c->create_schema(); !s) return s.error();
    // The threads table came later within version 1: a catalog made before
    // it gets it when opened for writing (readers check that it is there).
    if (version > 0)
      if (auto s = c->exec(kThreadsTable); !s) return s.error();
    // steps.flops came later within version 1 too. Two writers opening an
    // older catalog at once both try: the loser finds the column there.
    if (version > 0 && !has_column(db, "main", "steps", "flops"))
      if (auto s = c->exec("ALTER TABLE steps ADD COLUMN flops REAL"); !s && !has_column(db, "main", "steps", "flops"))
        return s.error();
    // After the schema, so that the cap limits data, not the catalog's creation.
    if (options.max_pages > 0)
      if (auto s = c->exec(fmt::format("PRAGMA max_page_count={}", options.max_pages)); !s) return s.error();
  }
  c->schema_version_ = kCatalogSchemaVersion;
  return c;
}

Catalog::~Catalog() { sqlite3_close_v2(db_); }

int Catalog::authorize(void* self, int action, const char* a, const char* b, const char*, const char*) {
  auto* c = static_cast<Catalog*>(self);
  switch (action) {
    case SQLITE_SELECT:
    case SQLITE_READ:
    case SQLITE_FUNCTION:
    case SQLITE_RECURSIVE:
    case SQLITE_TRANSACTION:
    case SQLITE_SAVEPOINT:
      return SQLITE_OK;
    case SQLITE_PRAGMA:
      if (read_only_pragma(a, b)) return SQLITE_OK;
      c->refused_ = b ? fmt::format("PRAGMA {} = {}", a ? a : "", b) : fmt::format("PRAGMA {}", a ? a : "");
      return SQLITE_DENY;
    default:
      c->refused_ = action_name(action);
      return SQLITE_DENY;
  }
}

Status Catalog::exec(const std::string& sql) {
  char* msg = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &msg);
  if (rc == SQLITE_OK) return {};
  Error e{is_space_error(rc) ? ErrorKind::kIo : ErrorKind::kRuntime,
          fmt::format("{}: {}", path_, msg ? msg : sqlite3_errstr(rc))};
  sqlite3_free(msg);
  return e;
}

Status Catalog::create_schema() {
  // BEGIN IMMEDIATE: two processes creating the same new catalog must not
  // both see version 0 and race; the loser re-reads the version under the lock.
  if (auto s = exec("BEGIN IMMEDIATE"); !s) return s;
  {
    Stmt st(db_, "PRAGMA user_version");
    if (st.ok() && st.step() == SQLITE_ROW && st.int64(0) != 0) return exec("COMMIT");
  }
  Status s = exec(kSchema);
  if (s) s = exec(kThreadsTable);
  if (s) s = exec(fmt::format("INSERT OR REPLACE INTO meta VALUES('schema', 'pacer.catalog/{0}'); PRAGMA user_version={0}",
                              kCatalogSchemaVersion));
  if (!s) {
    (void)exec("ROLLBACK");
    return s;
  }
  return exec("COMMIT");
}

template <class Fn>
Status Catalog::write(std::int64_t run_id, std::size_t records, Fn&& fn) {
  if (writes_stopped()) {
    dropped_ += records;
    return {};
  }
  int rc = SQLITE_OK;
  if (rc = sqlite3_exec(db_, "BEGIN", nullptr, nullptr, nullptr); rc == SQLITE_OK) {
    rc = fn();
    if (rc == SQLITE_OK) rc = sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr);
  }
  if (rc == SQLITE_OK) return {};
  Error e = sqlite_error(db_, "write");
  sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  // Metric and GPU rows first inserted by this batch were rolled back with
  // it; their cached ids would make later samples point at nothing.
  metric_ids_.clear();
  gpu_ids_.clear();
  // The batch is lost either way; only a full disk stops later writes.
  dropped_ += records;
  if (!is_space_error(rc)) return e;
  stop_reason_ = fmt::format("writes stopped at {:.3f}: {}", now_s(), sqlite3_errstr(rc));
  // Updating a row in place needs no new page, so this usually still fits
  // on a full disk; if not, the monitor's summary still says it.
  if (run_id > 0) {
    Stmt st(db_, "UPDATE runs SET catalog_status=? WHERE run_id=?");
    st.bind(1, stop_reason_);
    st.bind(2, run_id);
    st.step();
  }
  return Error{ErrorKind::kIo, e.message + "; the catalog stops writing, the run goes on"};
}

Expected<std::int64_t> Catalog::begin_run(const RunInfo& run) {
  Stmt st(db_,
          "INSERT INTO runs(job_id, command, hostname, started, interval_s, pacer_version) VALUES(?,?,?,?,?,?)");
  st.bind(1, run.job_id);
  st.bind(2, run.command);
  st.bind(3, run.hostname);
  st.bind(4, run.started);
  st.bind(5, run.interval_s);
  st.bind(6, std::string(kVersion));
  if (st.step() != SQLITE_DONE) return sqlite_error(db_, "insert run");
  return sqlite3_last_insert_rowid(db_);
}

Status Catalog::end_run(std::int64_t run_id, double ended, std::optional<int> exit_code, double sampler_cpu_s) {
  if (writes_stopped()) return {};
  Stmt st(db_, "UPDATE runs SET ended=?, exit_code=?, sampler_cpu_s=coalesce(sampler_cpu_s, 0)+? WHERE run_id=?");
  st.bind(1, ended);
  exit_code ? st.bind(2, std::int64_t{*exit_code}) : st.bind_null(2);
  st.bind(3, sampler_cpu_s);
  st.bind(4, run_id);
  if (st.step() != SQLITE_DONE) return sqlite_error(db_, "update run");
  return {};
}

Status Catalog::continue_run(std::int64_t run_id, double interval_s) {
  Stmt find(db_, "SELECT 1 FROM runs WHERE run_id=?");
  find.bind(1, run_id);
  const int rc = find.step();
  if (rc == SQLITE_DONE) return Error{ErrorKind::kUsage, fmt::format("{}: no run {} in this catalog", path_, run_id)};
  if (rc != SQLITE_ROW) return sqlite_error(db_, "find run");
  Stmt st(db_, "UPDATE runs SET interval_s=? WHERE run_id=? AND (interval_s IS NULL OR interval_s=0)");
  st.bind(1, interval_s);
  st.bind(2, run_id);
  if (st.step() != SQLITE_DONE) return sqlite_error(db_, "update run");
  return {};
}

Expected<std::int64_t> Catalog::node_id(const NodeInfo& node) {
  for (const auto& [name, id] : node_ids_)
    if (name == node.hostname) return id;
  {
    Stmt ins(db_, "INSERT INTO nodes(hostname, cpus, memory_bytes, kernel) VALUES(?,?,?,?) ON CONFLICT(hostname) DO "
                  "UPDATE SET cpus=coalesce(excluded.cpus, cpus), memory_bytes=coalesce(excluded.memory_bytes, memory_bytes), "
                  "kernel=coalesce(excluded.kernel, kernel)");
    ins.bind(1, node.hostname);
    node.cpus ? ins.bind(2, std::int64_t{node.cpus}) : ins.bind_null(2);
    node.memory_bytes ? ins.bind(3, static_cast<std::int64_t>(node.memory_bytes)) : ins.bind_null(3);
    node.kernel.empty() ? ins.bind_null(4) : ins.bind(4, node.kernel);
    if (ins.step() != SQLITE_DONE) return sqlite_error(db_, "insert node " + node.hostname);
  }
  Stmt sel(db_, "SELECT node_id FROM nodes WHERE hostname=?");
  sel.bind(1, node.hostname);
  if (sel.step() != SQLITE_ROW) return sqlite_error(db_, "select node " + node.hostname);
  node_ids_.emplace_back(node.hostname, sel.int64(0));
  return sel.int64(0);
}

Status Catalog::add_gpus(std::int64_t node_id, const std::vector<GpuRecord>& gpus) {
  Stmt st(db_, "INSERT INTO gpus(node_id, gpu_index, uuid, name, memory_bytes) VALUES(?,?,?,?,?) "
               "ON CONFLICT(node_id, gpu_index) DO UPDATE SET uuid=excluded.uuid, name=excluded.name, "
               "memory_bytes=excluded.memory_bytes");
  for (const auto& g : gpus) {
    st.reset();
    st.bind(1, node_id);
    st.bind(2, std::int64_t{g.index});
    st.bind(3, g.uuid);
    st.bind(4, g.name);
    st.bind(5, static_cast<std::int64_t>(g.memory_bytes));
    if (st.step() != SQLITE_DONE) return sqlite_error(db_, fmt::format("insert gpu {}", g.index));
  }
  return {};
}

Expected<std::int64_t> Catalog::metric_id(const MetricDef& def) {
  for (const auto& [d, id] : metric_ids_)
    if (d == &def) return id;
  {
    Stmt ins(db_, "INSERT OR IGNORE INTO metrics(name, unit, kind, description) VALUES(?,?,?,?)");
    const bool counter = def.kind == MetricKind::kCounter;
    ins.bind(1, std::string(def.name));
    // A counter's stored value is its rate; its unit says so.
    ins.bind(2, counter ? std::string(def.unit) + "/s" : std::string(def.unit));
    ins.bind(3, std::string(counter ? "rate" : "gauge"));
    ins.bind(4, std::string(def.help));
    if (ins.step() != SQLITE_DONE) return sqlite_error(db_, "insert metric");
  }
  Stmt sel(db_, "SELECT metric_id FROM metrics WHERE name=?");
  sel.bind(1, std::string(def.name));
  if (sel.step() != SQLITE_ROW) return sqlite_error(db_, "select metric");
  metric_ids_.emplace_back(&def, sel.int64(0));
  return sel.int64(0);
}

Expected<std::int64_t> Catalog::gpu_id(std::int64_t node_id, int index) {
  for (const auto& [key, id] : gpu_ids_)
    if (key.first == node_id && key.second == index) return id;
  {
    Stmt ins(db_, "INSERT OR IGNORE INTO gpus(node_id, gpu_index) VALUES(?,?)");
    ins.bind(1, node_id);
    ins.bind(2, std::int64_t{index});
    if (ins.step() != SQLITE_DONE) return sqlite_error(db_, "insert gpu");
  }
  Stmt sel(db_, "SELECT gpu_id FROM gpus WHERE node_id=? AND gpu_index=?");
  sel.bind(1, node_id);
  sel.bind(2, std::int64_t{index});
  if (sel.step() != SQLITE_ROW) return sqlite_error(db_, "select gpu");
  gpu_ids_.emplace_back(std::make_pair(node_id, index), sel.int64(0));
  return sel.int64(0);
}

Status Catalog::write_sample(std::int64_t run_id, std::int64_t node_id, const Sample& sample) {
  return write(run_id, sample.readings.size() + sample.events.size() + (sample.busiest_thread ? 1 : 0), [&]() -> int {
    Stmt st(db_, "INSERT INTO samples(run_id, t, node_id, gpu_id, device, metric_id, value) VALUES(?,?,?,?,?,?,?)");
    if (!st.ok()) return st.prepare_rc();
    for (const auto& r : sample.readings) {
      // SQLite binds NaN as NULL, which the NOT NULL value column rejects and
      // which would fail the whole pass: a non-finite value is skipped alone.
      if (!std::isfinite(r.value)) {
        ++nonfinite_;
        continue;
      }
      auto mid = metric_id(*r.metric);
      if (!mid) return sqlite3_errcode(db_);
      st.reset();
      st.bind(1, run_id);
      st.bind(2, sample.t);
      st.bind(3, node_id);
      if (r.gpu >= 0) {
        auto gid = gpu_id(node_id, r.gpu);
        if (!gid) return sqlite3_errcode(db_);
        st.bind(4, *gid);
      }
      if (!r.device.empty()) st.bind(5, r.device);
      st.bind(6, *mid);
      st.bind(7, r.value);
      if (const int rc = st.step(); rc != SQLITE_DONE) return rc;
    }
    Stmt ev(db_, "INSERT INTO events(run_id, t, node_id, rank, gpu_id, kind, detail) VALUES(?,?,?,?,?,?,?)");
    for (const auto& e : sample.events) {
      if (!std::isfinite(e.t)) {
        ++nonfinite_;
        continue;
      }
      ev.reset();
      ev.bind(1, run_id);
      ev.bind(2, e.t);
      ev.bind(3, node_id);
      if (e.rank >= 0) ev.bind(4, std::int64_t{e.rank});
      if (e.gpu >= 0) {
        auto gid = gpu_id(node_id, e.gpu);
        if (!gid) return sqlite3_errcode(db_);
        ev.bind(5, *gid);
      }
      ev.bind(6, e.kind);
      ev.bind(7, e.detail);
      if (const int rc = ev.step(); rc != SQLITE_DONE) return rc;
    }
    if (const auto& th = sample.busiest_thread) {
      if (!std::isfinite(th->busy)) {
        ++nonfinite_;
        return SQLITE_OK;
      }
      Stmt ins(db_, "INSERT INTO threads(run_id, t, node_id, pid, tid, comm, main, python, busy, threads, busy_threads) "
                    "VALUES(?,?,?,?,?,?,?,?,?,?,?)");
      if (!ins.ok()) return ins.prepare_rc();
      ins.bind(1, run_id);
      ins.bind(2, sample.t);
      ins.bind(3, node_id);
      ins.bind(4, std::int64_t{th->pid});
      ins.bind(5, std::int64_t{th->tid});
      ins.bind(6, th->comm);
      ins.bind(7, std::int64_t{th->main});
      ins.bind(8, std::int64_t{th->python});
      ins.bind(9, th->busy);
      ins.bind(10, std::int64_t{th->threads});
      ins.bind(11, std::int64_t{th->busy_threads});
      if (const int rc = ins.step(); rc != SQLITE_DONE) return rc;
    }
    return SQLITE_OK;
  });
}

Status Catalog::write_steps(std::int64_t run_id, const std::vector<StepRecord>& steps) {
  return write(run_id, steps.size(), [&]() -> int {
    Stmt prev(db_, "SELECT t FROM steps WHERE run_id=? AND rank=? AND step<? ORDER BY step DESC LIMIT 1");
    Stmt rank(db_, "INSERT OR IGNORE INTO ranks(run_id, rank, node_id) VALUES(?,?,?)");
    Stmt st(db_, "INSERT INTO steps(run_id, rank, node_id, step, t, step_time_s, loss, tokens, data_wait_s, comm_s, extra, flops) "
                 "VALUES(?,?,?,?,?,?,?,?,?,?,?,?)");
    if (!st.ok()) return st.prepare_rc();
    const std::string here = hw::hostname();
    // Optional fields that are not finite are stored as NULL (SQL has no NaN);
    // a step without a finite time cannot be placed and is skipped.
    const auto finite = [&](std::optional<double> v) -> std::optional<double> {
      if (v && !std::isfinite(*v)) {
        ++nonfinite_;
        return std::nullopt;
      }
      return v;
    };
    for (const auto& s : steps) {
      if (!std::isfinite(s.t)) {
        ++nonfinite_;
        continue;
      }
      NodeInfo n;
      n.hostname = s.node.empty() ? here : s.node;
      auto nid = node_id(n);
      if (!nid) return sqlite3_errcode(db_);
      const std::int64_t r = s.rank;
      rank.reset();
      rank.bind(1, run_id);
      rank.bind(2, r);
      rank.bind(3, *nid);
      if (const int rc = rank.step(); rc != SQLITE_DONE) return rc;
      std::optional<double> step_time = s.step_time_s;
      if (!step_time) {
        prev.reset();
        prev.bind(1, run_id);
        prev.bind(2, r);
        prev.bind(3, s.step);
        if (prev.step() == SQLITE_ROW && s.t >= prev.real(0)) step_time = s.t - prev.real(0);
      }
      st.reset();
      st.bind(1, run_id);
      st.bind(2, r);
      st.bind(3, *nid);
      st.bind(4, s.step);
      st.bind(5, s.t);
      st.bind(6, finite(step_time));
      st.bind(7, finite(s.loss));
      st.bind(8, finite(s.tokens));
      st.bind(9, finite(s.data_wait_s));
      st.bind(10, finite(s.comm_s));
      if (!s.extra_json.empty()) st.bind(11, s.extra_json);
      st.bind(12, finite(s.flops));
      if (const int rc = st.step(); rc != SQLITE_DONE) return rc;
    }
    return SQLITE_OK;
  });
}

Status Catalog::write_event(std::int64_t run_id, std::int64_t node_id, const EventRecord& event) {
  Sample s;
  s.events.push_back(event);
  return write_sample(run_id, node_id, s);
}

namespace {

// The progress handler's deadline: a nonzero return interrupts the statement.
struct Deadline {
  std::chrono::steady_clock::time_point at;
  bool passed = false;
};
int past_deadline(void* p) {
  auto* d = static_cast<Deadline*>(p);
  d->passed = d->passed || std::chrono::steady_clock::now() >= d->at;
  return d->passed ? 1 : 0;
}

}  // namespace

Expected<QueryResult> Catalog::query(const std::string& sql) {
  QueryResult out;
  const char* tail = sql.c_str();
  Deadline deadline;
  const double timeout = options_.query_timeout_s;
  if (timeout > 0) {
    deadline.at = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(std::min(timeout, 1e9)));
    sqlite3_progress_handler(db_, 1000, past_deadline, &deadline);
  }
  struct Unhook {
    sqlite3* db;
    bool on;
    ~Unhook() {
      if (on) sqlite3_progress_handler(db, 0, nullptr, nullptr);
    }
  } unhook{db_, timeout > 0};
  const auto stopped = [&] {
    return Error{ErrorKind::kRuntime, fmt::format("{}: query stopped at its time limit of {:g} s", path_, timeout)};
  };
  // Several statements run in order; the last one that returns columns is the result.
  while (tail && *tail) {
    sqlite3_stmt* raw = nullptr;
    refused_.clear();
    if (sqlite3_prepare_v2(db_, tail, -1, &raw, &tail) != SQLITE_OK) {
      if (!refused_.empty())
        return Error{ErrorKind::kUsage, fmt::format("{}: refused: {} (a read-only query changes no file)", path_, refused_)};
      if (deadline.passed) return stopped();
      return Error{ErrorKind::kUsage, fmt::format("{}: SQL error: {}", path_, sqlite3_errmsg(db_))};
    }
    if (!raw) break;  // whitespace or a comment
    std::unique_ptr<sqlite3_stmt, int (*)(sqlite3_stmt*)> stmt(raw, sqlite3_finalize);
    // What the authorizer has no action for (VACUUM, which can write a copy
    // anywhere) still marks the statement as one that writes.
    if (options_.read_only && !sqlite3_stmt_readonly(raw)) {
      std::string head(sqlite3_sql(raw) ? sqlite3_sql(raw) : "");
      if (head.size() > 60) head = head.substr(0, 57) + "...";
      return Error{ErrorKind::kUsage, fmt::format("{}: refused: '{}' would change a file (a read-only query changes no file)", path_, head)};
    }
    QueryResult r;
    const int ncol = sqlite3_column_count(raw);
    for (int i = 0; i < ncol; ++i) r.columns.emplace_back(sqlite3_column_name(raw, i));
    std::uint64_t bytes = 0;
    int rc;
    while ((rc = sqlite3_step(raw)) == SQLITE_ROW) {
      std::vector<Value> row;
      row.reserve(static_cast<std::size_t>(ncol));
      bytes += sizeof(row) + static_cast<std::uint64_t>(ncol) * sizeof(Value);
      for (int i = 0; i < ncol; ++i) {
        switch (sqlite3_column_type(raw, i)) {
          case SQLITE_INTEGER: row.emplace_back(static_cast<std::int64_t>(sqlite3_column_int64(raw, i))); break;
          case SQLITE_FLOAT: row.emplace_back(sqlite3_column_double(raw, i)); break;
          case SQLITE_NULL: row.emplace_back(std::monostate{}); break;
          default: {
            const unsigned char* p = sqlite3_column_text(raw, i);
            row.emplace_back(std::string(p ? reinterpret_cast<const char*>(p) : ""));
            bytes += static_cast<std::uint64_t>(sqlite3_column_bytes(raw, i));
          }
        }
      }
      r.rows.push_back(std::move(row));
      if (options_.max_result_bytes > 0 && bytes > options_.max_result_bytes)
        return Error{ErrorKind::kRuntime, fmt::format("{}: query result larger than its limit of {} bytes (narrow it, e.g. with LIMIT)",
                                                      path_, options_.max_result_bytes)};
    }
    if (rc == SQLITE_INTERRUPT && deadline.passed) return stopped();
    if (rc != SQLITE_DONE)
      return Error{ErrorKind::kUsage, fmt::format("{}: SQL error: {}", path_, sqlite3_errmsg(db_))};
    if (ncol > 0) out = std::move(r);
  }
  return out;
}

std::string default_catalog_name() {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !*job) return "pacer-telemetry.db";
  const char* nodes = std::getenv("SLURM_JOB_NUM_NODES");
  if (!nodes) nodes = std::getenv("SLURM_NNODES");
  if (nodes && std::atoi(nodes) > 1) return fmt::format("pacer-{}-{}.db", job, hw::hostname());
  return fmt::format("pacer-{}.db", job);
}

namespace {

bool has_table(sqlite3* db, const std::string& schema, const char* table) {
  Stmt st(db, ("SELECT 1 FROM " + schema + ".sqlite_master WHERE type='table' AND name=?").c_str());
  st.bind(1, std::string(table));
  return st.ok() && st.step() == SQLITE_ROW;
}

// Copies one attached catalog ("src") into main, remapping every id. A run
// of src already in main (one of its identities, job id, host, start and
// command, is in main.run_sources: the same file merged twice, or a copy of
// it) is skipped with a note, so that no step or sample is counted twice.
Status merge_one(Catalog& out, const std::string& input, const std::string& target, MergeResult& totals) {
  sqlite3* db = out.handle();
  const auto run = [&](const std::string& sql) -> Status {
    char* msg = nullptr;
    if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &msg) == SQLITE_OK) return {};
    Error e{ErrorKind::kIo, fmt::format("merging {}: {}", input, msg ? msg : "?")};
    sqlite3_free(msg);
    return e;
  };
  {
    Stmt att(db, "ATTACH DATABASE ? AS src");
    att.bind(1, input);
    if (att.step() != SQLITE_DONE) return sqlite_error(db, "attach " + input);
  }
  Status s = run(R"sql(
BEGIN;
INSERT OR IGNORE INTO main.metrics(name, unit, kind, description) SELECT name, unit, kind, description FROM src.metrics;
CREATE TEMP TABLE mmap AS SELECT s.metric_id AS old, m.metric_id AS new FROM src.metrics s JOIN main.metrics m USING(name);
INSERT OR IGNORE INTO main.nodes(hostname, cpus, memory_bytes, kernel) SELECT hostname, cpus, memory_bytes, kernel FROM src.nodes;
CREATE TEMP TABLE nmap AS SELECT s.node_id AS old, m.node_id AS new FROM src.nodes s JOIN main.nodes m USING(hostname);
INSERT OR IGNORE INTO main.gpus(node_id, gpu_index, uuid, name, memory_bytes)
  SELECT nmap.new, g.gpu_index, g.uuid, g.name, g.memory_bytes FROM src.gpus g JOIN nmap ON nmap.old = g.node_id;
CREATE TEMP TABLE gmap AS SELECT g.gpu_id AS old, m.gpu_id AS new FROM src.gpus g JOIN nmap ON nmap.old = g.node_id
  JOIN main.gpus m ON m.node_id = nmap.new AND m.gpu_index = g.gpu_index;
CREATE TEMP TABLE rmap(old INTEGER PRIMARY KEY, new INTEGER);
)sql");
  // Runs: a job's per-node files share a job id and become one run.
  bool skipped_any = false;
  if (s) {
    // A run's identities: its own row, and the runs merged into it when src
    // is itself a merged catalog.
    const bool src_sources = has_table(db, "src", "run_sources");
    const std::string ids_sql =
        std::string("SELECT job_id, hostname, started, command FROM src.runs WHERE run_id=?1") +
        (src_sources ? " UNION SELECT job_id, hostname, started, command FROM src.run_sources WHERE run_id=?1" : "");
    Stmt ids(db, ids_sql.c_str());
    Stmt present(db, "SELECT 1 FROM main.run_sources WHERE job_id IS ? AND hostname IS ? AND started IS ? AND command IS ? LIMIT 1");
    Stmt record(db, "INSERT INTO main.run_sources(run_id, job_id, hostname, started, command) VALUES(?,?,?,?,?)");
    Stmt src(db, "SELECT run_id, job_id, started, ended, hostname FROM src.runs");
    Stmt find(db, "SELECT run_id FROM main.runs WHERE job_id=? AND job_id<>'' LIMIT 1");
    Stmt widen(db, "UPDATE main.runs SET started=min(coalesce(started, ?1), ?1), ended=max(coalesce(ended, ?2), ?2) WHERE run_id=?3");
    Stmt ins(db, "INSERT INTO main.runs(job_id, command, hostname, started, ended, exit_code, interval_s, sampler_cpu_s, "
                 "catalog_status, pacer_version) SELECT job_id, command, hostname, started, ended, exit_code, interval_s, "
                 "sampler_cpu_s, catalog_status, pacer_version FROM src.runs WHERE run_id=?");
    Stmt map(db, "INSERT INTO temp.rmap VALUES(?,?)");
    while (s && src.step() == SQLITE_ROW) {
      const std::int64_t old = src.int64(0);
      // Identities as values of their own column types (started is REAL,
      // NULL stays NULL), compared with IS.
      std::vector<std::array<sqlite3_value*, 4>> identities;
      const auto free_identities = [&] {
        for (auto& v : identities)
          for (auto* x : v) sqlite3_value_free(x);
        identities.clear();
      };
      ids.reset();
      ids.bind(1, old);
      bool already = false;
      while (ids.step() == SQLITE_ROW) {
        std::array<sqlite3_value*, 4> v{};
        for (int i = 0; i < 4; ++i) v[i] = sqlite3_value_dup(sqlite3_column_value(ids.get(), i));
        identities.push_back(v);
        present.reset();
        for (int i = 0; i < 4; ++i) sqlite3_bind_value(present.get(), i + 1, v[i]);
        if (present.step() == SQLITE_ROW) already = true;
      }
      if (already) {
        totals.skipped.push_back(fmt::format("{}: run {} (job '{}' on {}) is already in {}: skipped", input, old, src.text(1),
                                             src.text(4), target));
        skipped_any = true;
        free_identities();
        continue;
      }
      std::int64_t id = -1;
      find.reset();
      find.bind(1, src.text(1));
      if (find.step() == SQLITE_ROW) {
        id = find.int64(0);
        widen.reset();
        widen.bind(1, src.real(2));
        widen.bind(2, src.real(3));
        widen.bind(3, id);
        widen.step();
      } else {
        ins.reset();
        ins.bind(1, old);
        if (ins.step() != SQLITE_DONE) s = sqlite_error(db, "merge run");
        id = sqlite3_last_insert_rowid(db);
        ++totals.runs;
      }
      map.reset();
      map.bind(1, old);
      map.bind(2, id);
      map.step();
      for (const auto& v : identities) {
        record.reset();
        record.bind(1, id);
        for (int i = 0; i < 4; ++i) sqlite3_bind_value(record.get(), i + 2, v[i]);
        if (record.step() != SQLITE_DONE) s = sqlite_error(db, "merge run identity");
      }
      free_identities();
    }
  }
  // Rows of skipped runs stay out (the joins on rmap); so do events of no
  // run when any run was skipped, as they came with it the first time.
  const auto copy = [&](const std::string& sql, std::int64_t* count) {
    if (!s) return;
    s = run(sql);
    if (s && count) *count += sqlite3_changes(db);
  };
  copy(R"sql(
INSERT INTO main.samples(run_id, t, node_id, gpu_id, device, metric_id, value)
  SELECT rmap.new, s.t, nmap.new, gmap.new, s.device, mmap.new, s.value FROM src.samples s
  JOIN temp.rmap ON rmap.old = s.run_id JOIN temp.nmap ON nmap.old = s.node_id JOIN temp.mmap ON mmap.old = s.metric_id
  LEFT JOIN temp.gmap ON gmap.old = s.gpu_id)sql", &totals.samples);
  if (has_table(db, "src", "threads"))
    copy(R"sql(
INSERT INTO main.threads(run_id, t, node_id, pid, tid, comm, main, python, busy, threads, busy_threads)
  SELECT rmap.new, h.t, nmap.new, h.pid, h.tid, h.comm, h.main, h.python, h.busy, h.threads, h.busy_threads FROM src.threads h
  JOIN temp.rmap ON rmap.old = h.run_id JOIN temp.nmap ON nmap.old = h.node_id)sql", nullptr);
  copy(R"sql(
INSERT OR IGNORE INTO main.ranks(run_id, rank, node_id)
  SELECT rmap.new, r.rank, nmap.new FROM src.ranks r JOIN temp.rmap ON rmap.old = r.run_id LEFT JOIN temp.nmap ON nmap.old = r.node_id)sql",
       nullptr);
  copy(fmt::format(R"sql(
INSERT INTO main.steps(run_id, rank, node_id, step, t, step_time_s, loss, tokens, data_wait_s, comm_s, extra, flops)
  SELECT rmap.new, s.rank, nmap.new, s.step, s.t, s.step_time_s, s.loss, s.tokens, s.data_wait_s, s.comm_s, s.extra, {}
  FROM src.steps s JOIN temp.rmap ON rmap.old = s.run_id LEFT JOIN temp.nmap ON nmap.old = s.node_id)sql",
                   has_column(db, "src", "steps", "flops") ? "s.flops" : "NULL"), &totals.steps);
  copy(fmt::format(R"sql(
INSERT INTO main.events(run_id, t, node_id, rank, gpu_id, kind, detail)
  SELECT rmap.new, e.t, nmap.new, e.rank, gmap.new, e.kind, e.detail FROM src.events e
  LEFT JOIN temp.rmap ON rmap.old = e.run_id LEFT JOIN temp.nmap ON nmap.old = e.node_id LEFT JOIN temp.gmap ON gmap.old = e.gpu_id
  WHERE rmap.new IS NOT NULL OR (e.run_id IS NULL AND {}))sql", skipped_any ? 0 : 1), &totals.events);
  if (s) s = run("COMMIT");
  if (!s) (void)run("ROLLBACK");
  (void)run("DROP TABLE IF EXISTS temp.mmap; DROP TABLE IF EXISTS temp.nmap; DROP TABLE IF EXISTS temp.gmap; "
            "DROP TABLE IF EXISTS temp.rmap; DETACH DATABASE src");
  return s;
}

}  // namespace

Expected<MergeResult> merge_catalogs(const std::string& out, const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  std::vector<std::string> all;
  std::vector<std::pair<std::string, struct stat>> seen;  // what `all` holds, by file
  MergeResult result;
  std::error_code ec;
  struct stat out_st {};
  const bool out_exists = ::stat(out.c_str(), &out_st) == 0;
  if (out_exists) {
    all.push_back(out);
    seen.emplace_back(out, out_st);
  }
  for (const auto& in : inputs) {
    // Each input is opened on its own first: a missing file or a newer
    // schema is reported by name before anything is written.
    auto c = Catalog::open(in, CatalogOptions{.read_only = true});
    if (!c) return c.error();
    // The same file twice (by another name, a link) would be merged twice.
    struct stat st {};
    if (::stat(in.c_str(), &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: cannot stat: {}", in, std::strerror(errno))};
    const auto same = std::find_if(seen.begin(), seen.end(), [&](const auto& s) {
      return s.second.st_dev == st.st_dev && s.second.st_ino == st.st_ino;
    });
    if (same != seen.end() && out_exists && same == seen.begin())
      return Error{ErrorKind::kUsage, fmt::format("{} is the output catalog {} itself: a catalog is not merged into itself", in, out)};
    if (same != seen.end()) {
      result.skipped.push_back(fmt::format("{} is the same file as {}: merged once", in, same->first));
      continue;
    }
    all.push_back(in);
    seen.emplace_back(in, st);
  }
  const std::string tmp = out + ".merge-tmp";
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(tmp + suffix, ec);
  {
    auto dst = Catalog::open(tmp);
    if (!dst) return dst.error();
    for (const auto& in : all) {
      if (auto s = merge_one(**dst, in, out, result); !s) {
        dst->reset();
        for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(tmp + suffix, ec);
        return s.error();
      }
    }
    auto nodes = (*dst)->query("SELECT count(*) FROM nodes");
    if (nodes && !nodes->rows.empty()) result.nodes = std::get<std::int64_t>(nodes->rows[0][0]);
    auto runs = (*dst)->query("SELECT count(*) FROM runs");
    if (runs && !runs->rows.empty()) result.runs = std::get<std::int64_t>(runs->rows[0][0]);
    // Fold the WAL into the file so that the rename moves everything.
    if (sqlite3_exec((*dst)->handle(), "PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode=DELETE", nullptr, nullptr,
                     nullptr) != SQLITE_OK)
      return sqlite_error((*dst)->handle(), "checkpoint");
  }
  result.inputs = all.size() - (out_exists ? 1 : 0);
  fs::rename(tmp, out, ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: cannot rename {} into place: {}", out, tmp, ec.message())};
  for (const char* suffix : {"-wal", "-shm"}) fs::remove(out + suffix, ec);
  if (auto s = fsync_dir(fs::path(out).parent_path().string()); !s) return s.error();
  return result;
}

Status Catalog::discard_run(std::int64_t run_id) {
  return write(0, 0, [&]() -> int {
    for (const char* table : {"samples", "steps", "events", "ranks", "threads", "run_sources", "runs"}) {
      Stmt st(db_, fmt::format("DELETE FROM {} WHERE run_id=?", table).c_str());
      if (!st.ok()) return st.prepare_rc();
      st.bind(1, run_id);
      if (const int rc = st.step(); rc != SQLITE_DONE) return rc;
    }
    return SQLITE_OK;
  });
}

Status check_run(Catalog& catalog, std::int64_t run_id) {
  auto found = catalog.query(fmt::format("SELECT 1 FROM runs WHERE run_id = {}", run_id));
  if (!found) return found.error();
  if (!found->rows.empty()) return {};
  // Enough of the list to pick from; a catalog of thousands of runs says how many more.
  constexpr int kListed = 10;
  auto runs = catalog.query(fmt::format(
      "SELECT run_id, started, command, (SELECT count(*) FROM runs) FROM runs ORDER BY started DESC, run_id DESC LIMIT {}",
      kListed));
  if (!runs) return runs.error();
  if (runs->rows.empty())
    return Error{ErrorKind::kUsage, fmt::format("{}: no run {} in the catalog (it holds no run)", catalog.path(), run_id)};
  std::string list;
  for (const auto& row : runs->rows) {
    const auto* id = std::get_if<std::int64_t>(&row[0]);
    const auto* started = std::get_if<double>(&row[1]);
    const auto* command = std::get_if<std::string>(&row[2]);
    list += fmt::format("{}{} ({}{}{})", list.empty() ? "" : ", ", id ? *id : 0, started ? utc_iso(*started) : "not started",
                        command && !command->empty() ? ": " : "", command ? *command : "");
  }
  const auto* total = std::get_if<std::int64_t>(&runs->rows[0][3]);
  if (total && *total > kListed) list += fmt::format(" and {} more", *total - kListed);
  return Error{ErrorKind::kUsage, fmt::format("{}: no run {} in the catalog; its runs: {}", catalog.path(), run_id, list)};
}

}  // namespace pacer::telemetry
