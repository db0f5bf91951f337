#include "pacer/core/progress.hpp"

#include <unistd.h>

#include <cstdio>

#include "pacer/core/table.hpp"

namespace pacer {

Progress::Progress() : Progress(stderr) {}

Progress::Progress(std::FILE* out) : out_(out), enabled_(::isatty(::fileno(out)) == 1) {}

Progress::~Progress() { clear(); }

void Progress::update(const std::string& line) {
  if (!enabled_) return;
  std::string out = "\r" + line;
  const std::size_t w = display_width(line);
  if (w < last_width_) out.append(last_width_ - w, ' ');
  last_width_ = w;
  std::fputs(out.c_str(), out_);
  std::fflush(out_);
}

void Progress::clear() {
  if (!enabled_ || last_width_ == 0) return;
  std::fprintf(out_, "\r%*s\r", static_cast<int>(last_width_), "");
  std::fflush(out_);
  last_width_ = 0;
}

}  // namespace pacer
