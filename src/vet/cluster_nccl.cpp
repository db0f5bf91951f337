// NCCL all-reduce across nodes for `pacer vet --cluster`: agree over MPI, then measure in a child process the deadline can kill.
#include "cluster_nccl.hpp"

#include <fmt/format.h>

#include <chrono>
#include <memory>

#include "pacer/core/units.hpp"
#include "pacer/hw/gpu_bench.hpp"
#include "probes.hpp"

namespace pacer::vet {

namespace {

constexpr int kNcclIdTag = 190;

std::string to_hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

}  // namespace

AllReduceResult nccl_allreduce_across_nodes(comm::TimedComm& leaders, std::size_t bytes, int passes, comm::Deadline deadline) {
  AllReduceResult r;
  r.bytes = bytes / 4 * 4;
  r.ranks = leaders.size();
  r.status = CheckStatus::kSkip;
  if (!hw::gpu::built_with_cuda()) {
    r.reason = "pacer was built without CUDA";
    return r;
  }
  if (leaders.size() < 2) {
    r.reason = "one node: gpu.nccl_busbw measures its GPUs";
    return r;
  }
  // CUDA is touched only in children: the node checks that follow fork
  // their own, which could not use CUDA once this process had.
  const double window = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  int gpus = 0;
  std::string count_error;
  {
    const ForkOutcome f = run_forked(
        []() -> std::string {
          auto n = hw::gpu::device_count();
          return n ? nlohmann::json{{"gpus", *n}}.dump() : nlohmann::json{{"error", n.error().message}}.dump();
        },
        std::max(0.1, window / 3));
    const auto j = nlohmann::json::parse(f.data, nullptr, false);
    if (!f.error.empty()) count_error = "counting GPUs " + f.error;
    else if (j.is_discarded()) count_error = "counting GPUs returned no readable result";
    else gpus = j.value("gpus", 0);  // a CUDA error (no driver, no device) counts as no GPU
  }
  // Every leader learns whether all nodes can take part before any enters
  // NCCL's init, which would otherwise wait for the missing ones.
  auto agree = std::make_shared<std::vector<float>>(std::vector<float>{
      gpus > 0 ? 1.0f : 0.0f, float(gpus), float(gpus) * float(gpus), count_error.empty() ? 0.0f : 1.0f});
  if (!leaders.all_reduce_sum(agree, deadline)) {
    r.status = CheckStatus::kError;
    r.reason = "a node did not take part by the deadline";
    return r;
  }
  const auto& a = *agree;
  const int n = leaders.size();
  if (a[3] > 0) {
    r.status = CheckStatus::kError;
    r.reason = fmt::format("{} of {} nodes could not count their GPUs{}", int(a[3]), n, count_error.empty() ? "" : ": " + count_error);
    return r;
  }
  if (a[0] == 0) {
    r.reason = "no node has a GPU";
    return r;
  }
  if (a[0] < n) {
    r.status = CheckStatus::kFail;
    r.reason = fmt::format("{} of {} nodes see no GPU", n - int(a[0]), n);
    return r;
  }
  // Equal counts exactly when n * sum(G^2) == sum(G)^2.
  if (double(n) * a[2] != double(a[1]) * a[1]) {
    r.status = CheckStatus::kError;
    r.reason = fmt::format("nodes have different GPU counts ({} GPUs on {} nodes); NCCL across nodes needs the same count on each", a[1], n);
    return r;
  }

  // ncclGetUniqueId starts NCCL's bootstrap root in the process that calls
  // it, so leader 0's measuring child makes the id, hands it up the pipe at
  // once, and goes on to its own init; the parent forwards it over MPI.
  const bool first = leaders.rank() == 0;
  std::string id;
  if (!first) {
    auto got = leaders.recv(0, kNcclIdTag, deadline);
    if (!got || got->empty()) {
      r.status = CheckStatus::kError;
      r.reason = got ? "the first node could not create an NCCL id" : "the NCCL id from the first node did not arrive by the deadline";
      return r;
    }
    id = from_hex(*got);
  }
  bool forwarded = false;
  auto forward = [&](const std::string& hex) {
    forwarded = true;
    auto shared = std::make_shared<const std::string>(hex);
    for (int p = 1; p < n; ++p) leaders.send(p, kNcclIdTag, shared, deadline);
  };
  const ForkOutcome f = run_forked(
      [&]() -> std::string {
        hw::gpu::NcclPeers peers{id, leaders.rank(), n};
        if (first) {
          auto u = hw::gpu::nccl_unique_id();
          fork_emit((u ? to_hex(*u) : std::string()) + "\n");
          if (!u) return nlohmann::json{{"error", u.error().message}}.dump();
          peers.unique_id = *u;
        }
        auto res = hw::gpu::nccl_all_reduce(r.bytes, passes, &peers);
        if (!res) return nlohmann::json{{"error", res.error().message}}.dump();
        return nlohmann::json{{"algbw", res->algbw}, {"busbw", res->busbw}, {"correct", res->correct},
                              {"devices", res->devices}, {"nccl", res->nccl_version}}
            .dump();
      },
      std::max(0.1, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count()),
      [&](const std::string& so_far) {
        if (first && !forwarded)
          if (auto nl = so_far.find('\n'); nl != std::string::npos) forward(so_far.substr(0, nl));
      });
  // An empty id tells the others not to wait for one.
  if (first && !forwarded) forward("");
  const std::string tail = f.data.substr(f.data.find('\n') == std::string::npos ? 0 : f.data.rfind('\n') + 1);
  const auto res = nlohmann::json::parse(tail, nullptr, false);
  if (!f.error.empty() || res.is_discarded() || res.contains("error")) {
    r.status = CheckStatus::kError;
    r.reason = !f.error.empty() ? "NCCL " + f.error + " (a node's NCCL init or transfer hung, or another node failed)"
               : res.is_discarded() ? "NCCL returned no readable result"
                                    : res["error"].get<std::string>();
    return r;
  }
  r.algbw_gbps = res.value("algbw", 0.0);
  r.busbw_gbps = res.value("busbw", 0.0);
  const bool correct = res.value("correct", false);
  r.status = correct ? CheckStatus::kPass : CheckStatus::kFail;
  r.reason = correct ? fmt::format("ncclAllReduce of {} float32 over {} GPUs on {} nodes, NCCL {}, median of {}",
                                   format_bytes(double(r.bytes)), res.value("devices", 0), n, res.value("nccl", std::string()), passes)
                     : "wrong result: a GPU's data was lost or counted twice";
  return r;
}

}  // namespace pacer::vet
