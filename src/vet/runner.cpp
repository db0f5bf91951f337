#include <fcntl.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/vet/vet.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/process.hpp"
#include "pacer/core/time.hpp"
#include "outliers.hpp"
#include "probes.hpp"

namespace pacer::vet {

using nlohmann::json;
namespace fs = std::filesystem;

Expected<Injection> parse_injection(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    return Error{ErrorKind::kUsage, fmt::format("--inject '{}': expected [NODE:]CHECK=hang, CHECK=crash or CHECK=VALUE", text)};
  Injection inj;
  inj.check = text.substr(0, eq);
  // Check names have no ':', so the last one before '=' ends the node name.
  if (const auto colon = inj.check.rfind(':'); colon != std::string::npos) {
    inj.node = inj.check.substr(0, colon);
    inj.check = inj.check.substr(colon + 1);
    if (inj.node.empty()) return Error{ErrorKind::kUsage, fmt::format("--inject '{}': empty node name before ':'", text)};
  }
  const std::string action = text.substr(eq + 1);
  const CheckSpec* spec = find_check(inj.check);
  if (!spec && !is_cluster_check(inj.check))
    return Error{ErrorKind::kUsage, fmt::format("--inject '{}': unknown check '{}' (pacer vet --list)", text, inj.check)};
  if (action == "hang") inj.action = Injection::Action::kHang;
  else if (action == "crash") inj.action = Injection::Action::kCrash;
  else if (spec && spec->kind == ValueKind::kText) {
    if (action.empty()) return Error{ErrorKind::kUsage, fmt::format("--inject '{}': empty value", text)};
    inj.text = action;
  } else {
    char* end = nullptr;
    inj.value = std::strtod(action.c_str(), &end);
    if (action.empty() || end != action.c_str() + action.size())
      return Error{ErrorKind::kUsage, fmt::format("--inject '{}': '{}' is not hang, crash or a number", text, action)};
    inj.action = Injection::Action::kValue;
  }
  return inj;
}

std::string scratch_prefix(const std::string& probe, long pid, const std::string& host) {
  return fmt::format("{}{}-{}@{}", kScratchPrefix, probe, pid, host);
}

std::vector<std::string> remove_stale_scratch(const std::string& dir, const std::string& host) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(kScratchPrefix)) continue;
    // <prefix><probe>-<pid>@<host>.XXXXXX: probe names hold no '@', and
    // mkdtemp's suffix no '.'.
    const auto at = name.find('@');
    const auto dash = name.rfind('-', at);
    const auto dot = name.rfind('.');
    if (at == std::string::npos || dash == std::string::npos || dot == std::string::npos || dot < at) continue;
    if (name.substr(at + 1, dot - at - 1) != host) continue;  // another node's run: it may be alive there
    const std::string digits = name.substr(dash + 1, at - dash - 1);
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::stol(digits);
    // Alive, or a reused pid: kept. EPERM means a process of another user lives.
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    std::error_code rm;
    fs::remove_all(it->path(), rm);
    if (!rm) removed.push_back(it->path().string());
  }
  return removed;
}

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void on_interrupt(int) { g_interrupted = 1; }
void on_probe_term(int) { g_probe_cancelled = 1; }

// Restores the caller's handlers when vet returns.
class SignalGuard {
 public:
  SignalGuard() {
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
    g_interrupted = 0;
  }
  ~SignalGuard() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

std::string expand_path(const std::string& p) {
  if (p == "$TMPDIR" || p.starts_with("$TMPDIR/")) {
    const char* t = std::getenv("TMPDIR");
    return std::string(t && *t ? t : "/tmp") + p.substr(7);
  }
  if (p == "~" || p.starts_with("~/")) {
    const char* h = std::getenv("HOME");
    return std::string(h ? h : "") + p.substr(1);
  }
  return p;
}

// A check is selected by its name or its category; --only narrows, --skip removes.
Expected<std::set<std::string>> select_checks(const VetOptions& o, const Profile& profile) {
  std::set<std::string> categories;
  for (const auto& p : all_probes())
    for (const auto& c : p.checks) categories.insert(c.category);
  auto validate = [&](const std::vector<std::string>& names, const char* flag) -> Status {
    for (const auto& n : names) {
      if (!find_check(n) && !categories.count(n))
        return Error{ErrorKind::kUsage, fmt::format("{} '{}': no such check or category (pacer vet --list)", flag, n)};
    }
    return {};
  };
  if (Status s = validate(o.only, "--only"); !s) return s.error();
  if (Status s = validate(o.skip, "--skip"); !s) return s.error();
  auto matches = [](const std::vector<std::string>& names, const CheckSpec& c) {
    for (const auto& n : names)
      if (n == c.name || n == c.category) return true;
    return false;
  };
  std::set<std::string> selected;
  for (const auto& p : all_probes()) {
    for (const auto& c : p.checks) {
      const auto cfg = profile.checks.find(c.name);
      const bool enabled = cfg == profile.checks.end() || cfg->second.enabled;
      if (!o.only.empty() && !matches(o.only, c)) continue;
      // Naming a disabled check in --only runs it anyway: the user asked.
      if (o.only.empty() && !enabled) continue;
      if (matches(o.skip, c)) continue;
      selected.insert(c.name);
    }
  }
  return selected;
}

// Defaults for the mode, then the profile's values for the same section.
json resolve_params(const ProbeSpec& p, const Profile& profile, bool quick) {
  json out = json::object();
  for (const auto& spec : p.params) out[spec.key] = quick ? spec.quick : spec.normal;
  const std::string section = p.section.empty() ? p.checks.front().name : p.section;
  if (profile.params.contains(section)) {
    const json& s = profile.params[section];
    for (const char* layer : {"normal", "quick"}) {
      if (std::string(layer) == "quick" && !quick) continue;
      if (!s.contains(layer)) continue;
      for (auto it = s[layer].begin(); it != s[layer].end(); ++it)
        if (out.contains(it.key())) out[it.key()] = *it;
    }
  }
  // Sizes and durations in the code defaults are written as text too.
  for (const auto& spec : p.params) {
    json& v = out[spec.key];
    if (!v.is_string()) continue;
    if (spec.type == ParamType::kDuration) v = parse_duration(v.get<std::string>()).value();
    if (spec.type == ParamType::kSize) v = parse_size(v.get<std::string>()).value();
  }
  return out;
}

double probe_timeout(const ProbeSpec& p, const Profile& profile, const VetOptions& o) {
  if (o.timeout_s) return *o.timeout_s;
  double t = o.quick ? p.quick_timeout_s : p.timeout_s;
  bool from_profile = false;
  double best = 0;
  for (const auto& c : p.checks) {
    const auto it = profile.checks.find(c.name);
    if (it == profile.checks.end()) continue;
    const auto& v = o.quick ? (it->second.quick_timeout_s ? it->second.quick_timeout_s : it->second.timeout_s) : it->second.timeout_s;
    if (v) {
      best = std::max(best, *v);
      from_profile = true;
    }
  }
  return from_profile ? best : t;
}

struct ChildOutcome {
  std::vector<Measurement> measurements;
  std::string error;  // set when the probe produced nothing usable
  bool interrupted = false;
  double duration_s = 0;
};

// The parent reads what arrives: a failed write shows there as a short answer.
void write_all(int fd, const std::string& out) { (void)write_full(fd, out.data(), out.size(), "the pipe to the parent"); }

void stop_child(pid_t pid) {
  ::kill(-pid, SIGTERM);
  for (int i = 0; i < 20; ++i) {  // up to 2 s to clean up, then no more chances
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return;
    ::usleep(100'000);
  }
  ::kill(-pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

}  // namespace

namespace {
int g_fork_fd = -1;  // the pipe to the parent, in a run_forked child
constexpr int kThrewStatus = 70;
}  // namespace

void fork_emit(const std::string& data) {
  if (g_fork_fd >= 0) write_all(g_fork_fd, data);
}

ForkOutcome run_forked(const std::function<std::string()>& body, double timeout_s,
                       const std::function<void(const std::string&)>& on_data) {
  ForkOutcome out;
  const pid_t parent = ::getpid();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    out.error = fmt::format("cannot create pipe: {}", std::strerror(errno));
    return out;
  }
  std::fflush(nullptr);
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) {
    out.error = fmt::format("cannot fork: {}", std::strerror(errno));
    ::close(fds[0]);
    ::close(fds[1]);
    return out;
  }
  if (pid == 0) {
    ::close(fds[0]);
    ::setpgid(0, 0);  // its own group, so the runner can stop it and anything it started
    struct sigaction sa {};
    sa.sa_handler = on_probe_term;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::signal(SIGINT, SIG_IGN);  // the runner decides what an interrupt means
    // A child blocked in a GPU call must not outlive a parent that was killed.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    g_fork_fd = fds[1];
    try {
      write_all(fds[1], body());
    } catch (const std::exception& e) {
      // Unwinding further would run the parent's code in this copy of it.
      write_all(fds[1], e.what());
      ::_exit(kThrewStatus);
    } catch (...) {
      ::_exit(kThrewStatus);
    }
    ::_exit(0);
  }
  ::setpgid(pid, pid);  // also here, so kill(-pid) works even before the child ran
  ::close(fds[1]);
  bool timed_out = false;
  char buf[65536];
  for (;;) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (g_interrupted) {
      out.interrupted = true;
      break;
    }
    if (elapsed >= timeout_s) {
      timed_out = true;
      break;
    }
    pollfd pfd{fds[0], POLLIN, 0};
    const int wait_ms = static_cast<int>(std::min(100.0, (timeout_s - elapsed) * 1000.0)) + 1;
    const int rc = ::poll(&pfd, 1, wait_ms);
    if (rc < 0 && errno == EINTR) continue;
    if (rc > 0) {
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n > 0) {
        out.data.append(buf, static_cast<std::size_t>(n));
        if (on_data) on_data(out.data);
        continue;
      }
      if (n == 0) break;  // child closed its end: done or dead
      if (errno != EINTR) break;
    }
  }
  ::close(fds[0]);
  int wstatus = 0;
  if (timed_out || out.interrupted) {
    if (timed_out) {
      ::kill(-pid, SIGKILL);  // a hung child gets no grace period
      ::waitpid(pid, &wstatus, 0);
    } else {
      stop_child(pid);
    }
  } else {
    (void)wait_process(pid, &wstatus);
  }
  out.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (timed_out) out.error = fmt::format("timed out after {}", format_duration(timeout_s));
  else if (out.interrupted) out.error = "interrupted";
  else if (WIFSIGNALED(wstatus)) out.error = fmt::format("crashed: {}", strsignal(WTERMSIG(wstatus)));
  else if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == kThrewStatus) out.error = "threw: " + out.data;
  return out;
}

namespace {

ChildOutcome run_in_child(const ProbeSpec& p, const ProbeContext& ctx, double timeout_s,
                          const std::vector<Injection>& injections) {
  const ForkOutcome f = run_forked(
      [&]() -> std::string {
        for (const auto& inj : injections) {
          if (!ctx.wants(inj.check)) continue;
          if (inj.action == Injection::Action::kHang)
            for (;;) ::pause();
          if (inj.action == Injection::Action::kCrash) std::abort();
        }
        try {
          json j = json::array();
          for (const auto& m : p.run(ctx)) j.push_back(m);
          return j.dump();
        } catch (const std::exception& e) {
          return json{{"error", e.what()}}.dump();
        }
      },
      timeout_s);
  ChildOutcome out;
  out.interrupted = f.interrupted;
  out.duration_s = f.duration_s;
  if (!f.error.empty()) {
    out.error = f.error.starts_with("crashed") ? "probe " + f.error : f.error;
    return out;
  }
  json j = json::parse(f.data, nullptr, false);
  if (j.is_discarded()) {
    out.error = "probe returned no readable result";
  } else if (j.is_object() && j.contains("error")) {
    out.error = j["error"].get<std::string>();
  } else {
    for (const auto& m : j) out.measurements.push_back(m.get<Measurement>());
  }
  return out;
}

// The runner owns scratch directories, so they go away even when a probe is
// killed mid-write. A runner that is itself killed (SIGKILL, OOM, a node
// reboot) cannot, so the names carry its pid and host, and a later run on the
// same host removes the scratch of runs that are gone.
std::vector<StorageTarget> make_scratch(const std::vector<std::string>& paths, const std::string& probe) {
  std::vector<StorageTarget> out;
  const std::string host = hw::hostname();
  for (const auto& p : paths) {
    StorageTarget t;
    t.path = p;
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      t.error = "path does not exist";
    } else if (!fs::is_directory(p, ec)) {
      t.error = "not a directory";
    } else {
      remove_stale_scratch(p, host);
      std::string tmpl = (fs::path(p) / (scratch_prefix(probe, ::getpid(), host) + ".XXXXXX")).string();
      if (::mkdtemp(tmpl.data())) t.scratch = tmpl;
      else t.error = fmt::format("not writable: {}", std::strerror(errno));
    }
    out.push_back(std::move(t));
  }
  return out;
}

void remove_scratch(const std::vector<StorageTarget>& targets) {
  for (const auto& t : targets) {
    if (t.scratch.empty()) continue;
    std::error_code ec;
    fs::remove_all(t.scratch, ec);
  }
}

std::vector<std::string> resolve_storage_paths(const VetOptions& o, const Profile& profile) {
  std::vector<std::string> raw = o.storage_paths.empty() ? profile.storage_paths : o.storage_paths;
  if (raw.empty()) raw = {".", "$TMPDIR"};
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& r : raw) {
    const std::string p = expand_path(r);
    std::error_code ec;
    // One filesystem location is tested once, however it was spelled.
    const fs::path canon = fs::weakly_canonical(fs::absolute(p, ec), ec);
    const std::string key = ec ? p : canon.string();
    if (seen.insert(key).second) out.push_back(ec ? p : canon.string());
  }
  return out;
}

// What run_vet needs resolved before the first probe; every option error is found here.
struct Resolved {
  Profile profile;
  std::map<std::string, double> baseline;
  std::set<std::string> selected;
};

Expected<Resolved> resolve(const VetOptions& o) {
  Resolved r;
  auto profile = load_profile(o.profile);
  if (!profile) return profile.error();
  r.profile = std::move(*profile);
  if (o.baseline_path) {
    auto b = load_baseline(*o.baseline_path);
    if (!b) return b.error();
    r.baseline = std::move(*b);
  }
  auto selected = select_checks(o, r.profile);
  if (!selected) return selected.error();
  if (selected->empty()) return Error{ErrorKind::kUsage, "no checks selected (see --only, --skip and the profile's enabled flags)"};
  for (const auto& inj : o.injections)
    if (is_cluster_check(inj.check))
      return Error{ErrorKind::kUsage, fmt::format("--inject: '{}' is measured only with --cluster", inj.check)};
    else if (!selected->count(inj.check))
      return Error{ErrorKind::kUsage, fmt::format("--inject: check '{}' is not selected", inj.check)};
  r.selected = std::move(*selected);
  return r;
}

}  // namespace

Status check_options(const VetOptions& o) {
  auto r = resolve(o);
  if (!r) return r.error();
  return {};
}

Expected<VetReport> run_vet(const VetOptions& o) {
  auto resolved = resolve(o);
  if (!resolved) return resolved.error();
  // Pointers, so that the rest reads as it did when these were Expected<>s.
  const Profile* profile = &resolved->profile;
  const std::map<std::string, double>& baseline = resolved->baseline;
  const std::set<std::string>* selected = &resolved->selected;

  VetReport report;
  report.host = o.node_name.empty() ? hw::hostname() : o.node_name;
  report.started_at = utc_iso_now();
  report.mode = o.quick ? "quick" : "full";
  report.profile = *profile;
  report.baseline_path = o.baseline_path;
  for (const auto& inj : o.injections)
    if (inj.applies_to(report.host)) report.injections.push_back(inj);
  // Applied in order, so one aimed at this node wins over one for every node.
  std::stable_partition(report.injections.begin(), report.injections.end(), [](const Injection& i) { return i.node.empty(); });
  const std::vector<Injection>& injections = report.injections;
  const auto t0 = std::chrono::steady_clock::now();
  timespec started{};
  ::clock_gettime(CLOCK_MONOTONIC, &started);
  // Leaves a moment after the last probe for the verdict and the report.
  constexpr double kBoundReserve = 0.25;
  const std::vector<std::string> storage_paths = resolve_storage_paths(o, *profile);

  std::vector<const ProbeSpec*> todo;
  for (const auto& p : all_probes())
    for (const auto& c : p.checks)
      if (selected->count(c.name)) {
        todo.push_back(&p);
        break;
      }

  SignalGuard guard;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    const ProbeSpec& p = *todo[i];
    ProbeContext ctx;
    ctx.quick = o.quick;
    ctx.params = resolve_params(p, *profile, o.quick);
    ctx.expect_gpus = o.expect_gpus;
    ctx.vet_started_s = static_cast<double>(started.tv_sec) + static_cast<double>(started.tv_nsec) / 1e9;
    for (const auto& c : p.checks)
      if (selected->count(c.name)) ctx.wanted.insert(c.name);
    if (p.uses_storage) ctx.storage = make_scratch(storage_paths, p.name);
    if (o.on_probe) o.on_probe(p.name, i, todo.size(), false);

    double timeout = probe_timeout(p, *profile, o);
    std::string not_run = g_interrupted ? "interrupted" : "";
    if (o.bound_s) {
      const double left = *o.bound_s - kBoundReserve - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (left < timeout) timeout = left;
      if (timeout <= 0 && not_run.empty()) not_run = fmt::format("not run: the {} bound was reached", format_duration(*o.bound_s));
    }
    ChildOutcome outcome = !not_run.empty() ? ChildOutcome{{}, not_run, g_interrupted != 0, 0}
                                            : run_in_child(p, ctx, timeout, injections);
    remove_scratch(ctx.storage);
    if (o.on_probe) o.on_probe(p.name, i, todo.size(), true);

    for (const auto& c : p.checks) {
      if (!ctx.wants(c.name)) continue;
      std::vector<Measurement> ms;
      for (const auto& m : outcome.measurements)
        if (m.check == c.name) ms.push_back(m);
      if (ms.empty()) {
        ms.push_back(not_measured(c.name, CheckStatus::kError, outcome.error.empty() ? "probe returned no result" : outcome.error));
      }
      for (auto& m : ms) {
        for (const auto& inj : injections)
          if (inj.check == m.check && inj.action == Injection::Action::kValue) {
            if (inj.text.empty()) m.value = inj.value;
            else m.text = inj.text;
            m.status.reset();
            m.detail = fmt::format("injected value {}", inj.text.empty() ? format_number(inj.value) : inj.text);
          }
        const auto b = baseline.find(m.check + "|" + m.target);
        CheckResult r = judge(m, *profile, b == baseline.end() ? std::nullopt : std::optional<double>(b->second));
        r.duration_s = outcome.duration_s;
        report.checks.push_back(std::move(r));
      }
    }
    if (outcome.interrupted) {
      report.interrupted = true;
      break;
    }
  }
  judge_gpu_outliers(report.checks, profile->cluster);
  report.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Versions are also gathered in one place, for drift checks across nodes.
  for (const auto& c : report.checks)
    if (c.category == "software" && c.name.starts_with("software."))
      report.versions[c.name.substr(9)] = c.status == CheckStatus::kSkip ? "" : c.text;
  return report;
}

}  // namespace pacer::vet
