// Internal to telemetry: a prepared statement that finalises itself, and error text that names the file.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <optional>
#include <string>

#include "pacer/core/error.hpp"

namespace pacer::telemetry::detail {

class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  bool ok() const { return rc_ == SQLITE_OK; }
  int prepare_rc() const { return rc_; }
  sqlite3_stmt* get() { return s_; }
  void reset() {
    sqlite3_reset(s_);
    sqlite3_clear_bindings(s_);
  }
  void bind(int i, std::int64_t v) { sqlite3_bind_int64(s_, i, v); }
  void bind(int i, double v) { sqlite3_bind_double(s_, i, v); }
  void bind(int i, const std::string& v) { sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT); }
  void bind_null(int i) { sqlite3_bind_null(s_, i); }
  void bind(int i, const std::optional<double>& v) { v ? bind(i, *v) : bind_null(i); }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int step() { return sqlite3_step(s_); }
  std::int64_t int64(int col) { return sqlite3_column_int64(s_, col); }
  double real(int col) { return sqlite3_column_double(s_, col); }
  std::string text(int col) {
    const unsigned char* p = sqlite3_column_text(s_, col);
    return p ? reinterpret_cast<const char*>(p) : "";
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* s_ = nullptr;
  int rc_ = SQLITE_OK;
};

// "FILE: what: sqlite's message".
inline Error sqlite_error(sqlite3* db, const std::string& where, ErrorKind kind = ErrorKind::kIo) {
  const char* file = db ? sqlite3_db_filename(db, "main") : nullptr;
  return Error{kind, std::string(file && *file ? file : "catalog") + ": " + where + ": " + (db ? sqlite3_errmsg(db) : "out of memory")};
}

}  // namespace pacer::telemetry::detail
