// `pacer run-agent`: one node of a `pacer run --nodes` job: runs CMD there, reports its ranks' progress, obeys the leader.
#include <poll.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "pacer/core/posix_io.hpp"
#include "pacer/core/process.hpp"
#include "pacer/hw/system.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

using nlohmann::json;

constexpr int kExitLeaderGone = 3;  // ExitCode::kRuntime

void say(const std::string& node, const std::string& message) {
  std::fprintf(stderr, "pacer run-agent %s: %s\n", node.c_str(), message.c_str());
}

json opt_step(const std::optional<std::uint64_t>& s) { return s ? json(*s) : json(nullptr); }

class Agent {
 public:
  Agent(const AgentOptions& a, std::string node, Conn conn) : a_(a), node_(std::move(node)), conn_(std::move(conn)) {}

  int run(const json& start) {
    const sigset_t set = watched_signals();
    MaskGuard mask(set);
    auto dir = make_request_dir();
    if (!dir) return fail(dir.error().message);
    dir_ = *dir;
    struct Cleanup {
      const std::string& d;
      ~Cleanup() {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    } cleanup{dir_};
    stop_timeout_s_ = start.value("stop_timeout_s", 30.0);
    poll_s_ = std::clamp(start.value("poll_s", 0.25), 0.02, 5.0);
    const json ht = start.value("hang_timeout_s", json());
    std::optional<double> hang_timeout;
    if (ht.is_number()) hang_timeout = ht.get<double>();
    watch_.emplace(hang_timeout);
    request_file_ = dir_ + "/ckpt-request";
    std::vector<std::pair<std::string, std::string>> env = {
        {kNodeRankEnv, std::to_string(start.value("node_rank", 0))},
        {kNNodesEnv, std::to_string(start.value("nnodes", 1))},
        {"MASTER_ADDR", start.value("master_addr", std::string())},
        {"MASTER_PORT", std::to_string(start.value("master_port", 0))},
        {kAttemptEnv, std::to_string(a_.attempt)},
        {kRequestFileEnv, request_file_}};
    if (const auto c = start.value("ckpt_dir", std::string()); !c.empty()) env.emplace_back(kCkptDirEnv, c);
    if (const auto rs = start.value("request_signal", std::string()); !rs.empty()) {
      env.emplace_back(kRequestSignalEnv, rs);
      if (auto sig = parse_signal(rs)) request_signal_ = *sig;
    }
    auto board = HeartbeatBoard::create(dir_ + "/heartbeat");
    if (!board) return fail(board.error().message);
    board_.emplace(std::move(*board));
    env.emplace_back(kHeartbeatFileEnv, board_->path());
    env.emplace_back(kStacksDirEnv, dir_);
    env.emplace_back(kStacksSignalEnv, "URG");
    SpawnOptions so;
    so.env = env;
    so.signal_mask = &mask.old();
    so.new_process_group = true;
    int exec_errno = 0;
    auto pid = spawn_process(a_.argv, so, &exec_errno);
    if (!pid) {
      const int code = exec_errno == ENOENT || exec_errno == ENOTDIR ? kExitNotFound : kExitNotExecutable;
      const std::string why = exec_errno ? fmt::format("{}: {}", a_.argv[0], code == kExitNotFound ? "command not found"
                                                                                                   : std::strerror(exec_errno))
                                         : pid.error().message;
      (void)conn_.send({{"type", "exit"}, {"exit_code", code}, {"message", why}});
      say(node_, why);
      return code;
    }
    pid_ = *pid;
    (void)conn_.send({{"type", "started"}, {"pid", pid_}});
    return loop(set);
  }

 private:
  int fail(const std::string& why) {
    (void)conn_.send({{"type", "exit"}, {"exit_code", kExitLeaderGone}, {"message", why}});
    say(node_, why);
    return kExitLeaderGone;
  }

  void stop(const std::string& why) {
    if (stopping_) return;
    stopping_ = true;
    ::kill(-pid_, SIGTERM);
    kill_at_ = mono_now() + stop_timeout_s_;
    say(node_, why + fmt::format("; SIGTERM to CMD's process group, SIGKILL after {} s", stop_timeout_s_));
  }

  json ranks_json(double now) const {
    json ranks = json::array();
    for (const auto& r : watch_->ranks())
      ranks.push_back({{"rank", r.rank}, {"local_rank", r.local_rank}, {"pid", r.pid}, {"heartbeats", r.count},
                       {"step", opt_step(r.step)}, {"idle_s", now - r.last_change}});
    return ranks;
  }

  void report() {
    auto readings = board_->read();
    for (const auto& r : readings)
      if (!r.problem.empty() && std::find(reported_.begin(), reported_.end(), r.local_rank) == reported_.end()) {
        reported_.push_back(r.local_rank);
        (void)conn_.send({{"type", "invalid"}, {"local_rank", r.local_rank}, {"message", r.problem}});
      }
    const double now = mono_now();
    (void)watch_->observe(readings, now);
    const auto t = watch_->timeout();
    (void)conn_.send({{"type", "progress"}, {"ranks", ranks_json(now)}, {"timeout_s", t ? json(*t) : json(nullptr)}});
  }

  // The faulthandler signal to CMD's group, a moment for the stack files,
  // then every watched rank's stacks and this node's GPUs.
  void dump() {
    ::kill(-pid_, kStacksSignal);
    auto path = [&](int pid) { return fmt::format("{}/stacks-{}.txt", dir_, pid); };
    const double until = mono_now() + 2;
    for (;;) {
      bool all = true;
      for (const auto& r : watch_->ranks()) {
        struct stat st {};
        all = all && ::stat(path(r.pid).c_str(), &st) == 0 && st.st_size > 0;
      }
      if (all || mono_now() >= until) break;
      ::usleep(50000);
    }
    ::usleep(100000);
    json stacks = json::array();
    for (const auto& r : watch_->ranks()) stacks.push_back(read_stacks(path(r.pid), r.rank, r.pid));
    (void)conn_.send({{"type", "dump"}, {"ranks", ranks_json(mono_now())}, {"stacks", stacks}, {"gpu", gpu_state()}});
  }

  void request(const json& m) {
    const json body = {{"schema", "pacer.run.request/1"}, {"reason", m.value("reason", std::string())},
                       {"time", utc_iso(wall_now(), true)}, {"deadline", m.value("deadline", 0.0)},
                       {"committed_step", m.value("committed_step", json())}};
    if (auto s = create_request(request_file_, body.dump() + "\n"); !s) say(node_, s.error().message);
    if (request_signal_) ::kill(-pid_, *request_signal_);
  }

  void handle(const json& m) {
    const std::string type = m.value("type", std::string());
    if (type == "dump") dump();
    else if (type == "stop") stop("the leader stops this attempt: " + m.value("reason", std::string()));
    else if (type == "request") request(m);
    else say(node_, fmt::format("unknown order from the leader ignored: {}", m.dump().substr(0, 200)));
  }

  int loop(const sigset_t& set) {
    double next_report = mono_now();
    int status = 0;
    for (;;) {
      const double now = mono_now();
      double wait = std::max(0.0, next_report - now);
      if (stopping_ && !killed_) wait = std::min(wait, std::max(0.0, kill_at_ - now));
      wait = std::min(wait, 0.1);  // CMD's exit is seen within this (SIGCHLD is only polled)
      pollfd p{conn_.fd(), POLLIN, 0};
      if (!leader_gone_) retry_eintr([&] { return ::poll(&p, 1, static_cast<int>(wait * 1000) + 1); });
      else ::usleep(static_cast<useconds_t>(wait * 1e6) + 1000);
      if (wait_process(pid_, &status, WNOHANG) == pid_) break;
      timespec zero{};
      for (int sig; (sig = sigtimedwait(&set, nullptr, &zero)) > 0;)
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT) stop(fmt::format("{} received", signal_name(sig)));
      if (!leader_gone_) {
        auto got = conn_.receive();
        if (!got) {
          say(node_, got.error().message);
          conn_.close();
        } else {
          for (const auto& m : *got) handle(m);
        }
        if (conn_.eof()) {
          leader_gone_ = true;
          stop("the leader's connection closed");
        }
      }
      if (stopping_ && !killed_ && mono_now() >= kill_at_) {
        ::kill(-pid_, SIGKILL);
        killed_ = true;
      }
      if (!leader_gone_ && mono_now() >= next_report) {
        report();
        next_report = mono_now() + poll_s_;
      }
    }
    ::kill(-pid_, SIGKILL);  // what CMD left in its group
    const int code = exit_code_of(status);
    const std::string how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                              : fmt::format("was killed by {}", signal_name(WTERMSIG(status)));
    if (!leader_gone_) {
      report();
      (void)conn_.send({{"type", "exit"}, {"exit_code", code}, {"message", "CMD " + how}});
      return code;
    }
    say(node_, "CMD " + how + " after the leader was gone");
    return kExitLeaderGone;
  }

  const AgentOptions& a_;
  std::string node_;
  Conn conn_;
  std::string dir_, request_file_;
  std::optional<HeartbeatBoard> board_;
  std::optional<HangWatch> watch_;
  std::vector<int> reported_;
  std::optional<int> request_signal_;
  pid_t pid_ = 0;
  double stop_timeout_s_ = 30, poll_s_ = 0.25, kill_at_ = 0;
  bool stopping_ = false, killed_ = false, leader_gone_ = false;
};

}  // namespace

std::string agent_node_name(const AgentOptions& a) {
  if (!a.node_name.empty()) return a.node_name;
  for (const char* v : {kNodeNameEnv, "SLURMD_NODENAME"})
    if (const char* p = std::getenv(v); p && *p) return p;
  return hw::hostname();
}

int run_agent(const AgentOptions& a) {
  const std::string node = agent_node_name(a);
  // The agent is the launcher's task; CMD is this node's launcher of its
  // ranks, which give them their own ranks. The agent's task identity must
  // not reach them: every rank would read local rank 0 from it.
  for (const char* v : {"SLURM_LOCALID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID"})
    ::unsetenv(v);
  if (a.argv.empty()) {
    say(node, "no command to run (pacer run-agent --leader HOST:PORT -- CMD ...)");
    return static_cast<int>(ExitCode::kUsage);
  }
  auto hp = parse_host_port(a.leader);
  if (!hp) {
    say(node, "--leader " + hp.error().message);
    return static_cast<int>(ExitCode::kUsage);
  }
  auto conn = Conn::connect(hp->first, hp->second, 30);
  if (!conn) {
    say(node, conn.error().message);
    return kExitLeaderGone;
  }
  const char* token = std::getenv(kRunTokenEnv);
  if (auto s = conn->send({{"type", "hello"}, {"schema", kAgentSchema}, {"node", node}, {"attempt", a.attempt},
                           {"token", token ? token : ""}, {"pid", ::getpid()}});
      !s) {
    say(node, s.error().message);
    return kExitLeaderGone;
  }
  auto reply = conn->receive_one(60);
  if (!reply || !*reply) {
    say(node, reply ? fmt::format("leader {} sent no answer to hello within 60 s", a.leader) : reply.error().message);
    return kExitLeaderGone;
  }
  const json& r = **reply;
  if (r.value("type", std::string()) != "start") {
    say(node, fmt::format("refused by the leader: {}", r.value("message", r.dump().substr(0, 200))));
    return kExitLeaderGone;
  }
  Agent agent(a, node, std::move(*conn));
  return agent.run(r);
}

}  // namespace pacer::run
