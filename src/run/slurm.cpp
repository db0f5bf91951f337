// What the supervisor learns from Slurm: the job's end time, signal names, and running scontrol.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "pacer/core/posix_io.hpp"
#include "pacer/core/process.hpp"
#include "pacer/run.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

struct SignalName {
  const char* name;
  int sig;
};
constexpr SignalName kSignals[] = {{"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"TERM", SIGTERM},
                                   {"INT", SIGINT},   {"HUP", SIGHUP},   {"QUIT", SIGQUIT}};

}  // namespace

Expected<int> parse_signal(const std::string& text) {
  std::string t = text;
  for (auto& c : t) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (t.rfind("SIG", 0) == 0) t = t.substr(3);
  for (const auto& s : kSignals) {
    if (t == s.name || t == std::to_string(s.sig)) return s.sig;
  }
  return Error{ErrorKind::kUsage, fmt::format("signal '{}': expected one of USR1, USR2, TERM, INT, HUP, QUIT", text)};
}

std::string signal_name(int sig) {
  for (const auto& s : kSignals)
    if (s.sig == sig) return std::string("SIG") + s.name;
  const char* d = strsignal(sig);
  return d ? fmt::format("signal {} ({})", sig, d) : fmt::format("signal {}", sig);
}

std::optional<double> parse_scontrol_end_time(const std::string& text) {
  const auto at = text.find("EndTime=");
  if (at == std::string::npos) return std::nullopt;
  std::tm tm{};
  const char* p = text.c_str() + at + 8;
  const char* end = strptime(p, "%Y-%m-%dT%H:%M:%S", &tm);
  if (!end) return std::nullopt;  // "Unknown" or "None" for jobs without a limit
  tm.tm_isdst = -1;               // scontrol prints local time
  const std::time_t t = std::mktime(&tm);
  if (t == static_cast<std::time_t>(-1)) return std::nullopt;
  return static_cast<double>(t);
}

Walltime learn_walltime(const std::string& scontrol) {
  Walltime w;
  if (const char* e = std::getenv("SLURM_JOB_END_TIME"); e && *e) {
    char* end = nullptr;
    const double t = std::strtod(e, &end);
    if (end && *end == '\0' && t > 0) {
      w.end_time = t;
      w.source = WalltimeSource::kEnv;
      w.note = "SLURM_JOB_END_TIME";
      return w;
    }
    w.note = fmt::format("SLURM_JOB_END_TIME='{}' is not Unix seconds; ", e);
  }
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !*job) {
    w.note += "no Slurm job (SLURM_JOB_ID unset)";
    return w;
  }
  auto c = capture({scontrol, "show", "job", job}, 10, nullptr);
  if (!c) {
    w.note += fmt::format("{}; relying on the signal", c.error().message);
    return w;
  }
  if (c->status != 0) {
    std::string first = c->output.substr(0, c->output.find('\n'));
    w.note += fmt::format("'{} show job {}' failed (exit {}): {}; relying on the signal", scontrol, job, c->status, first);
    return w;
  }
  if (auto t = parse_scontrol_end_time(c->output)) {
    w.end_time = *t;
    w.source = WalltimeSource::kScontrol;
    w.note = fmt::format("'{} show job {}' EndTime", scontrol, job);
    return w;
  }
  w.note += fmt::format("'{} show job {}' gave no EndTime (no time limit?); relying on the signal", scontrol, job);
  return w;
}

}  // namespace pacer::run
