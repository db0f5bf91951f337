#include "pacer/hw/system.hpp"

#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pacer::hw {

Expected<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error{ErrorKind::kIo, fmt::format("{}: cannot open: {}", path, std::strerror(errno ? errno : ENOENT))};
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  return s;
}

Expected<MemInfo> parse_meminfo(std::string_view text) {
  MemInfo m;
  bool have_total = false;
  bool have_available = false;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view key = line.substr(0, colon);
    std::string_view rest = line.substr(colon + 1);
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    std::uint64_t kib = 0;
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), kib);
    if (ec != std::errc()) continue;
    const std::uint64_t bytes = kib * 1024;
    if (key == "MemTotal") { m.total = bytes; have_total = true; }
    else if (key == "MemAvailable") { m.available = bytes; have_available = true; }
    else if (key == "SwapTotal") m.swap_total = bytes;
    else if (key == "SwapFree") m.swap_free = bytes;
  }
  if (!have_total || !have_available)
    return Error{ErrorKind::kRuntime, "/proc/meminfo: MemTotal or MemAvailable missing"};
  return m;
}

Expected<MemInfo> read_meminfo() {
  auto text = read_text("/proc/meminfo");
  if (!text) return text.error();
  return parse_meminfo(*text);
}

Expected<std::string> parse_bracketed_choice(std::string_view text) {
  const std::size_t open = text.find('[');
  const std::size_t close = text.find(']', open == std::string_view::npos ? 0 : open);
  if (open == std::string_view::npos || close == std::string_view::npos)
    return Error{ErrorKind::kRuntime, fmt::format("no [selected] value in '{}'", text)};
  return std::string(text.substr(open + 1, close - open - 1));
}

Expected<ThpSettings> read_thp() {
  ThpSettings t;
  const std::string base = "/sys/kernel/mm/transparent_hugepage/";
  auto en = read_text(base + "enabled");
  if (!en) return en.error();
  auto df = read_text(base + "defrag");
  if (!df) return df.error();
  auto e = parse_bracketed_choice(*en);
  if (!e) return Error{ErrorKind::kRuntime, base + "enabled: " + e.error().message};
  auto d = parse_bracketed_choice(*df);
  if (!d) return Error{ErrorKind::kRuntime, base + "defrag: " + d.error().message};
  t.enabled = *e;
  t.defrag = *d;
  return t;
}

Expected<std::string> read_clocksource() {
  return read_text("/sys/devices/system/clocksource/clocksource0/current_clocksource");
}

Expected<CpuTimes> parse_proc_stat(std::string_view text) {
  // First line: "cpu  user nice system idle iowait irq softirq steal guest guest_nice".
  if (text.substr(0, 4) != "cpu ") return Error{ErrorKind::kRuntime, "/proc/stat: no aggregate cpu line"};
  std::string_view line = text.substr(0, text.find('\n'));
  line.remove_prefix(4);
  std::uint64_t fields[10] = {};
  int n = 0;
  while (n < 10) {
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    if (line.empty()) break;
    auto [ptr, ec] = std::from_chars(line.data(), line.data() + line.size(), fields[n]);
    if (ec != std::errc()) break;
    line.remove_prefix(static_cast<std::size_t>(ptr - line.data()));
    ++n;
  }
  if (n < 4) return Error{ErrorKind::kRuntime, "/proc/stat: short cpu line"};
  CpuTimes t;
  // guest and guest_nice are already counted in user and nice.
  for (int i = 0; i < std::min(n, 8); ++i) t.total += fields[i];
  const std::uint64_t idle = fields[3] + (n > 4 ? fields[4] : 0);
  t.busy = t.total - idle;
  return t;
}

Expected<CpuTimes> read_cpu_times() {
  auto text = read_text("/proc/stat");
  if (!text) return text.error();
  return parse_proc_stat(*text);
}

double process_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
    for (int c = 0; c < n; ++c) cpus.push_back(c);
  }
  return cpus;
}

Status pin_current_thread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof(set), &set);
  if (rc != 0) return Error{ErrorKind::kIo, fmt::format("cannot pin thread to cpu {}: {}", cpu, std::strerror(rc))};
  return {};
}

std::string kernel_release() {
  utsname u{};
  if (::uname(&u) != 0) return "unknown";
  return u.release;
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

}  // namespace pacer::hw
