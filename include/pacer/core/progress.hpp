// A one-line progress display on a terminal; silent when stderr is not a TTY.
#pragma once

#include <cstdio>
#include <string>

namespace pacer {

// Rewrites a single status line on stderr ("[3/17] memory.bandwidth  2.1 s").
// Does nothing unless stderr is a terminal, so logs and pipes stay clean.
// Not thread-safe: drive it from one thread.
class Progress {
 public:
  Progress();
  // The same on another stream (stdout, where a launcher such as mpirun
  // keeps only stdout a terminal); silent unless `out` is a terminal.
  explicit Progress(std::FILE* out);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  bool enabled() const { return enabled_; }
  void update(const std::string& line);
  void clear();

 private:
  std::FILE* out_ = stderr;
  bool enabled_ = false;
  std::size_t last_width_ = 0;
};

}  // namespace pacer
