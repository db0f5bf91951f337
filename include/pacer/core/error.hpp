// Error values and the Expected<T> result type used across libpacer.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace pacer {

// Process exit codes, shared by every subcommand and documented in the README.
enum class ExitCode : int {
  kOk = 0,          // every check passed (warnings allowed)
  kCheckFailed = 1, // a check failed or could not finish
  kUsage = 2,       // bad command line, profile, baseline or config
  kRuntime = 3,     // pacer itself failed
  kInterrupted = 130,
};

// What went wrong, for mapping to exit codes at the edges (CLI, bindings).
enum class ErrorKind {
  kUsage,    // the caller asked for something that does not exist
  kConfig,   // a file we were given is malformed
  kIo,       // the environment refused (file, device, permission)
  kRuntime,  // anything else
};

// An error whose message already names where: file:line, key, host or path.
struct Error {
  ErrorKind kind = ErrorKind::kRuntime;
  std::string message;
};

ExitCode exit_code_for(ErrorKind kind);

// Thrown only at the edges (CLI, bindings) to carry an Error up to main.
class Exception : public std::exception {
 public:
  explicit Exception(Error e) : error_(std::move(e)) {}
  const char* what() const noexcept override { return error_.message.c_str(); }
  const Error& error() const { return error_; }

 private:
  Error error_;
};

// A value or an Error. A small stand-in for std::expected, which GCC 12 only
// offers in C++23 mode.
template <class T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Expected(Error error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)

  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }
  T& value() & { return get_or_throw(); }
  const T& value() const& { return const_cast<Expected*>(this)->get_or_throw(); }
  T&& value() && { return std::move(get_or_throw()); }
  T& operator*() { return std::get<0>(v_); }
  const T& operator*() const { return std::get<0>(v_); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  const Error& error() const { return std::get<1>(v_); }

 private:
  T& get_or_throw() {
    if (!has_value()) throw Exception(std::get<1>(v_));
    return std::get<0>(v_);
  }
  std::variant<T, Error> v_;
};

// Success or an Error, for operations without a value.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }

 private:
  Error error_;
  bool ok_ = true;
};

// Unwraps or throws; for the edges only.
template <class T>
T unwrap(Expected<T> e) {
  if (!e) throw Exception(e.error());
  return std::move(*e);
}
inline void unwrap(const Status& s) {
  if (!s) throw Exception(s.error());
}

}  // namespace pacer
