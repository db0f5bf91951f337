// The annotation store: SQLite in WAL mode with synchronous=FULL, so a label
// is on disk before its request is answered and a crash loses none.
#include <fmt/format.h>
#include <sqlite3.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>

#include "pacer/annotate.hpp"
#include "pacer/core/time.hpp"
#include "telemetry/sqlite_util.hpp"

namespace pacer::annotate {
namespace {

using telemetry::detail::sqlite_error;
using telemetry::detail::Stmt;

constexpr const char* kSchema = "pacer.annotate.store/1";

constexpr const char* kCreate = R"sql(
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples(ord INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS label_set(ord INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS guidelines(version TEXT PRIMARY KEY, path TEXT NOT NULL, xxh3 TEXT NOT NULL,
  text TEXT NOT NULL, first_seen TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS annotators(name TEXT PRIMARY KEY, token TEXT UNIQUE NOT NULL, created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS labels(sample TEXT NOT NULL, annotator TEXT NOT NULL, label TEXT NOT NULL,
  guideline_version TEXT NOT NULL, time TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY(sample, annotator));
CREATE TABLE IF NOT EXISTS skips(sample TEXT NOT NULL, annotator TEXT NOT NULL, time TEXT NOT NULL,
  seq INTEGER NOT NULL, PRIMARY KEY(sample, annotator));
)sql";

// The next action number; labels and skips share it so undo finds the last of either.
constexpr const char* kNextSeq =
    "(SELECT COALESCE(MAX(s), 0) + 1 FROM (SELECT MAX(seq) AS s FROM labels UNION ALL SELECT MAX(seq) FROM skips))";

bool valid_name(const std::string& n) {
  static const std::regex re("[A-Za-z0-9_.-]{1,64}");
  return std::regex_match(n, re);
}

// Rolls back unless committed: an error half way leaves the store as it was.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) { rc_ = sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr); }
  ~Transaction() {
    if (rc_ == SQLITE_OK && !done_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  Status begun() const {
    if (rc_ != SQLITE_OK) return sqlite_error(db_, "begin");
    return {};
  }
  Status commit() {
    if (sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) return sqlite_error(db_, "commit");
    done_ = true;
    return {};
  }

 private:
  sqlite3* db_;
  int rc_;
  bool done_ = false;
};

Status done(Stmt& s, sqlite3* db, const char* what) {
  if (!s.ok()) return sqlite_error(db, what);
  if (s.step() != SQLITE_DONE) return sqlite_error(db, what);
  return {};
}

}  // namespace

Expected<std::unique_ptr<Store>> Store::open(const std::string& path, bool create) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  if (!existed && !create) return Error{ErrorKind::kUsage, fmt::format("{}: no such annotation store", path)};
  std::unique_ptr<Store> s(new Store());
  s->path_ = path;
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX | (create ? SQLITE_OPEN_CREATE : 0);
  if (sqlite3_open_v2(path.c_str(), &s->db_, flags, nullptr) != SQLITE_OK)
    return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, s->db_ ? sqlite3_errmsg(s->db_) : "out of memory")};
  // Tokens live here: only the owner reads the file (SQLite gives the WAL the same mode).
  if (!existed) ::chmod(path.c_str(), 0600);
  sqlite3_busy_timeout(s->db_, 10000);
  if (!s->exec("PRAGMA journal_mode=WAL") || !s->exec("PRAGMA synchronous=FULL"))
    return Error{ErrorKind::kConfig, fmt::format("{}: not an annotation store (an SQLite file was expected): {}", path,
                                                 sqlite3_errmsg(s->db_))};
  {
    Stmt q(s->db_, "SELECT value FROM meta WHERE key='schema'");
    if (q.ok() && q.step() == SQLITE_ROW) {
      if (q.text(0) != kSchema)
        return Error{ErrorKind::kConfig, fmt::format("{}: store schema '{}', this pacer reads {}", path, q.text(0), kSchema)};
      return s;
    }
    if (existed && q.ok()) {
      // An SQLite file with a meta table but no schema row is someone else's.
      return Error{ErrorKind::kConfig, fmt::format("{}: an SQLite file but not an annotation store", path)};
    }
  }
  if (existed) {
    Stmt any(s->db_, "SELECT count(*) FROM sqlite_master");
    if (!any.ok() || any.step() != SQLITE_ROW)
      return Error{ErrorKind::kConfig, fmt::format("{}: not an annotation store: {}", path, sqlite3_errmsg(s->db_))};
    if (any.int64(0) > 0) return Error{ErrorKind::kConfig, fmt::format("{}: an SQLite file but not an annotation store", path)};
  }
  if (Status st = s->exec(kCreate); !st) return st.error();
  Stmt ins(s->db_, "INSERT OR IGNORE INTO meta(key, value) VALUES('schema', ?1)");
  ins.bind(1, std::string(kSchema));
  if (Status st = done(ins, s->db_, "create"); !st) return st.error();
  return s;
}

Store::~Store() { sqlite3_close(db_); }

Status Store::exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    Error e{ErrorKind::kIo, fmt::format("{}: {}", path_, err ? err : sqlite3_errmsg(db_))};
    sqlite3_free(err);
    return e;
  }
  return {};
}

Status Store::bind_source(const std::string& source) {
  std::lock_guard lk(mu_);
  std::error_code ec;
  const std::string abs = std::filesystem::weakly_canonical(source, ec).string();
  const std::string key = ec ? source : abs;
  Stmt q(db_, "SELECT value FROM meta WHERE key='source'");
  if (q.ok() && q.step() == SQLITE_ROW) {
    if (q.text(0) != key)
      return Error{ErrorKind::kUsage, fmt::format("{}: this store holds the labels of {}, not {} (give another --store)", path_,
                                                  q.text(0), key)};
    return {};
  }
  Stmt ins(db_, "INSERT INTO meta(key, value) VALUES('source', ?1)");
  ins.bind(1, key);
  return done(ins, db_, "record the source");
}

std::string Store::source() {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT value FROM meta WHERE key='source'");
  return q.ok() && q.step() == SQLITE_ROW ? q.text(0) : "";
}

Status Store::set_labels(const std::vector<Label>& labels) {
  std::lock_guard lk(mu_);
  Transaction t(db_);
  if (Status st = t.begun(); !st) return st;
  std::vector<std::string> names;
  for (const auto& l : labels) names.push_back(l.name);
  // A label the file no longer has must have no labels in the store.
  Stmt used(db_, "SELECT label, count(*) FROM labels GROUP BY label ORDER BY label");
  if (!used.ok()) return sqlite_error(db_, "read labels");
  while (used.step() == SQLITE_ROW)
    if (std::find(names.begin(), names.end(), used.text(0)) == names.end())
      return Error{ErrorKind::kUsage, fmt::format("{}: label '{}' has {} labels in the store but is not in the label file", path_,
                                                  used.text(0), used.int64(1))};
  if (Status st = exec("DELETE FROM label_set"); !st) return st;
  Stmt ins(db_, "INSERT INTO label_set(ord, name) VALUES(?1, ?2)");
  for (std::size_t i = 0; i < names.size(); ++i) {
    ins.reset();
    ins.bind(1, static_cast<std::int64_t>(i));
    ins.bind(2, names[i]);
    if (Status st = done(ins, db_, "record the labels"); !st) return st;
  }
  return t.commit();
}

Expected<std::vector<std::string>> Store::labels() {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT name FROM label_set ORDER BY ord");
  if (!q.ok()) return sqlite_error(db_, "read labels");
  std::vector<std::string> out;
  while (q.step() == SQLITE_ROW) out.push_back(q.text(0));
  return out;
}

Status Store::add_samples(const std::vector<Sample>& samples) {
  std::lock_guard lk(mu_);
  Transaction t(db_);
  if (Status st = t.begun(); !st) return st;
  Stmt ins(db_, "INSERT OR IGNORE INTO samples(ord, id, text) VALUES((SELECT COALESCE(MAX(ord), -1) + 1 FROM samples), ?1, ?2)");
  for (const auto& s : samples) {
    ins.reset();
    ins.bind(1, s.id);
    ins.bind(2, s.text);
    if (Status st = done(ins, db_, "add samples"); !st) return st;
  }
  return t.commit();
}

Status Store::add_guideline(const Guideline& g) {
  std::lock_guard lk(mu_);
  Stmt ins(db_, "INSERT OR IGNORE INTO guidelines(version, path, xxh3, text, first_seen) VALUES(?1, ?2, ?3, ?4, ?5)");
  ins.bind(1, g.version);
  ins.bind(2, g.path);
  ins.bind(3, g.xxh3);
  ins.bind(4, g.text);
  ins.bind(5, utc_iso_now(true));
  return done(ins, db_, "record the guidelines");
}

Expected<std::vector<Guideline>> Store::guidelines() {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT version, path, xxh3, text FROM guidelines ORDER BY first_seen, version");
  if (!q.ok()) return sqlite_error(db_, "read guidelines");
  std::vector<Guideline> out;
  while (q.step() == SQLITE_ROW) out.push_back({q.text(0), q.text(1), q.text(2), q.text(3)});
  return out;
}

bool Store::has_guideline(const std::string& version) {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT 1 FROM guidelines WHERE version=?1");
  q.bind(1, version);
  return q.ok() && q.step() == SQLITE_ROW;
}

Expected<std::string> Store::add_annotator(const std::string& name) {
  if (!valid_name(name))
    return Error{ErrorKind::kUsage, fmt::format("annotator '{}': names are 1 to 64 of A-Z a-z 0-9 _ . -", name)};
  unsigned char raw[16];
  std::size_t got = 0;
  while (got < sizeof raw) {
    const ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Error{ErrorKind::kIo, fmt::format("getrandom: {}", std::strerror(errno))};
    got += static_cast<std::size_t>(n);
  }
  std::string token;
  for (unsigned char b : raw) token += fmt::format("{:02x}", b);
  std::lock_guard lk(mu_);
  Stmt ins(db_, "INSERT INTO annotators(name, token, created) VALUES(?1, ?2, ?3)");
  ins.bind(1, name);
  ins.bind(2, token);
  ins.bind(3, utc_iso_now(true));
  if (!ins.ok()) return sqlite_error(db_, "add annotator");
  const int rc = ins.step();
  if (rc == SQLITE_CONSTRAINT) return Error{ErrorKind::kUsage, fmt::format("{}: annotator '{}' exists already", path_, name)};
  if (rc != SQLITE_DONE) return sqlite_error(db_, "add annotator");
  return token;
}

std::vector<std::string> Store::annotators() {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT name FROM annotators ORDER BY name");
  std::vector<std::string> out;
  while (q.ok() && q.step() == SQLITE_ROW) out.push_back(q.text(0));
  return out;
}

std::optional<std::string> Store::annotator_for(const std::string& token) {
  if (token.empty()) return std::nullopt;
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT name FROM annotators WHERE token=?1");
  q.bind(1, token);
  if (q.ok() && q.step() == SQLITE_ROW) return q.text(0);
  return std::nullopt;
}

Expected<Progress> Store::progress(const std::string& annotator) {
  std::lock_guard lk(mu_);
  Stmt q(db_,
         "SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM labels WHERE annotator=?1),"
         " (SELECT count(*) FROM skips WHERE annotator=?1)");
  q.bind(1, annotator);
  if (!q.ok() || q.step() != SQLITE_ROW) return sqlite_error(db_, "progress");
  return Progress{q.int64(0), q.int64(1), q.int64(2)};
}

Expected<Store::Next> Store::next(const std::string& annotator) {
  Next n;
  {
    std::lock_guard lk(mu_);
    Stmt fresh(db_,
               "SELECT s.id, s.text FROM samples s WHERE"
               " NOT EXISTS (SELECT 1 FROM labels l WHERE l.sample=s.id AND l.annotator=?1) AND"
               " NOT EXISTS (SELECT 1 FROM skips k WHERE k.sample=s.id AND k.annotator=?1) ORDER BY s.ord LIMIT 1");
    fresh.bind(1, annotator);
    if (!fresh.ok()) return sqlite_error(db_, "next sample");
    if (fresh.step() == SQLITE_ROW) {
      n.sample = Sample{fresh.text(0), fresh.text(1)};
    } else {
      Stmt again(db_, "SELECT s.id, s.text FROM samples s JOIN skips k ON k.sample=s.id AND k.annotator=?1 ORDER BY s.ord LIMIT 1");
      again.bind(1, annotator);
      if (!again.ok()) return sqlite_error(db_, "next sample");
      if (again.step() == SQLITE_ROW) {
        n.sample = Sample{again.text(0), again.text(1)};
        n.skipped_before = true;
      }
    }
  }
  auto p = progress(annotator);
  if (!p) return p.error();
  n.progress = *p;
  return n;
}

Expected<std::optional<Sample>> Store::sample(const std::string& id) {
  std::lock_guard lk(mu_);
  Stmt q(db_, "SELECT id, text FROM samples WHERE id=?1");
  q.bind(1, id);
  if (!q.ok()) return sqlite_error(db_, "read sample");
  if (q.step() == SQLITE_ROW) return std::optional<Sample>(Sample{q.text(0), q.text(1)});
  return std::optional<Sample>();
}

Status Store::label(const std::string& annotator, const std::string& sample, const std::string& label,
                    const std::string& guideline_version) {
  std::lock_guard lk(mu_);
  Transaction t(db_);
  if (Status st = t.begun(); !st) return st;
  Stmt check(db_,
             "SELECT (SELECT count(*) FROM samples WHERE id=?1), (SELECT count(*) FROM label_set WHERE name=?2),"
             " (SELECT count(*) FROM guidelines WHERE version=?3)");
  check.bind(1, sample);
  check.bind(2, label);
  check.bind(3, guideline_version);
  if (!check.ok() || check.step() != SQLITE_ROW) return sqlite_error(db_, "label");
  if (check.int64(0) == 0) return Error{ErrorKind::kUsage, fmt::format("no sample '{}' in {}", sample, path_)};
  if (check.int64(1) == 0) return Error{ErrorKind::kUsage, fmt::format("no label '{}' in the label set", label)};
  if (check.int64(2) == 0) return Error{ErrorKind::kUsage, fmt::format("no guideline version '{}' in {}", guideline_version, path_)};
  Stmt ins(db_, fmt::format("INSERT INTO labels(sample, annotator, label, guideline_version, time, seq)"
                            " VALUES(?1, ?2, ?3, ?4, ?5, {0}) ON CONFLICT(sample, annotator) DO UPDATE SET"
                            " label=excluded.label, guideline_version=excluded.guideline_version, time=excluded.time,"
                            " seq=excluded.seq",
                            kNextSeq)
                    .c_str());
  ins.bind(1, sample);
  ins.bind(2, annotator);
  ins.bind(3, label);
  ins.bind(4, guideline_version);
  ins.bind(5, utc_iso_now(true));
  if (Status st = done(ins, db_, "label"); !st) return st;
  Stmt unskip(db_, "DELETE FROM skips WHERE sample=?1 AND annotator=?2");
  unskip.bind(1, sample);
  unskip.bind(2, annotator);
  if (Status st = done(unskip, db_, "label"); !st) return st;
  return t.commit();
}

Status Store::skip(const std::string& annotator, const std::string& sample) {
  std::lock_guard lk(mu_);
  Transaction t(db_);
  if (Status st = t.begun(); !st) return st;
  Stmt check(db_, "SELECT count(*) FROM samples WHERE id=?1");
  check.bind(1, sample);
  if (!check.ok() || check.step() != SQLITE_ROW) return sqlite_error(db_, "skip");
  if (check.int64(0) == 0) return Error{ErrorKind::kUsage, fmt::format("no sample '{}' in {}", sample, path_)};
  Stmt ins(db_, fmt::format("INSERT INTO skips(sample, annotator, time, seq) VALUES(?1, ?2, ?3, {0})"
                            " ON CONFLICT(sample, annotator) DO UPDATE SET time=excluded.time, seq=excluded.seq",
                            kNextSeq)
                    .c_str());
  ins.bind(1, sample);
  ins.bind(2, annotator);
  ins.bind(3, utc_iso_now(true));
  if (Status st = done(ins, db_, "skip"); !st) return st;
  return t.commit();
}

Expected<std::optional<std::string>> Store::undo(const std::string& annotator) {
  std::lock_guard lk(mu_);
  Transaction t(db_);
  if (Status st = t.begun(); !st) return st.error();
  Stmt last(db_,
            "SELECT kind, sample FROM (SELECT 'label' AS kind, sample, seq FROM labels WHERE annotator=?1"
            " UNION ALL SELECT 'skip', sample, seq FROM skips WHERE annotator=?1) ORDER BY seq DESC LIMIT 1");
  last.bind(1, annotator);
  if (!last.ok()) return sqlite_error(db_, "undo");
  if (last.step() != SQLITE_ROW) return std::optional<std::string>();
  const std::string kind = last.text(0), sample = last.text(1);
  Stmt del(db_, kind == "label" ? "DELETE FROM labels WHERE sample=?1 AND annotator=?2"
                                : "DELETE FROM skips WHERE sample=?1 AND annotator=?2");
  del.bind(1, sample);
  del.bind(2, annotator);
  if (Status st = done(del, db_, "undo"); !st) return st.error();
  if (Status st = t.commit(); !st) return st.error();
  return std::optional<std::string>(sample);
}

Expected<std::vector<LabelRecord>> Store::all_labels(const std::string& guideline_version) {
  std::lock_guard lk(mu_);
  Stmt q(db_,
         "SELECT l.sample, l.label, l.annotator, l.time, l.guideline_version, s.text FROM labels l"
         " JOIN samples s ON s.id=l.sample WHERE ?1='' OR l.guideline_version=?1 ORDER BY s.ord, l.annotator");
  q.bind(1, guideline_version);
  if (!q.ok()) return sqlite_error(db_, "read labels");
  std::vector<LabelRecord> out;
  int rc;
  while ((rc = q.step()) == SQLITE_ROW) out.push_back({q.text(0), q.text(1), q.text(2), q.text(3), q.text(4), q.text(5)});
  if (rc != SQLITE_DONE) return sqlite_error(db_, "read labels");
  return out;
}

}  // namespace pacer::annotate
