// `pacer vet --cluster`: vet every node of an allocation, compare them, test the network, pick the nodes to use.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/comm/timed.hpp"
#include "pacer/core/error.hpp"
#include "pacer/vet/vet.hpp"

namespace pacer::vet {

inline constexpr const char* kClusterReportSchema = "pacer.vet.cluster/1";

// Exit status of a `--need N` run with fewer than N healthy nodes; beside
// ExitCode's 0 ok, 1 check failed, 2 usage, 3 runtime.
inline constexpr int kExitTooFewNodes = 4;

struct ClusterOptions {
  VetOptions node;               // the checks each node's leader runs; injections may name nodes
  std::string node_name;         // this rank's node (default: host name); ranks with one name form a node
  std::optional<unsigned> need;  // pick this many healthy nodes
  bool network = true;           // run the network tests (--skip network turns them off)
  double bound_s = 300;          // every rank ends its part within this many seconds of its start
  std::size_t p2p_bytes = 16u << 20;       // message size of the point-to-point bandwidth test
  std::size_t allreduce_bytes = 64u << 20; // buffer size of the all-reduce test
  int p2p_reps = 10;
  int latency_reps = 200;
  bool rdma = true;         // perftest between the RDMA ports of ring neighbours (--skip rdma turns it off)
  int rdma_tcp_port = 18515;  // perftest's out-of-band connections use this port and the next 2 per RDMA port
};

// One network measurement between two nodes.
struct LinkResult {
  std::string a;
  std::string b;
  std::string kind;  // "ring" or "bisect"
  std::optional<double> bandwidth_gbps;  // GB/s one way: bytes / (round trip / 2)
  std::optional<double> latency_us;      // half the median round trip of a small message
  CheckStatus status = CheckStatus::kPass;
  std::string reason;
};

struct AllReduceResult {
  std::size_t bytes = 0;
  int ranks = 0;
  std::optional<double> algbw_gbps;  // bytes / time
  std::optional<double> busbw_gbps;  // algbw * 2 (n - 1) / n, as nccl-tests defines it
  CheckStatus status = CheckStatus::kSkip;
  std::string reason;
};

// perftest's RDMA write between the k-th active RDMA port of two ring
// neighbours: `a` runs the servers, `b` the clients, which measure.
struct RdmaResult {
  std::string a;
  std::string b;
  std::string device;       // a's port, "mlx5_0/1"
  std::string peer_device;  // b's port
  bool gpudirect = false;   // buffers in GPU memory (--use_cuda; nvidia_peermem loaded on both)
  std::optional<double> bandwidth_gbits;  // Gb/s, ib_write_bw's average, as the port's rate is given
  std::optional<double> latency_us;       // ib_write_lat's typical (median) one-way latency
  CheckStatus status = CheckStatus::kSkip;
  std::string reason;
};
// Judges RDMA results against their median bandwidth with the link ratios of [cluster].
void judge_rdma(std::vector<RdmaResult>& results, const Profile& profile);

// Values of one setting that differ between nodes: a failure.
struct Drift {
  std::string key;                                         // "software.kernel", "system.thp_enabled"
  std::map<std::string, std::vector<std::string>> values;  // value -> nodes
  std::string reference;                                   // the value most nodes have
};

// One node's figure for a check against the allocation's median.
struct OutlierEntry {
  std::string node;
  double value = 0;
  double ratio = 1;  // value / median
  double z = 0;      // robust z: (value - median) / max(1.4826 MAD, floor * |median|), sign: worse is negative
  CheckStatus status = CheckStatus::kPass;
};

struct OutlierCheck {
  std::string check;
  std::string target;
  std::string unit;
  double median = 0;
  double mad = 0;
  std::vector<OutlierEntry> nodes;
};

struct NodeResult {
  std::string name;
  std::string host;
  std::vector<int> ranks;
  std::optional<VetReport> report;  // missing when the node's leader did not answer in time
  CheckStatus status = CheckStatus::kPass;  // the worst of its checks, drift, outliers and network
  std::vector<std::string> reasons;         // why it is not pass
  double score = 0;                         // mean figure relative to the median (1 = typical); higher is better
  bool healthy() const { return status == CheckStatus::kPass || status == CheckStatus::kWarn; }
};

struct Selection {
  unsigned need = 0;
  std::vector<std::string> chosen;    // best first
  std::vector<std::string> excluded;  // every other node
  bool enough() const { return chosen.size() >= need; }
};

struct ClusterReport {
  std::string started_at;
  double duration_s = 0;
  double bound_s = 0;
  std::string mode;
  std::string profile;
  int ranks = 0;
  std::vector<int> missing_ranks;  // ranks that never said which node they are on
  bool stalled = false;            // a leader left an MPI operation pending at its deadline
  std::vector<NodeResult> nodes;
  std::vector<LinkResult> links;
  std::vector<std::string> suspects;  // nodes the bisection blames for slow links
  AllReduceResult allreduce;
  AllReduceResult nccl;  // across nodes on GPUs; skip without CUDA
  std::vector<RdmaResult> rdma;
  std::vector<Drift> drift;
  std::vector<OutlierCheck> outliers;
  std::optional<Selection> selection;
  std::vector<Injection> injections;

  std::string verdict() const;  // "pass", "fail", or "too_few" (--need not met)
  // False when a node or rank did not answer: the caller should then end the
  // whole job (TimedComm::abort) rather than wait for it in MPI_Finalize.
  bool complete() const;
};

// Runs the cluster vet on every rank of `comm`; every rank must call it.
// Returns the report on rank 0 and nullopt on the others. Each rank returns
// within `bound_s` of its call (plus the time to kill a hung probe): nodes
// whose leaders did not answer by then are reported failed. When
// `comm.abandoned()` is true afterwards, end with `comm.abort(code)`.
Expected<std::optional<ClusterReport>> run_cluster_vet(comm::TimedComm& comm, const ClusterOptions& options);

// Exposed for tests: the analysis rank 0 applies to the gathered reports.
std::vector<Drift> find_drift(const std::vector<NodeResult>& nodes);
std::vector<OutlierCheck> find_outliers(const std::vector<NodeResult>& nodes, const Profile& profile);
// Judges links against the median bandwidth of the ring links.
void judge_links(std::vector<LinkResult>& links, const Profile& profile);
// Pairs to test next: each endpoint of a slow ring link against a node whose links are all fast.
std::vector<std::pair<std::string, std::string>> bisection_pairs(const std::vector<LinkResult>& ring);
std::vector<std::string> blame(const std::vector<LinkResult>& links);
// Sets each node's status, reasons and score from its report and the analyses.
void judge_nodes(ClusterReport& r);
Selection select_nodes(const std::vector<NodeResult>& nodes, unsigned need);

nlohmann::json to_json(const ClusterReport& r);
std::string render_table(const ClusterReport& r);
// 0 pass; 1 a node failed (without --need); kExitTooFewNodes with --need and
// fewer healthy nodes than needed.
int exit_code(const ClusterReport& r);
// Writes the chosen nodes to `hostfile` and every other node to
// `exclude_file`, one name per line (srun --nodelist=FILE / --exclude=FILE
// read such files when the name contains a '/'); each atomically.
Status write_selection(const Selection& s, const std::string& hostfile, const std::string& exclude_file);

}  // namespace pacer::vet
