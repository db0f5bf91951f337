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
  int gpus = 0;
  std::string id;
  std::string id_error;
  {
    const bool first = leaders.rank() == 0;
    const ForkOutcome f = run_forked(
        [first]() -> std::string {
          nlohmann::json j;
          auto n = hw::gpu::device_count();
          j["gpus"] = n ? *n : 0;
          if (first && n && *n > 0) {
            if (auto u = hw::gpu::nccl_unique_id()) j["id"] = to_hex(*u);
            else j["id_error"] = u.error().message;
          }
          return j.dump();
        },
        std::max(0.1, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count()));
    const auto j = nlohmann::json::parse(f.data, nullptr, false);
    if (!f.error.empty() || j.is_discarded()) {
      id_error = "looking for GPUs: " + (f.error.empty() ? std::string("no readable answer") : f.error);
    } else {
      gpus = j.value("gpus", 0);
      id = from_hex(j.value("id", ""));
      id_error = j.value("id_error", "");
    }
  }
  // Every leader learns whether all nodes can take part before any enters
  // NCCL's init, which would otherwise wait for the missing ones.
  auto agree = std::make_shared<std::vector<float>>(std::vector<float>{
      gpus > 0 ? 1.0f : 0.0f, float(gpus), float(gpus) * float(gpus), leaders.rank() == 0 && id.empty() ? 1.0f : 0.0f});
  if (!leaders.all_reduce_sum(agree, deadline)) {
    r.status = CheckStatus::kError;
    r.reason = "a node did not take part by the deadline";
    return r;
  }
  const auto& a = *agree;
  const int n = leaders.size();
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
  if (a[3] > 0) {
    r.status = CheckStatus::kError;
    r.reason = leaders.rank() == 0 ? id_error : "the first node could not create an NCCL id";
    return r;
  }
  if (leaders.rank() == 0) {
    auto shared = std::make_shared<const std::string>(id);
    for (int p = 1; p < n; ++p) leaders.send(p, kNcclIdTag, shared, deadline);
  } else if (auto got = leaders.recv(0, kNcclIdTag, deadline)) {
    id = *got;
  } else {
    r.status = CheckStatus::kError;
    r.reason = "the NCCL id from the first node did not arrive by the deadline";
    return r;
  }

  const hw::gpu::NcclPeers peers{id, leaders.rank(), n};
  const ForkOutcome f = run_forked(
      [&]() -> std::string {
        auto res = hw::gpu::nccl_all_reduce(r.bytes, passes, &peers);
        if (!res) return nlohmann::json{{"error", res.error().message}}.dump();
        return nlohmann::json{{"algbw", res->algbw}, {"busbw", res->busbw}, {"correct", res->correct},
                              {"devices", res->devices}, {"nccl", res->nccl_version}}
            .dump();
      },
      std::max(0.1, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count()));
  const auto res = nlohmann::json::parse(f.data, nullptr, false);
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
