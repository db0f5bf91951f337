#include "pacer/core/progress.hpp"

#include <unistd.h>

#include <cstdio>

#include "pacer/core/table.hpp"

namespace pacer {

Progress::Progress() : enabled_(::isatty(STDERR_FILENO) == 1) {}

Progress::~Progress() { clear(); }

void Progress::update(const std::string& line) {
  if (!enabled_) return;
  std::string out = "\r" + line;
  const std::size_t w = display_width(line);
  if (w < last_width_) out.append(last_width_ - w, ' ');
  last_width_ = w;
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
}

void Progress::clear() {
  if (!enabled_ || last_width_ == 0) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(last_width_), "");
  std::fflush(stderr);
  last_width_ = 0;
}

}  // namespace pacer
