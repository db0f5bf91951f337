// Internal: the probes behind `pacer vet` and how they declare their checks and parameters.
#pragma once

#include <csignal>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/vet/check.hpp"

namespace pacer::vet {

enum class ValueKind { kNumber, kText };
// Which way a figure gets better; baselines judge only checks that have one.
enum class Direction { kNone, kHigher, kLower };
enum class ParamType { kDuration, kSize, kInteger, kNumber, kString };

struct CheckSpec {
  std::string name;
  std::string category;
  std::string unit;
  ValueKind kind = ValueKind::kNumber;
  Direction direction = Direction::kNone;
  std::string help;
};

struct ParamSpec {
  std::string key;
  ParamType type;
  nlohmann::json normal;  // default in the full run
  nlohmann::json quick;   // default with --quick
  std::string help;
};

// A storage path under test and the scratch directory the runner made in it
// for this probe (empty, with `error` set, when the path is unusable).
struct StorageTarget {
  std::string path;
  std::string scratch;
  std::string error;
};

// Storage scratch directories are named <kScratchPrefix><probe>-<pid>@<host>.XXXXXX.
inline constexpr const char* kScratchPrefix = ".pacer-vet-";
std::string scratch_prefix(const std::string& probe, long pid, const std::string& host);
// Removes, from `dir`, the scratch directories (this user's) of vet runs on
// `host` whose process no longer exists; returns their paths. Scratch of
// other hosts, of live pids and of the old pid-only names is left alone.
std::vector<std::string> remove_stale_scratch(const std::string& dir, const std::string& host);

// What a probe gets to work with. Parameters are already resolved: defaults
// for the mode, then the profile's values, converted to plain numbers
// (seconds, bytes).
struct ProbeContext {
  bool quick = false;
  nlohmann::json params;
  std::vector<StorageTarget> storage;
  std::optional<unsigned> expect_gpus;
  std::set<std::string> wanted;  // checks of this probe that were selected
  // CLOCK_MONOTONIC seconds when run_vet began: what happened "during vet"
  // (kernel log records carry the same clock).
  double vet_started_s = 0;

  double seconds(const std::string& key) const { return params.at(key).get<double>(); }
  std::uint64_t bytes(const std::string& key) const { return params.at(key).get<std::uint64_t>(); }
  long long integer(const std::string& key) const { return params.at(key).get<long long>(); }
  bool wants(const std::string& check) const { return wanted.count(check) != 0; }
};

// One unit of work run in its own child process under one timeout; it
// measures one or more checks. Params of a probe with a `section` live in that
// profile table (storage probes share [storage]); others in the table of the
// probe's first check.
struct ProbeSpec {
  std::string name;
  std::vector<CheckSpec> checks;
  std::vector<ParamSpec> params;
  std::string section;
  bool uses_storage = false;
  double timeout_s = 30;
  double quick_timeout_s = 10;
  std::function<std::vector<Measurement>(const ProbeContext&)> run;
};

// Every probe, in the order vet runs them (cheap and passive first).
const std::vector<ProbeSpec>& all_probes();
const CheckSpec* find_check(const std::string& name);
const ProbeSpec* probe_of_check(const std::string& name);
// Chaos targets of the cluster layer, beside the node checks (--inject
// [NODE:]NAME=ACTION): network.p2p=VALUE makes every link of the node report
// VALUE GB/s, network.p2p=hang makes the node sit out the network tests,
// cluster.report=hang makes its leader never send its report (a wedged node).
// Kept with the registry so that the node runner can tell them apart without
// depending on the cluster layer.
bool is_cluster_check(const std::string& name);

std::vector<ProbeSpec> system_probes();
std::vector<ProbeSpec> cpu_probes();
std::vector<ProbeSpec> memory_probes();
std::vector<ProbeSpec> storage_probes();
std::vector<ProbeSpec> gpu_probes();
std::vector<ProbeSpec> gpu_active_probes();
std::vector<ProbeSpec> software_probes();
std::vector<ProbeSpec> gpu_error_probes();
std::vector<ProbeSpec> grace_probes();
std::vector<ProbeSpec> grace_active_probes();
// A directory prefixed to /dev, /sys and /proc by the GPU error, topology and
// Grace probes ($PACER_VET_ROOT; empty: the real ones), so tests use a fake tree.
std::string vet_root();

std::vector<ProbeSpec> fabric_probes();

// Software drift inputs, exposed for tests. The `prefix` variables of `env`
// ("K=V" entries) but those named in `ignore`, sorted, space-separated.
std::string environment_text(const std::vector<std::string>& env, const std::string& prefix, const std::set<std::string>& ignore);
// The container image the process runs in, from the runtimes' environment
// variables and Podman's ROOT/run/.containerenv; empty text (with `source`
// saying why) outside a known container.
struct ContainerIdentity {
  std::string text;
  std::string source;
};
ContainerIdentity container_identity(const std::vector<std::string>& env, const std::string& root);

// The fabric probe's body: RDMA ports and Slingshot links under ROOT/sys,
// read twice; `between` runs between the two reads instead of the sleep of
// `window_s` (tests change the fake tree there). `devices`: the probe's
// parameter, a comma-separated list of devices or DEV/PORT; empty: all.
std::vector<Measurement> measure_fabric(const std::string& root, const std::string& devices, double window_s,
                                        const std::function<void()>& between);

// Set in the probe's child process when the runner asks it to stop (SIGTERM,
// Ctrl-C): long loops check it and clean up.
extern volatile std::sig_atomic_t g_probe_cancelled;
inline bool cancelled() { return g_probe_cancelled != 0; }

// `body` run in a forked child in its own process group; what it returns
// comes back through a pipe. At `timeout_s` (or on Ctrl-C in vet) the group
// is killed. GPU work runs this way: a hung kernel or NCCL call dies with its
// process, and the parent never initialises CUDA, which a later fork could
// not use.
struct ForkOutcome {
  std::string data;
  std::string error;  // "timed out after ...", "interrupted", "crashed: <signal>", "threw: <what>"
  bool interrupted = false;
  double duration_s = 0;
};
// `on_data`, in the parent, sees everything the child has sent so far each
// time more arrives; the child sends early with fork_emit (an NCCL unique id
// must reach the other nodes while the process that made it lives on).
ForkOutcome run_forked(const std::function<std::string()>& body, double timeout_s,
                       const std::function<void(const std::string&)>& on_data = {});
// In a run_forked child: sends `data` to the parent now, ahead of what body returns.
void fork_emit(const std::string& data);

// Helpers for building measurements.
Measurement measured(const std::string& check, double value, std::string detail = {}, std::string target = {});
Measurement measured_text(const std::string& check, std::string text, std::string detail = {}, std::string target = {});
Measurement not_measured(const std::string& check, CheckStatus status, std::string reason, std::string target = {});

}  // namespace pacer::vet
