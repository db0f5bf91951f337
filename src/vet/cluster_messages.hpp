// Internal: JSON messages between the cluster vet's ranks, each under a deadline.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "pacer/comm/timed.hpp"
#include "pacer/vet/check.hpp"

namespace pacer::vet {

inline bool send_json(comm::TimedComm& c, int peer, int tag, const nlohmann::json& j, comm::Deadline d) {
  return c.send(peer, tag, std::make_shared<const std::string>(j.dump()), d);
}

// nullopt at the deadline or for a message that is not JSON.
inline std::optional<nlohmann::json> recv_json(comm::TimedComm& c, int peer, int tag, comm::Deadline d) {
  auto s = c.recv(peer, tag, d);
  if (!s) return std::nullopt;
  nlohmann::json j = nlohmann::json::parse(*s, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// Figures and statuses in the messages: null for a figure not measured, and
// a status that does not parse reads as error.
inline nlohmann::json number_or_null(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }
inline std::optional<double> number_at(const nlohmann::json& j, const char* key) {
  if (j.contains(key) && j[key].is_number()) return j[key].get<double>();
  return std::nullopt;
}
inline CheckStatus status_at(const nlohmann::json& j) {
  auto s = parse_status(j.value("status", "error"));
  return s ? *s : CheckStatus::kError;
}

}  // namespace pacer::vet
