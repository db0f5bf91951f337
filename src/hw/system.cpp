#include "pacer/hw/system.hpp"

#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
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

Expected<MemInfo> read_meminfo(const std::string& root) {
  auto text = read_text(root + "/proc/meminfo");
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

namespace {

// Splits `text` into lines without copying.
template <class Fn>
void for_each_line(std::string_view text, Fn&& fn) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    fn(text.substr(pos, end - pos));
    pos = end + 1;
  }
}

// Up to `max` unsigned numbers separated by blanks; stops at the first non-number.
int parse_numbers(std::string_view line, std::uint64_t* out, int max) {
  int n = 0;
  while (n < max) {
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (line.empty()) break;
    auto [ptr, ec] = std::from_chars(line.data(), line.data() + line.size(), out[n]);
    if (ec != std::errc()) break;
    line.remove_prefix(static_cast<std::size_t>(ptr - line.data()));
    ++n;
  }
  return n;
}

// The numbers after "cpu" or "cpuN": user nice system idle iowait irq softirq steal guest guest_nice.
bool parse_cpu_fields(std::string_view rest, CpuTimes& t) {
  std::uint64_t fields[10] = {};
  const int n = parse_numbers(rest, fields, 10);
  if (n < 4) return false;
  t = {};
  // guest and guest_nice are already counted in user and nice.
  for (int i = 0; i < std::min(n, 8); ++i) t.total += fields[i];
  const std::uint64_t idle = fields[3] + (n > 4 ? fields[4] : 0);
  t.busy = t.total - idle;
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

Expected<CpuTimes> parse_proc_stat(std::string_view text) {
  if (text.substr(0, 4) != "cpu ") return Error{ErrorKind::kRuntime, "/proc/stat: no aggregate cpu line"};
  CpuTimes t;
  if (!parse_cpu_fields(text.substr(4, text.find('\n') - 4), t))
    return Error{ErrorKind::kRuntime, "/proc/stat: short cpu line"};
  return t;
}

std::vector<CoreTimes> parse_proc_stat_cores(std::string_view text) {
  std::vector<CoreTimes> cores;
  for_each_line(text, [&](std::string_view line) {
    if (line.size() < 4 || line.substr(0, 3) != "cpu" || line[3] < '0' || line[3] > '9') return;
    int cpu = 0;
    auto [ptr, ec] = std::from_chars(line.data() + 3, line.data() + line.size(), cpu);
    if (ec != std::errc()) return;
    CoreTimes c;
    c.cpu = cpu;
    if (parse_cpu_fields(line.substr(static_cast<std::size_t>(ptr - line.data())), c.times)) cores.push_back(c);
  });
  return cores;
}

Expected<CpuStat> read_cpu_stat(const std::string& root) {
  auto text = read_text(root + "/proc/stat");
  if (!text) return text.error();
  auto total = parse_proc_stat(*text);
  if (!total) return Error{ErrorKind::kRuntime, root + total.error().message};
  return CpuStat{*total, parse_proc_stat_cores(*text)};
}

Expected<PidStat> parse_pid_stat(std::string_view text) {
  const std::size_t open = text.find('(');
  const std::size_t close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open)
    return Error{ErrorKind::kRuntime, "stat: no (comm) field"};
  PidStat s;
  std::from_chars(text.data(), text.data() + open, s.pid);
  s.comm = std::string(text.substr(open + 1, close - open - 1));
  std::string_view rest = text.substr(close + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  if (rest.empty()) return Error{ErrorKind::kRuntime, "stat: truncated after comm"};
  s.state = rest.front();
  rest.remove_prefix(1);
  // Fields 4.. (ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
  // cmajflt utime stime cutime cstime priority nice num_threads itrealvalue
  // starttime vsize rss): 21 numbers after the state. Some may be negative
  // (tty_nr, priority), so they are parsed as signed.
  std::int64_t f[21] = {};
  int n = 0;
  while (n < 21) {
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    if (rest.empty()) break;
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), f[n]);
    if (ec != std::errc()) break;
    rest.remove_prefix(static_cast<std::size_t>(ptr - rest.data()));
    ++n;
  }
  if (n < 21) return Error{ErrorKind::kRuntime, fmt::format("stat: {} numeric fields after the state, expected 21", n)};
  s.ppid = static_cast<int>(f[0]);
  s.utime = static_cast<std::uint64_t>(f[10]);
  s.stime = static_cast<std::uint64_t>(f[11]);
  s.rss_pages = f[20] > 0 ? static_cast<std::uint64_t>(f[20]) : 0;
  s.starttime = f[18] > 0 ? static_cast<std::uint64_t>(f[18]) : 0;
  return s;
}

Expected<PidIo> parse_pid_io(std::string_view text) {
  PidIo io;
  int found = 0;
  for_each_line(text, [&](std::string_view line) {
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) return;
    const std::string_view key = line.substr(0, colon);
    std::uint64_t v = 0;
    if (parse_numbers(line.substr(colon + 1), &v, 1) != 1) return;
    if (key == "rchar") io.rchar = v, ++found;
    else if (key == "wchar") io.wchar = v, ++found;
    else if (key == "read_bytes") io.read_bytes = v, ++found;
    else if (key == "write_bytes") io.write_bytes = v, ++found;
  });
  if (found == 0) return Error{ErrorKind::kRuntime, "io: no rchar/wchar/read_bytes/write_bytes"};
  return io;
}

long clock_ticks_per_second() {
  static const long ticks = ::sysconf(_SC_CLK_TCK);
  return ticks > 0 ? ticks : 100;
}

long page_size_bytes() {
  static const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? page : 4096;
}

Expected<std::vector<int>> process_tree_pids(int pid, const std::string& root) {
  const std::string proc = root + "/proc";
  // One pass over /proc builds the parent map; the tree is then walked from
  // `pid`. Processes that exit between the listing and the read are skipped.
  std::vector<std::pair<int, int>> parent_of;  // (pid, ppid)
  bool found_root = false;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(proc, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    auto text = read_text(entry.path().string() + "/stat");
    if (!text) continue;
    auto st = parse_pid_stat(*text);
    if (!st) continue;
    // A zombie root has exited; only its parent has not collected it yet.
    if (st->pid == pid) found_root = st->state != 'Z';
    parent_of.emplace_back(st->pid, st->ppid);
  }
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: cannot list: {}", proc, ec.message())};
  if (!found_root) return Error{ErrorKind::kIo, fmt::format("process {}: not found under {} (or exited)", pid, proc)};
  std::vector<int> tree{pid};
  // Breadth-first over children; `tree` grows while it is walked.
  for (std::size_t i = 0; i < tree.size(); ++i)
    for (const auto& [p, pp] : parent_of)
      if (pp == tree[i] && p != tree[i]) tree.push_back(p);
  return tree;
}

ProcessTreeStat read_processes(int root_pid, const std::vector<int>& pids, const std::string& root) {
  ProcessTreeStat out;
  out.root_pid = root_pid;
  const double tick = static_cast<double>(clock_ticks_per_second());
  for (const int pid : pids) {
    auto text = read_text(fmt::format("{}/proc/{}/stat", root, pid));
    if (!text) continue;  // exited since the tree was listed
    auto s = parse_pid_stat(*text);
    if (!s || s->state == 'Z') continue;  // a zombie's times already went to its parent's cutime
    ++out.processes;
    out.cpu_seconds += static_cast<double>(s->utime + s->stime) / tick;
    out.rss_bytes += s->rss_pages * static_cast<std::uint64_t>(page_size_bytes());
    auto io_text = read_text(fmt::format("{}/proc/{}/io", root, pid));
    auto io = io_text ? parse_pid_io(*io_text) : Expected<PidIo>(io_text.error());
    if (!io) {
      out.io_readable = false;
      continue;
    }
    out.io.rchar += io->rchar;
    out.io.wchar += io->wchar;
    out.io.read_bytes += io->read_bytes;
    out.io.write_bytes += io->write_bytes;
  }
  return out;
}

Expected<ProcessTreeStat> read_process_tree(int pid, const std::string& root) {
  auto pids = process_tree_pids(pid, root);
  if (!pids) return pids.error();
  return read_processes(pid, *pids, root);
}

std::vector<NetDevCounters> parse_net_dev(std::string_view text) {
  // "  eth0: rx_bytes rx_packets errs drop fifo frame compressed multicast tx_bytes tx_packets ..."
  std::vector<NetDevCounters> out;
  for_each_line(text, [&](std::string_view line) {
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) return;
    std::uint64_t f[10] = {};
    if (parse_numbers(line.substr(colon + 1), f, 10) < 10) return;
    NetDevCounters c;
    c.name = std::string(trim(line.substr(0, colon)));
    c.rx_bytes = f[0];
    c.rx_packets = f[1];
    c.tx_bytes = f[8];
    c.tx_packets = f[9];
    out.push_back(std::move(c));
  });
  return out;
}

namespace {
// Reads root + `file` and hands the text to `parse`.
template <class Parse>
auto read_parsed(const std::string& root, const char* file, Parse parse) -> Expected<decltype(parse(""))> {
  auto text = read_text(root + file);
  if (!text) return text.error();
  return parse(*text);
}
}  // namespace

Expected<std::vector<NetDevCounters>> read_net_dev(const std::string& root) {
  return read_parsed(root, "/proc/net/dev", parse_net_dev);
}

namespace {

struct IbPortDir {
  std::string device;
  int port = 0;
  std::filesystem::path path;
};

// DEV/ports/N directories under ROOT/sys/class/infiniband, sorted by path.
std::vector<IbPortDir> ib_port_dirs(const std::string& root) {
  std::vector<IbPortDir> out;
  std::error_code ec;
  for (const auto& dev : ib_device_dirs(root)) {
    std::vector<std::filesystem::path> ports;
    for (const auto& p : std::filesystem::directory_iterator(dev / "ports", ec)) ports.push_back(p.path());
    std::sort(ports.begin(), ports.end());
    for (const auto& port : ports) {
      IbPortDir d{dev.filename().string(), 0, port};
      const std::string port_name = port.filename().string();
      std::from_chars(port_name.data(), port_name.data() + port_name.size(), d.port);
      out.push_back(std::move(d));
    }
  }
  return out;
}

std::optional<std::uint64_t> read_counter(const std::filesystem::path& path) {
  auto t = read_text(path.string());
  if (!t) return std::nullopt;
  std::uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(t->data(), t->data() + t->size(), v);
  if (ec != std::errc() || ptr == t->data()) return std::nullopt;
  return v;
}

}  // namespace

std::vector<std::filesystem::path> ib_device_dirs(const std::string& root) {
  std::vector<std::filesystem::path> devices;
  std::error_code ec;
  for (const auto& d : std::filesystem::directory_iterator(root + "/sys/class/infiniband", ec)) devices.push_back(d.path());
  std::sort(devices.begin(), devices.end());
  return devices;
}

std::vector<IbCounters> read_ib_counters(const std::string& root) {
  std::vector<IbCounters> out;
  for (const auto& d : ib_port_dirs(root)) {
    const auto& port = d.path;
    {
      IbCounters c;
      c.device = d.device;
      c.port = d.port;
      const auto counter = [&](const char* name) -> std::uint64_t { return read_counter(port / "counters" / name).value_or(0); };
      c.rx_bytes = counter("port_rcv_data") * 4;
      c.tx_bytes = counter("port_xmit_data") * 4;
      c.rx_packets = counter("port_rcv_packets");
      c.tx_packets = counter("port_xmit_packets");
      c.symbol_errors = counter("symbol_error");
      c.link_downed = counter("link_downed");
      c.rcv_errors = counter("port_rcv_errors");
      out.push_back(std::move(c));
    }
  }
  return out;
}

std::string strip_sysfs_code(std::string_view text) {
  const auto colon = text.find(':');
  if (colon != std::string_view::npos && colon > 0 &&
      text.substr(0, colon).find_first_not_of("0123456789") == std::string_view::npos)
    text.remove_prefix(colon + 1);
  return std::string(trim(text));
}

std::optional<double> parse_ib_rate(std::string_view text) {
  text = trim(text);
  double v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr == text.data() || !(v >= 0)) return std::nullopt;
  return v;
}

std::vector<IbPort> read_ib_ports(const std::string& root) {
  std::vector<IbPort> out;
  for (const auto& d : ib_port_dirs(root)) {
    IbPort p;
    p.device = d.device;
    p.port = d.port;
    const auto text = [&](const char* name) {
      auto t = read_text((d.path / name).string());
      return t ? *t : std::string();
    };
    p.state = strip_sysfs_code(text("state"));
    p.phys_state = strip_sysfs_code(text("phys_state"));
    p.rate = std::string(trim(text("rate")));
    p.rate_gbits = parse_ib_rate(p.rate);
    p.link_layer = std::string(trim(text("link_layer")));
    p.symbol_errors = read_counter(d.path / "counters" / "symbol_error");
    p.link_downed = read_counter(d.path / "counters" / "link_downed");
    p.rcv_errors = read_counter(d.path / "counters" / "port_rcv_errors");
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<DiskCounters> parse_diskstats(std::string_view text) {
  // "major minor name reads merged sectors_read ms_reading writes merged sectors_written ms_writing in_flight io_ms ..."
  std::vector<DiskCounters> out;
  for_each_line(text, [&](std::string_view line) {
    std::uint64_t mm[2] = {};
    line = trim(line);
    // major and minor, then the name, then the counters.
    std::size_t p = 0;
    for (int k = 0; k < 2; ++k) {
      while (p < line.size() && line[p] == ' ') ++p;
      auto [ptr, ec] = std::from_chars(line.data() + p, line.data() + line.size(), mm[k]);
      if (ec != std::errc()) return;
      p = static_cast<std::size_t>(ptr - line.data());
    }
    while (p < line.size() && line[p] == ' ') ++p;
    const std::size_t name_end = line.find(' ', p);
    if (name_end == std::string_view::npos) return;
    std::uint64_t f[10] = {};
    if (parse_numbers(line.substr(name_end), f, 10) < 10) return;
    DiskCounters d;
    d.name = std::string(line.substr(p, name_end - p));
    d.reads = f[0];
    d.read_bytes = f[2] * 512;
    d.writes = f[4];
    d.write_bytes = f[6] * 512;
    d.io_ms = f[9];
    out.push_back(std::move(d));
  });
  return out;
}

Expected<std::vector<DiskCounters>> read_diskstats(const std::string& root) {
  return read_parsed(root, "/proc/diskstats", parse_diskstats);
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
