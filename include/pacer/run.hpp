// `pacer run`: a supervisor that keeps a training command alive inside a Slurm job.
#pragma once

#include <csignal>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::run {

inline constexpr const char* kEventSchema = "pacer.run.event/1";

// The checkpoint request contract, as environment variables of CMD (see
// docs/run.md). When a checkpoint is wanted the supervisor creates the file
// named by kRequestFileEnv and, when kRequestSignalEnv is set, sends that
// signal to CMD's process group. CMD saves with pacer's checkpoint library
// under kCkptDirEnv; the supervisor waits for a newer committed step there.
inline constexpr const char* kRequestFileEnv = "PACER_CKPT_REQUEST_FILE";
inline constexpr const char* kRequestSignalEnv = "PACER_CKPT_SIGNAL";  // "USR1", "USR2", "TERM"; unset: none
inline constexpr const char* kCkptDirEnv = "PACER_CKPT_DIR";
inline constexpr const char* kAttemptEnv = "PACER_RUN_ATTEMPT";  // 0 for the first start in this allocation

// The progress contract (docs/run.md, "Hangs"), set for CMD while hang
// detection is on: the heartbeat file (pacer.run.heartbeat/1, one 64-byte
// slot per local rank, mmapped by every heartbeating process), the directory
// where Python ranks write their stacks (stacks-PID.txt) and the signal that
// asks them to (faulthandler).
inline constexpr const char* kHeartbeatFileEnv = "PACER_HEARTBEAT_FILE";
inline constexpr const char* kStacksDirEnv = "PACER_STACKS_DIR";
inline constexpr const char* kStacksSignalEnv = "PACER_STACKS_SIGNAL";  // "URG": ignored by default elsewhere
inline constexpr int kStacksSignal = SIGURG;
inline constexpr std::uint32_t kHeartbeatSlots = 256;  // local ranks 0..255

// Tells the supervisor that this process made progress (a training step).
// The first call maps $PACER_HEARTBEAT_FILE and claims the slot of this
// process's local rank (SLURM_LOCALID, LOCAL_RANK, ...); every later call is
// two plain stores into that page (the step, then a counter): no system call,
// no lock, no clock. The supervisor notices the counter change by polling and
// keeps the time itself (CLOCK_MONOTONIC). Without the variable (no
// supervisor, or --hang-timeout 0) it does nothing. Errors (first call only,
// then repeated): the file is missing, not ours, of the wrong size or format,
// the local rank is no number or >= kHeartbeatSlots, or another live process
// holds the slot. A process forked from a heartbeating one is not a rank: its
// calls do nothing.
Status heartbeat(std::optional<std::uint64_t> step = std::nullopt);

// In the checkpoint root: how many attempts in a row, over requeued
// allocations, ended without a new committed step (pacer.run.state/1).
inline constexpr const char* kStateName = ".pacer-run.json";

// Exit status of `pacer run` when it stopped CMD for a checkpoint so that the
// job continues in a later allocation (EX_TEMPFAIL of sysexits.h): the job was
// requeued, or an `sbatch --dependency=singleton` chain's next job resumes.
inline constexpr int kExitRequeued = 75;
inline constexpr int kExitNotFound = 127;       // CMD not found (as in shells)
inline constexpr int kExitNotExecutable = 126;  // CMD found but not executable

// Where the job's end time comes from.
enum class WalltimeSource { kNone, kEnv, kScontrol, kOverride };

struct Walltime {
  std::optional<double> end_time;  // Unix seconds
  WalltimeSource source = WalltimeSource::kNone;
  std::string note;  // why it is unknown, or where it came from
};

// Reads the job's end time: $SLURM_JOB_END_TIME (Unix seconds), else
// `scontrol show job $SLURM_JOB_ID` (EndTime=, local time). Never fails: an
// unknown end time is a Walltime without end_time and a note saying why.
// `scontrol` is the program to run (tests pass a fake one).
Walltime learn_walltime(const std::string& scontrol = "scontrol");
// EndTime=YYYY-MM-DDTHH:MM:SS (local time) from `scontrol show job` output.
std::optional<double> parse_scontrol_end_time(const std::string& text);

// "USR1", "SIGUSR1", "10" -> the signal number; only USR1, USR2, TERM, INT,
// HUP and QUIT are accepted (those Slurm's --signal is used with).
Expected<int> parse_signal(const std::string& text);
std::string signal_name(int sig);

enum class RequeueMode {
  kScontrol,  // `scontrol requeue $SLURM_JOB_ID`, then exit kExitRequeued
  kExit,      // exit kExitRequeued only (an sbatch --dependency=singleton chain)
};

// What the check before CMD found.
struct VetQuickVerdict {
  bool passed = false;
  std::string summary;              // "passed (12 checks)", "failed: gpu.count disk.free", "interrupted"
  std::vector<std::string> failed;  // checks that failed or errored
};

// `pacer run --nodes N`: the leader of a job on several nodes (docs/run.md,
// "Several nodes"). Per attempt it starts one `pacer run-agent` per chosen
// node through `launcher`, watches every rank's progress through the agents,
// and after a crash, a hang or a lost node re-vets the nodes implicated,
// excludes the bad ones and relaunches on the good ones (spares fill in).
struct ClusterOptions {
  int nodes = 0;       // N: nodes per attempt
  int min_nodes = 0;   // M: the attempt may shrink to this many; 0: N
  std::vector<std::string> node_list;  // the allocation, in order; empty: $SLURM_JOB_NODELIST via scontrol
  // The launch prefix, before `PACER run-agent ...`; {nodes} and {count}
  // in its words become the chosen nodes (comma-separated) and their number.
  // Empty: kDefaultLauncher.
  std::vector<std::string> launcher;
  // How `pacer vet --quick` reaches one node ({nodes}: that node); empty: kDefaultVetLauncher.
  std::vector<std::string> vet_launcher;
  // `pacer vet` arguments after --quick (the --vet-* options); nullopt: no vet.
  std::optional<std::vector<std::string>> vet_args;
  std::string pacer;        // this executable, as the nodes find it
  std::string leader_addr;  // how agents reach the leader; empty: this host's name
  double connect_timeout_s = 120;  // from the launch to every agent's hello
  double vet_timeout_s = 600;      // one node's vet, launch included
  // More `pacer run-agent` options, before its `--` (the CLI's --monitor settings).
  std::vector<std::string> agent_args;
};
inline constexpr const char* kDefaultLauncher =
    "srun --nodes={count} --ntasks={count} --ntasks-per-node=1 --nodelist={nodes} --overlap --kill-on-bad-exit=0 "
    "--immediate=60";
inline constexpr const char* kDefaultVetLauncher =
    "srun --nodes=1 --ntasks=1 --nodelist={nodes} --overlap --immediate=30";
// Set for the launcher and, through it, the agents: the chosen nodes in node
// rank order, their number, and the token an agent proves itself with.
inline constexpr const char* kRunNodesEnv = "PACER_RUN_NODES";
inline constexpr const char* kRunTokenEnv = "PACER_RUN_TOKEN";
// Set for CMD by its agent: the node's rank in this attempt, the number of
// nodes, and the rendezvous of this attempt (its first node).
inline constexpr const char* kNodeRankEnv = "PACER_NODE_RANK";
inline constexpr const char* kNNodesEnv = "PACER_NNODES";
// The node's name as an agent reports it (else SLURMD_NODENAME, else the host name).
inline constexpr const char* kNodeNameEnv = "PACER_NODE_NAME";
// `pacer run --nodes`: fewer good nodes than --min-nodes remain.
inline constexpr int kExitTooFewNodes = 1;

struct AgentOptions {
  std::string leader;  // HOST:PORT
  int attempt = 0;
  std::string node_name;  // empty: $PACER_NODE_NAME, $SLURMD_NODENAME, the host name
  std::vector<std::string> argv;
};
// The node's name as its agent reports it: node_name, else $PACER_NODE_NAME,
// $SLURMD_NODENAME, the host name.
std::string agent_node_name(const AgentOptions& options);
// `pacer run-agent`: CMD on this node for a leader. Returns the exit status
// for the agent (CMD's, or 3 when the leader is gone or unreachable).
int run_agent(const AgentOptions& options);

struct Options {
  std::vector<std::string> argv;  // CMD, run by path search without a shell
  std::string ckpt_dir;           // where CMD commits checkpoints (pacer checkpoint layout); empty: none
  int slurm_signal = SIGUSR1;     // the signal Slurm sends before the end (--signal)
  std::optional<int> request_signal;  // sent to CMD's process group with a checkpoint request
  // empty: <dir>/ckpt-request in a fresh mode-0700 directory made with mkdtemp
  // under $XDG_RUNTIME_DIR, $SLURM_TMPDIR, $TMPDIR or /tmp (removed at the end).
  // A path given here must lie in a directory others cannot write to (or a
  // sticky one): a usage error otherwise.
  std::string request_file;
  double before_s = 0;            // checkpoint this long before the job's end time; 0: on the signal only
  double grace_s = 120;           // how long to wait for a new committed step
  double stop_timeout_s = 30;     // SIGTERM to SIGKILL when stopping CMD
  int max_restarts = 3;           // crashes restarted within one allocation
  int give_up_after = 2;          // consecutive attempts without a new committed step
  double restart_delay_s = 1;
  RequeueMode requeue = RequeueMode::kScontrol;
  std::string scontrol = "scontrol";
  std::optional<double> end_time;  // overrides learn_walltime (Unix seconds)
  // `pacer vet --quick` before CMD's first start (the CLI's --vet quick calls
  // vet::run_vet); CMD is not started unless it passes. A callback so that run
  // does not link vet. Empty: no check.
  std::function<Expected<VetQuickVerdict>()> vet_quick;
  // Hang detection: a hang is a rank that made no progress (heartbeat) for
  // this long; empty: derived once kAutoHangAfter heartbeat intervals were
  // seen, max(5 x p99 interval, 120 s); 0: off (no heartbeat file for CMD).
  std::optional<double> hang_timeout_s;
  std::optional<ClusterOptions> cluster;  // several nodes (--nodes); nullopt: this node only
  std::string log_path;            // JSON lines, appended; empty: none
  // Every decision, after it is written to log_path (human log lines).
  std::function<void(const nlohmann::json& event)> on_event;
};

inline constexpr int kAutoHangAfter = 20;  // intervals seen before the derived --hang-timeout applies
inline constexpr double kAutoHangFloorS = 120;

// The derived hang timeout for observed heartbeat intervals (seconds):
// max(5 x p99, kAutoHangFloorS), or nothing before kAutoHangAfter intervals.
std::optional<double> derived_hang_timeout(const std::vector<double>& intervals);

struct Outcome {
  int exit_code = 0;           // what `pacer run` exits with
  std::string reason;          // one line: why it ended
  int attempts = 0;            // starts of CMD
  bool requeued = false;       // stopped for a checkpoint and requeued (or left for the next job)
  std::optional<std::uint64_t> committed_step;  // newest committed step at the end
};

// Newest committed step in `dir` (pacer checkpoint layout: a step directory
// whose manifest and file sizes check), or nothing. Cheap: no data is read.
std::optional<std::uint64_t> latest_committed_step(const std::string& dir);

// Runs the supervisor until CMD finishes, gives up or is stopped for a
// requeue. Blocks. While it runs it blocks SIGCHLD, SIGINT, SIGTERM, SIGHUP,
// SIGQUIT, SIGUSR1 and SIGUSR2 in the calling thread and takes them with
// sigtimedwait (call it from a process's only thread, as the CLI does); the
// mask is restored on return. Errors only for bad options; CMD's failures are
// an Outcome.
Expected<Outcome> supervise(const Options& options);

// One human line for an event: "2026-11-29T10:00:00Z pacer run: start ...".
std::string format_event(const nlohmann::json& event);

}  // namespace pacer::run
