// `pacer run --nodes N`: the leader of a job on several nodes: launch agents, watch every rank, recover on good nodes.
#include <poll.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/process.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/run/ports.hpp"
#include "run/hang_naming.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

using nlohmann::json;

constexpr double kHelloTimeoutS = 10;   // a connection that says nothing is dropped after this
constexpr double kDumpTimeoutS = 5;     // stacks + NVML from every node after a hang
constexpr double kStopSlackS = 10;      // past --stop-timeout before a silent agent counts as lost
constexpr double kLauncherGraceS = 5;   // SIGTERM to SIGKILL for the launcher (srun)
// An agent reports at least every second; one silent this long is lost (a
// node that vanished without closing its connection: power, network).
constexpr double kAgentSilentS = 10;

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::string w;
  for (char ch : text + ' ') {
    if (ch == ' ' || ch == '\t' || ch == '\n') {
      if (!w.empty()) out.push_back(std::move(w));
      w.clear();
    } else {
      w += ch;
    }
  }
  return out;
}

std::string joined(const std::vector<std::string>& v, const char* sep = ",") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// {nodes} and {count} in every word of the prefix.
std::vector<std::string> expand(const std::vector<std::string>& prefix, const std::vector<std::string>& nodes) {
  std::vector<std::string> out;
  for (std::string w : prefix) {
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"{nodes}", joined(nodes)},
                                     std::pair<std::string, std::string>{"{count}", std::to_string(nodes.size())}})
      for (std::size_t at; (at = w.find(key)) != std::string::npos;) w.replace(at, key.size(), value);
    out.push_back(std::move(w));
  }
  return out;
}

std::string random_token() {
  unsigned char b[16] = {};
  if (auto fd = open_fd("/dev/urandom", O_RDONLY | O_CLOEXEC)) (void)read_full(fd->get(), b, sizeof b, "/dev/urandom");
  std::string s;
  for (unsigned char x : b) s += fmt::format("{:02x}", x);
  return s;
}

// A rank as the leader last heard of it from its node's agent.
struct RankView {
  int rank = 0, local_rank = 0, pid = 0;
  std::uint64_t heartbeats = 0;
  json step;
  double idle_s = 0;  // on the agent's monotonic clock, when it reported
  double at = 0;      // the leader's monotonic time of that report
  double idle(double now) const { return idle_s + (now - at); }
};

// The agent on one node in one attempt.
struct Member {
  std::string node;
  int node_rank = 0;
  std::optional<Conn> conn;
  bool hello = false, exited = false, lost = false;
  int exit_code = 0;
  std::string exit_message, lost_why;
  std::vector<RankView> ranks;
  std::optional<double> timeout;  // the agent's derived hang timeout (auto)
  std::optional<json> dump;
  double last_heard = 0;  // leader's monotonic time of its last message
  bool done() const { return exited || lost; }
};

// What ended an attempt early: the node(s) it implicates.
struct Failure {
  std::string kind;  // "crashed", "hung", "lost"
  std::string node;
  int exit_code = 3;
  std::string why;
};

// A parsed progress report, or why it is malformed.
Expected<std::vector<RankView>> parse_ranks(const json& m, double now) {
  const auto it = m.find("ranks");
  if (it == m.end() || !it->is_array()) return Error{ErrorKind::kConfig, "progress without a 'ranks' array"};
  std::vector<RankView> out;
  for (const auto& r : *it) {
    auto int_field = [&](const char* k, long lo, long hi) -> std::optional<int> {
      const auto f = r.find(k);
      if (f == r.end() || !f->is_number_integer()) return std::nullopt;
      const auto v = f->get<long long>();
      if (v < lo || v > hi) return std::nullopt;
      return static_cast<int>(v);
    };
    if (!r.is_object()) return Error{ErrorKind::kConfig, "a rank that is not an object"};
    const auto rank = int_field("rank", 0, 1 << 30), local = int_field("local_rank", 0, kHeartbeatSlots - 1),
               pid = int_field("pid", 1, 1 << 30);
    const auto idle = r.find("idle_s");
    if (!rank || !local || !pid || idle == r.end() || !idle->is_number() || !(idle->get<double>() >= 0) ||
        !std::isfinite(idle->get<double>()))
      return Error{ErrorKind::kConfig, fmt::format("a rank with a missing or bad rank, local_rank, pid or idle_s: {}",
                                                   r.dump().substr(0, 200))};
    RankView v;
    v.rank = *rank;
    v.local_rank = *local;
    v.pid = *pid;
    v.heartbeats = r.value("heartbeats", std::uint64_t{0});
    v.step = r.value("step", json());
    v.idle_s = idle->get<double>();
    v.at = now;
    out.push_back(v);
  }
  return out;
}

class Leader {
 public:
  Leader(const Options& o, Log& log, MaskGuard& mask, std::vector<std::string> allocation, Listener listener,
         std::string host)
      : o_(o), c_(*o.cluster), log_(log), mask_(mask), allocation_(std::move(allocation)),
        listener_(std::move(listener)), host_(std::move(host)) {
    if (const char* j = std::getenv("SLURM_JOB_ID"); j && *j) job_ = j;
    set_ = watched_signals();
    mask_.extend(set_);
  }

  Outcome run() {
    const int min_nodes = c_.min_nodes > 0 ? c_.min_nodes : c_.nodes;
    log_("cluster",
         fmt::format("leader at {}:{}; allocation {} node(s) ({}); {} per attempt, at least {}; launcher: {}",
                     host_, listener_.port(), allocation_.size(), joined(allocation_), c_.nodes, min_nodes,
                     joined(launcher(), " ")),
         {{"allocation", allocation_}, {"nodes", c_.nodes}, {"min_nodes", min_nodes}, {"port", listener_.port()}});
    wt_ = find_walltime(o_, log_);
    best_ = latest_committed_step(o_.ckpt_dir);
    log_checkpoints(o_, log_, best_);
    state_path_ = no_progress_path(o_);
    no_progress_ = load_no_progress(state_path_, best_, log_);
    if (c_.vet_args) vet(allocation_, "before the first attempt");
    std::size_t size = 0;
    for (int attempt = 0;; ++attempt) {
      std::vector<std::string> good;
      for (const auto& n : allocation_)
        if (!excluded_.count(n)) good.push_back(n);
      if (good.size() < static_cast<std::size_t>(min_nodes))
        return give_up(kExitTooFewNodes,
                       fmt::format("{} good node(s) left ({}), --min-nodes {}; excluded: {}", good.size(),
                                   good.empty() ? "none" : joined(good), min_nodes, excluded_text()));
      if (good.size() > static_cast<std::size_t>(c_.nodes)) good.resize(static_cast<std::size_t>(c_.nodes));
      if (size && good.size() != size)
        log_("shrink", fmt::format("{} node(s) instead of {}: only {} good one(s) left (--min-nodes {}); excluded: {}",
                                   good.size(), size, good.size(), min_nodes, excluded_text()),
             {{"nodes", good}, {"from", size}, {"to", good.size()}});
      size = good.size();
      if (auto done = attempt_on(attempt, good)) return *done;
    }
  }

 private:
  std::vector<std::string> launcher() const {
    return c_.launcher.empty() ? words(kDefaultLauncher) : c_.launcher;
  }

  std::string excluded_text() const {
    std::string s;
    for (const auto& [n, why] : excluded_) s += (s.empty() ? "" : "; ") + n + " (" + why + ")";
    return s.empty() ? "none" : s;
  }

  Outcome give_up(int code, const std::string& why) {
    forget_no_progress(state_path_);
    out_.exit_code = code;
    out_.reason = "giving up: " + why;
    log_("give-up", out_.reason, {{"exit_code", code}});
    return out_;
  }

  int master_port(int attempt) const {
    PortScope scope;
    scope.job = job_.empty() ? 0 : std::strtoull(job_.c_str(), nullptr, 10);
    auto r = port_range(PortPlan{}, scope);
    if (!r) return 29500 + attempt % 100;
    return r->first + attempt % (r->second - r->first + 1);
  }

  // `pacer vet --quick` on every node of `nodes` at once; failing or
  // unreachable ones are excluded for the rest of the job.
  void vet(const std::vector<std::string>& nodes, const std::string& when) {
    struct Run {
      std::string node;
      pid_t pid = 0;
      std::string out;
      int status = -1;
      bool timed_out = false;
      std::string error;
    };
    auto dir = make_request_dir();
    if (!dir) {
      log_("vet", fmt::format("re-vet impossible ({}); nodes kept", dir.error().message));
      return;
    }
    std::vector<Run> runs;
    const auto prefix = c_.vet_launcher.empty() ? words(kDefaultVetLauncher) : c_.vet_launcher;
    for (const auto& n : nodes) {
      Run r;
      r.node = n;
      r.out = fmt::format("{}/vet-{}.json", *dir, runs.size());
      auto argv = expand(prefix, {n});
      for (const std::string& w : {c_.pacer, std::string("vet"), std::string("--quick"), std::string("--json"),
                                   std::string("--node-name"), n})
        argv.push_back(w);
      argv.insert(argv.end(), c_.vet_args->begin(), c_.vet_args->end());
      auto fd = open_fd(r.out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      SpawnOptions so;
      so.signal_mask = &mask_.old();
      so.new_process_group = true;
      so.env = {{kNodeNameEnv, n}, {kRunNodesEnv, n}};
      if (fd) so.stdout_fd = fd->get();
      auto pid = spawn_process(argv, so);
      if (!pid) r.error = pid.error().message;
      else r.pid = *pid;
      runs.push_back(std::move(r));
    }
    log_("vet", fmt::format("pacer vet --quick on {} ({})", joined(nodes), when), {{"nodes", nodes}});
    const double deadline = mono_now() + c_.vet_timeout_s;
    for (;;) {
      bool waiting = false;
      for (auto& r : runs) {
        if (r.pid <= 0 || r.status >= 0) continue;
        int st = 0;
        if (wait_process(r.pid, &st, WNOHANG) == r.pid) r.status = exit_code_of(st);
        else waiting = true;
      }
      if (!waiting) break;
      if (mono_now() >= deadline) {
        for (auto& r : runs)
          if (r.pid > 0 && r.status < 0) {
            ::kill(-r.pid, SIGKILL);
            int st = 0;
            wait_process(r.pid, &st);
            r.timed_out = true;
            r.status = exit_code_of(st);
          }
        break;
      }
      ::usleep(50000);
    }
    for (auto& r : runs) {
      std::vector<std::string> failed;
      std::string verdict = "error";
      if (auto text = read_file(r.out)) {
        const json j = json::parse(*text, nullptr, false);
        if (j.is_object() && j.contains("checks") && j["checks"].is_array()) {
          for (const auto& ch : j["checks"])
            if (ch.is_object() && (ch.value("status", "") == "fail" || ch.value("status", "") == "error"))
              failed.push_back(ch.value("name", "?"));
          verdict = r.status == 0 ? "pass" : "fail";
        }
      }
      const std::string why = !r.error.empty() ? r.error
                              : r.timed_out     ? fmt::format("no verdict within {} s", c_.vet_timeout_s)
                              : verdict == "error"
                                  ? fmt::format("unreachable: the vet launch exited with status {} and no report", r.status)
                                  : failed.empty() ? fmt::format("exit {}", r.status)
                                                   : "failed: " + joined(failed, " ");
      log_("vet", fmt::format("{}: {}", r.node, verdict == "pass" ? "passed" : why),
           {{"node", r.node}, {"verdict", verdict}, {"failed", failed}, {"exit_code", r.status}});
      if (verdict != "pass") {
        excluded_[r.node] = "vet " + why;
        log_("exclude", fmt::format("{} excluded for the rest of the job: vet {}", r.node, why),
             {{"node", r.node}, {"reason", "vet " + why}});
      }
    }
    std::error_code ec;
    std::filesystem::remove_all(*dir, ec);
  }

  // One attempt on `nodes`; an Outcome ends the job.
  std::optional<Outcome> attempt_on(int attempt, const std::vector<std::string>& nodes) {
    attempt_ = attempt;
    members_.clear();
    pending_.clear();
    failure_.reset();
    stopping_ = false;
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      Member m;
      m.node = nodes[i];
      m.node_rank = static_cast<int>(i);
      members_.push_back(std::move(m));
    }
    token_ = random_token();
    auto argv = expand(launcher(), nodes);
    for (const std::string& w : {c_.pacer, std::string("run-agent"), std::string("--leader"),
                                 fmt::format("{}:{}", host_, listener_.port()), std::string("--attempt"),
                                 std::to_string(attempt)})
      argv.push_back(w);
    argv.insert(argv.end(), c_.agent_args.begin(), c_.agent_args.end());
    argv.push_back("--");
    argv.insert(argv.end(), o_.argv.begin(), o_.argv.end());
    SpawnOptions so;
    so.env = {{kRunNodesEnv, joined(nodes)}, {kRunTokenEnv, token_}};
    so.signal_mask = &mask_.old();
    so.new_process_group = true;
    int exec_errno = 0;
    auto pid = spawn_process(argv, so, &exec_errno);
    ++out_.attempts;
    if (!pid) {
      out_.exit_code = exec_errno == ENOENT ? kExitNotFound : static_cast<int>(ExitCode::kRuntime);
      out_.reason = fmt::format("launcher {}: {}", argv[0], exec_errno ? std::strerror(exec_errno) : pid.error().message);
      log_("not-started", out_.reason, {{"exit_code", out_.exit_code}});
      return out_;
    }
    launcher_pid_ = *pid;
    launcher_status_.reset();
    started_at_ = mono_now();
    log_("started", fmt::format("attempt {} on {} node(s) ({}), resuming from {}", attempt, nodes.size(), joined(nodes),
                                step_text(best_)),
         {{"attempt", attempt}, {"nodes", nodes}, {"pid", launcher_pid_}});
    watch();
    reap_launcher();
    return decide();
  }

  Member* member(const std::string& node) {
    for (auto& m : members_)
      if (m.node == node) return &m;
    return nullptr;
  }

  void mark_lost(Member& m, const std::string& why) {
    if (m.done()) return;
    m.lost = true;
    m.lost_why = why;
    if (m.conn) m.conn->close();
    log_("node-lost", fmt::format("{} (node rank {}): {}", m.node, m.node_rank, why),
         {{"host", m.node}, {"node_rank", m.node_rank}, {"attempt", attempt_}});
    if (!stopping_) fail({"lost", m.node, static_cast<int>(ExitCode::kRuntime), fmt::format("{} lost: {}", m.node, why)});
  }

  void fail(const Failure& f) {
    if (!failure_) failure_ = f;
    stop_all(f.why);
  }

  void stop_all(const std::string& why) {
    if (stopping_) return;
    stopping_ = true;
    stop_deadline_ = mono_now() + o_.stop_timeout_s + kStopSlackS;
    log_("stop", fmt::format("{}; stopping the attempt on every node (SIGTERM, SIGKILL after {} s)", why,
                             o_.stop_timeout_s));
    for (auto& m : members_)
      if (m.conn && !m.done()) (void)m.conn->send({{"type", "stop"}, {"reason", why}});
  }

  // A new connection's first line: an agent of this attempt, or refused.
  void greet(Conn& conn, const json& hello) {
    auto refuse = [&](const std::string& why) {
      log_("agent-refused", fmt::format("connection from {} refused: {}", conn.peer(), why), {{"peer", conn.peer()}});
      (void)conn.send({{"type", "error"}, {"message", why}}, 1);
      conn.close();
    };
    if (hello.value("type", "") != "hello" || hello.value("schema", "") != kAgentSchema)
      return refuse(fmt::format("not a {} hello", kAgentSchema));
    if (hello.value("token", "") != token_) return refuse("wrong token (not an agent of this pacer run)");
    if (!hello.contains("attempt") || !hello["attempt"].is_number_integer() || hello["attempt"].get<int>() != attempt_)
      return refuse(fmt::format("attempt {} is not the current one ({})", hello.value("attempt", json()).dump(), attempt_));
    const std::string node = hello.value("node", "");
    Member* m = member(node);
    if (!m) return refuse(fmt::format("node '{}' is not one of this attempt's ({})", node, joined(nodes_of())));
    if (m->hello) return refuse(fmt::format("node '{}' has an agent already", node));
    if (stopping_) return refuse("the attempt is stopping");
    const json start = {{"type", "start"},
                        {"node_rank", m->node_rank},
                        {"nnodes", members_.size()},
                        {"master_addr", members_.front().node},
                        {"master_port", master_port(attempt_)},
                        {"hang_timeout_s", o_.hang_timeout_s ? json(*o_.hang_timeout_s) : json(nullptr)},
                        {"stop_timeout_s", o_.stop_timeout_s},
                        {"poll_s", poll_s()},
                        {"ckpt_dir", o_.ckpt_dir},
                        {"request_signal", o_.request_signal ? signal_name(*o_.request_signal).substr(3) : ""}};
    if (auto s = conn.send(start); !s) return refuse(s.error().message);
    m->hello = true;
    m->last_heard = mono_now();
    m->conn.emplace(std::move(conn));
    log_("agent", fmt::format("{} (node rank {}) connected from {}", node, m->node_rank, m->conn->peer()),
         {{"host", node}, {"node_rank", m->node_rank}, {"attempt", attempt_}, {"agent_pid", hello.value("pid", 0)}});
    // A checkpoint request made before this agent connected (the job was
    // inside the --before window at the start, or Slurm's warning came early).
    if (asked_) send_request(*m);
  }

  std::vector<std::string> nodes_of() const {
    std::vector<std::string> v;
    for (const auto& m : members_) v.push_back(m.node);
    return v;
  }

  double poll_s() const {
    const auto t = hang_timeout();
    return t ? std::clamp(*t / 20, 0.05, 1.0) : 0.5;
  }

  std::optional<double> hang_timeout() const {
    if (o_.hang_timeout_s) return *o_.hang_timeout_s > 0 ? o_.hang_timeout_s : std::nullopt;
    std::optional<double> t;
    for (const auto& m : members_)
      if (m.timeout) t = std::max(t.value_or(0), *m.timeout);
    return t;
  }

  void handle(Member& m, const json& msg) {
    const std::string type = msg.value("type", "");
    const double now = mono_now();
    if (type == "progress") {
      auto ranks = parse_ranks(msg, now);
      if (!ranks) {
        log_("agent-error", fmt::format("{}: bad progress report: {}", m.node, ranks.error().message), {{"host", m.node}});
        return mark_lost(m, "its agent sent a bad message");
      }
      m.ranks = std::move(*ranks);
      const auto t = msg.find("timeout_s");
      m.timeout = t != msg.end() && t->is_number() ? std::optional<double>(t->get<double>()) : std::nullopt;
      check_conflicts(m);
    } else if (type == "dump") {
      m.dump = msg;
    } else if (type == "exit") {
      m.exited = true;
      m.exit_code = msg.value("exit_code", 3);
      m.exit_message = msg.value("message", "");
      log_("node-exited", fmt::format("{} (node rank {}): {} (exit {})", m.node, m.node_rank, m.exit_message, m.exit_code),
           {{"host", m.node}, {"node_rank", m.node_rank}, {"exit_code", m.exit_code}, {"attempt", attempt_}});
      if (m.exit_code != 0 && !stopping_)
        fail({"crashed", m.node, m.exit_code, fmt::format("{} on {}", m.exit_message, m.node)});
    } else if (type == "invalid") {
      log_("heartbeat-invalid", fmt::format("{}: {}", m.node, msg.value("message", "")), {{"host", m.node}});
    } else if (type != "started") {
      log_("agent-error", fmt::format("{}: unknown message type '{}' ignored", m.node, type.substr(0, 40)),
           {{"host", m.node}});
    }
  }

  // One global rank on two nodes: the launcher gave ranks wrongly; said once.
  void check_conflicts(const Member& m) {
    for (const auto& r : m.ranks)
      for (const auto& other : members_)
        if (&other != &m)
          for (const auto& x : other.ranks)
            if (x.rank == r.rank && conflicts_.insert(r.rank).second)
              log_("heartbeat-invalid",
                   fmt::format("rank {} heartbeats on {} and on {}: ranks must be global (RANK = node rank x ranks "
                               "per node + local rank)", r.rank, other.node, m.node),
                   {{"rank", r.rank}, {"hosts", {other.node, m.node}}});
  }

  // One round: new connections, messages, the launcher, signals; waits up to wait_s.
  void pump(double wait_s) {
    std::vector<pollfd> fds{{listener_.fd(), POLLIN, 0}};
    for (const auto& p : pending_) fds.push_back({p.first.fd(), POLLIN, 0});
    for (const auto& m : members_)
      if (m.conn && !m.done()) fds.push_back({m.conn->fd(), POLLIN, 0});
    retry_eintr([&] { return ::poll(fds.data(), fds.size(), static_cast<int>(std::max(0.0, wait_s) * 1000)); });
    const double now = mono_now();
    while (auto c = listener_.accept()) pending_.emplace_back(std::move(*c), now + kHelloTimeoutS);
    for (auto it = pending_.begin(); it != pending_.end();) {
      auto got = it->first.receive_one(0);
      if (!got || (got && *got)) {
        if (got) greet(it->first, **got);
        else log_("agent-refused", fmt::format("connection from {}: {}", it->first.peer(), got.error().message));
        it = pending_.erase(it);
      } else if (it->first.eof() || now >= it->second) {
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& m : members_) {
      if (!m.conn || m.done()) continue;
      auto got = m.conn->receive();
      if (!got) {
        log_("agent-error", fmt::format("{}: {}", m.node, got.error().message), {{"host", m.node}});
        mark_lost(m, "its agent sent a bad message");
        continue;
      }
      if (!got->empty()) m.last_heard = now;
      for (const auto& msg : *got)
        if (!m.done()) handle(m, msg);
      if (m.conn && m.conn->eof() && !m.done())
        mark_lost(m, "its agent's connection closed without an exit report (agent killed, node down or unreachable)");
    }
    if (!launcher_status_) {
      int st = 0;
      if (wait_process(launcher_pid_, &st, WNOHANG) == launcher_pid_) launcher_status_ = exit_code_of(st);
    }
    timespec zero{};
    for (int sig; (sig = sigtimedwait(&set_, nullptr, &zero)) > 0;) on_signal(sig);
  }

  void on_signal(int sig) {
    if (sig == SIGCHLD) return;
    if (sig == o_.slurm_signal) {
      if (!asked_) request(fmt::format("{} received (Slurm's warning before the time limit)", signal_name(sig)));
      return;
    }
    if (sig == SIGUSR1 || sig == SIGUSR2) return;
    stop_signal_ = sig;
    stop_all(fmt::format("{} received", signal_name(sig)));
  }

  void request(const std::string& why) {
    asked_ = true;
    baseline_ = latest_committed_step(o_.ckpt_dir);
    grace_deadline_ = mono_now() + o_.grace_s;
    log_("checkpoint-request",
         fmt::format("{}: asking every node to checkpoint; waiting up to {} s for a step newer than {}", why, o_.grace_s,
                     step_text(baseline_)),
         {{"committed_step", baseline_ ? json(*baseline_) : json(nullptr)}});
    request_why_ = why;
    request_deadline_ = wall_now() + o_.grace_s;
    for (auto& m : members_)
      if (m.conn && !m.done()) send_request(m);
  }

  void send_request(Member& m) {
    (void)m.conn->send({{"type", "request"}, {"reason", request_why_}, {"deadline", request_deadline_},
                        {"committed_step", baseline_ ? json(*baseline_) : json(nullptr)}});
  }

  // The hang decision over every node's ranks: a hang when the rank idle
  // longest is idle for the timeout. The one that stopped first is the one
  // idle longest; but idle times are known only to an agent's poll period,
  // and ranks waiting in a collective for a hung one stop a moment after it,
  // one step further. So among the ranks within two poll periods of the
  // longest idle, the one with the lowest last step is picked; on_hang then
  // names one with the stacks as well (hang_naming.cpp).
  void check_hang() {
    const auto t = hang_timeout();
    if (!t || stopping_) return;
    const double now = mono_now();
    double longest = -1;
    bool all = true;
    // A node whose CMD ended has no ranks left to wait for.
    for (const auto& m : members_)
      for (const auto& r : m.ranks) {
        if (m.done()) break;
        longest = std::max(longest, r.idle(now));
        all = all && r.idle(now) >= *t;
      }
    if (longest < *t) return;
    const double near = longest - 2 * poll_s();
    const Member* fm = nullptr;
    const RankView* first = nullptr;
    auto step_of = [](const RankView& r) { return r.step.is_number_unsigned() ? r.step.get<std::uint64_t>() : 0; };
    for (const auto& m : members_)
      for (const auto& r : m.ranks) {
        if (m.done()) break;
        if (r.idle(now) < near) continue;
        if (!first || step_of(r) < step_of(*first) || (step_of(r) == step_of(*first) && r.idle(now) > first->idle(now))) {
          first = &r;
          fm = &m;
        }
      }
    on_hang(*fm, *first, *t, all);
  }

  void on_hang(const Member& fm, const RankView& first, double t, bool all_stalled) {
    RankView f = first;
    std::string host = fm.node;
    int node_rank = fm.node_rank;
    double idle = f.idle(mono_now());
    for (auto& m : members_)
      if (m.conn && !m.done()) {
        m.dump.reset();
        (void)m.conn->send({{"type", "dump"}});
      }
    const double until = mono_now() + kDumpTimeoutS;
    auto missing = [&] {
      return std::any_of(members_.begin(), members_.end(), [](const Member& m) { return !m.done() && !m.dump; });
    };
    while (missing() && mono_now() < until) pump(0.05);
    json ranks = json::array(), stacks = json::array(), gpu = json::object();
    int captured = 0;
    for (auto& m : members_) {
      const json d = m.dump ? *m.dump : json::object();
      for (auto r : d.value("ranks", json::array())) {
        r["host"] = m.node;
        ranks.push_back(r);
      }
      for (auto s : d.value("stacks", json::array())) {
        s["host"] = m.node;
        captured += s.value("text", json()).is_string();
        stacks.push_back(s);
      }
      gpu[m.node] = m.dump ? d.value("gpu", json()) : json{{"note", "no dump from this node within 5 s"}};
    }
    // The stacks decide between ranks that stopped together (hang_naming.cpp).
    std::vector<Suspect> suspects;
    std::vector<std::pair<const Member*, const RankView*>> who;
    const double now = mono_now();
    for (const auto& m : members_)
      for (const auto& r : m.ranks) {
        if (m.done()) break;
        suspects.push_back({r.rank, m.node, r.step.is_number_unsigned() ? std::optional(r.step.get<std::uint64_t>()) : std::nullopt,
                            r.idle(now), std::nullopt});
        who.emplace_back(&m, &r);
      }
    attach_stacks(suspects, stacks);
    json named_json = nullptr;
    std::string reason;
    if (!who.empty()) {
      const Naming named = name_hung_rank(suspects, naming_window(t, poll_s()));
      f = *who[named.index].second;
      host = who[named.index].first->node;
      node_rank = who[named.index].first->node_rank;
      idle = f.idle(now);
      named_json = naming_json(suspects, named);
      reason = "; named: " + named.reason;
    }
    const std::string source = o_.hang_timeout_s ? "--hang-timeout" : "derived from the heartbeat intervals";
    const std::string msg = fmt::format(
        "rank {} on {} (node rank {}, local rank {}, pid {}) made no progress for {:.1f} s ({} {:.1f} s; {}), last "
        "step {}; {} rank(s) on {} node(s) watched, stacks of {} captured{}",
        f.rank, host, node_rank, f.local_rank, f.pid, idle, source, t,
        all_stalled ? "no rank progressed" : "the other ranks did", f.step.is_null() ? "none" : f.step.dump(),
        ranks.size(), members_.size(), captured, reason);
    log_("hang", msg,
         {{"attempt", attempt_}, {"rank", f.rank}, {"host", host}, {"node_rank", node_rank}, {"local_rank", f.local_rank},
          {"pid", f.pid}, {"step", f.step}, {"idle_s", idle}, {"hang_timeout_s", t},
          {"timeout_source", o_.hang_timeout_s ? "option" : "derived"}, {"all_stalled", all_stalled},
          {"named", named_json}, {"ranks", ranks}, {"stacks", stacks}, {"gpu", gpu}});
    fail({"hung", host, static_cast<int>(ExitCode::kRuntime), fmt::format("hang of rank {} on {}", f.rank, host)});
  }

  void watch() {
    for (;;) {
      pump(0.1);
      const double now = mono_now();
      if (std::all_of(members_.begin(), members_.end(), [](const Member& m) { return m.done(); })) return;
      if (!stopping_) {
        // Agents that never came: the launch failed on their node.
        for (auto& m : members_)
          if (!m.hello && (launcher_status_ || now - started_at_ >= c_.connect_timeout_s))
            mark_lost(m, launcher_status_ ? fmt::format("the launcher exited (status {}) before its agent connected",
                                                        *launcher_status_)
                                          : fmt::format("its agent did not connect within {} s", c_.connect_timeout_s));
        for (auto& m : members_)
          if (m.hello && !m.done() && now - m.last_heard >= kAgentSilentS)
            mark_lost(m, fmt::format("no message from its agent for {:.0f} s (node down or unreachable)", kAgentSilentS));
        check_hang();
        if (wt_.end_time && o_.before_s > 0 && !asked_ &&
            wall_now() >= *wt_.end_time - o_.before_s)
          request(fmt::format("job ends in {} s (--before {} s)", static_cast<long long>(*wt_.end_time - wall_now()),
                              o_.before_s));
        if (asked_) {
          const auto cur = latest_committed_step(o_.ckpt_dir);
          if (newer(cur, baseline_)) {
            log_("committed", fmt::format("step {} committed in {}", *cur, o_.ckpt_dir), {{"committed_step", *cur}});
            walltime_stop_ = true;
            stop_all(fmt::format("checkpoint at step {} is committed", *cur));
          } else if (now >= grace_deadline_) {
            walltime_stop_ = true;
            stop_all(fmt::format("no new committed step within the grace period of {} s", o_.grace_s));
          }
        }
      } else if (std::all_of(members_.begin(), members_.end(), [](const Member& m) { return m.done() || !m.hello; })) {
        return;  // agents that never connected have nothing to stop: their hello is refused
      } else if (now >= stop_deadline_) {
        for (auto& m : members_)
          if (!m.done()) mark_lost(m, fmt::format("no exit report within {} s of the stop", o_.stop_timeout_s + kStopSlackS));
        return;
      }
    }
  }

  void reap_launcher() {
    if (!launcher_status_) {
      ::kill(-launcher_pid_, SIGTERM);
      const double until = mono_now() + kLauncherGraceS;
      int st = 0;
      while (mono_now() < until && wait_process(launcher_pid_, &st, WNOHANG) == 0) ::usleep(20000);
      if (wait_process(launcher_pid_, &st, WNOHANG) == 0) {
        ::kill(-launcher_pid_, SIGKILL);
        wait_process(launcher_pid_, &st);
      }
      launcher_status_ = exit_code_of(st);
    }
    ::kill(-launcher_pid_, SIGKILL);  // what the launcher left in its group
    for (auto& m : members_) m.conn.reset();
    pending_.clear();
  }

  std::optional<Outcome> decide() {
    const auto latest = latest_committed_step(o_.ckpt_dir);
    out_.committed_step = latest;
    if (walltime_stop_ && !failure_) {
      count_progress(latest, best_, no_progress_);
      if (no_progress_ >= o_.give_up_after)
        return give_up(static_cast<int>(ExitCode::kCheckFailed),
                       fmt::format("{} consecutive attempt(s) without a new committed step (latest: {}), counting "
                                   "earlier allocations; not requeued", no_progress_, step_text(latest)));
      save_no_progress(state_path_, no_progress_, latest, log_);
      requeue_job(o_, [this](const std::string& e, const std::string& m) { log_(e, m); }, job_, !job_.empty(),
                  &mask_.old(), out_,
                  newer(latest, baseline_) ? fmt::format("stopped after committing step {}", *latest)
                                           : fmt::format("stopped without a new committed step (resume from {})",
                                                         step_text(latest)));
      return out_;
    }
    if (stop_signal_ && !failure_) {
      out_.exit_code = 128 + stop_signal_;
      out_.reason = fmt::format("{} received; the attempt was stopped on every node, not restarted",
                                signal_name(stop_signal_));
      log_("done", out_.reason, {{"exit_code", out_.exit_code}});
      return out_;
    }
    if (!failure_) {
      forget_no_progress(state_path_);
      out_.exit_code = 0;
      out_.reason = fmt::format("CMD finished on every node ({})", joined(nodes_of()));
      log_("done", out_.reason, {{"exit_code", 0}});
      return out_;
    }
    const Failure f = *failure_;
    log_("exited", fmt::format("attempt {} ended: {}; latest committed: {}", attempt_, f.why, step_text(latest)),
         {{"attempt", attempt_}, {"failure", f.kind}, {"host", f.node}, {"exit_code", f.exit_code},
          {"committed_step", latest ? json(*latest) : json(nullptr)}});
    count_progress(latest, best_, no_progress_);
    if (no_progress_ >= o_.give_up_after)
      return give_up(f.exit_code, fmt::format("{} consecutive attempt(s) without a new committed step (latest: {}); "
                                              "last one: {}", no_progress_, step_text(latest), f.why));
    if (restarts_ >= o_.max_restarts)
      return give_up(f.exit_code, fmt::format("restart limit of {} reached; last attempt: {}", o_.max_restarts, f.why));
    // The node the failure implicates is re-vetted; without --vet quick a
    // lost node cannot be cleared and is excluded, a hung or crashed one kept.
    if (c_.vet_args) vet({f.node}, fmt::format("it {}", f.kind == "lost" ? "was lost" : f.kind));
    else if (f.kind == "lost") {
      excluded_[f.node] = "lost, and no --vet quick to clear it";
      log_("exclude", fmt::format("{} excluded for the rest of the job: lost, and no --vet quick to clear it", f.node),
           {{"node", f.node}, {"reason", excluded_[f.node]}});
    }
    ++restarts_;
    log_("restart", fmt::format("{}; restart {} of {} in {} s from {}", f.why, restarts_, o_.max_restarts,
                                o_.restart_delay_s, step_text(best_)),
         {{"restart", restarts_}, {"no_progress", no_progress_}});
    return wait_to_restart(o_, set_, log_, job_, !job_.empty(), &mask_.old(), no_progress_, out_);
  }

  const Options& o_;
  const ClusterOptions& c_;
  Log& log_;
  MaskGuard& mask_;
  sigset_t set_{};
  std::vector<std::string> allocation_;
  std::map<std::string, std::string> excluded_;
  Listener listener_;
  std::string host_, job_, token_, state_path_, request_why_;
  double request_deadline_ = 0;
  Walltime wt_;
  Outcome out_;
  std::optional<std::uint64_t> best_, baseline_;
  int restarts_ = 0, no_progress_ = 0, attempt_ = 0, stop_signal_ = 0;
  std::vector<Member> members_;
  std::vector<std::pair<Conn, double>> pending_;
  std::optional<Failure> failure_;
  std::set<int> conflicts_;
  pid_t launcher_pid_ = 0;
  std::optional<int> launcher_status_;
  double started_at_ = 0, stop_deadline_ = 0, grace_deadline_ = 0;
  bool stopping_ = false, asked_ = false, walltime_stop_ = false;
};

// The allocation's nodes: --node-list, else `scontrol show hostnames $SLURM_JOB_NODELIST`.
Expected<std::vector<std::string>> allocation_nodes(const Options& o, const sigset_t* mask) {
  const auto& c = *o.cluster;
  std::vector<std::string> nodes = c.node_list;
  if (nodes.empty()) {
    const char* list = std::getenv("SLURM_JOB_NODELIST");
    if (!list || !*list)
      return Error{ErrorKind::kUsage, "--nodes: no allocation to choose from (SLURM_JOB_NODELIST unset; give --node-list)"};
    auto got = capture({o.scontrol, "show", "hostnames", list}, 30, mask);
    if (!got || got->status != 0)
      return Error{ErrorKind::kRuntime, fmt::format("'{} show hostnames {}' failed: {}", o.scontrol, list,
                                                    got ? got->output.substr(0, 200) : got.error().message)};
    nodes = words(got->output);
  }
  std::set<std::string> seen;
  for (const auto& n : nodes)
    if (n.empty() || !seen.insert(n).second)
      return Error{ErrorKind::kUsage, fmt::format("--node-list: node '{}' is empty or given twice", n)};
  return nodes;
}

}  // namespace

Expected<Outcome> lead_cluster(const Options& o, Log& log, MaskGuard& mask) {
  const auto& c = *o.cluster;
  if (c.nodes < 1) return Error{ErrorKind::kUsage, "--nodes must be at least 1"};
  if (c.min_nodes < 0 || c.min_nodes > c.nodes)
    return Error{ErrorKind::kUsage, fmt::format("--min-nodes {} must lie between 1 and --nodes {}", c.min_nodes, c.nodes)};
  if (c.pacer.empty()) return Error{ErrorKind::kUsage, "no pacer executable for the agents"};
  auto nodes = allocation_nodes(o, &mask.old());
  if (!nodes) return nodes.error();
  const int min_nodes = c.min_nodes > 0 ? c.min_nodes : c.nodes;
  if (static_cast<std::size_t>(c.nodes) > nodes->size())
    return Error{ErrorKind::kUsage, fmt::format("--nodes {} (--min-nodes {}): the allocation has only {} node(s) ({})",
                                                c.nodes, min_nodes, nodes->size(), joined(*nodes))};
  auto listener = Listener::open();
  if (!listener) return listener.error();
  Leader leader(o, log, mask, std::move(*nodes), std::move(*listener),
                c.leader_addr.empty() ? hw::hostname() : c.leader_addr);
  return leader.run();
}

}  // namespace pacer::run
