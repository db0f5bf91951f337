// The JSON record of `pacer ports --json` (pacer.ports/1).
#include "pacer/run/ports.hpp"

namespace pacer::run {

nlohmann::json to_json(const PortScope& scope, const std::pair<int, int>& range, const std::vector<int>& ports,
                       const LocalPorts& local) {
  return {{"schema", "pacer.ports/1"}, {"job", scope.job}, {"job_from", scope.job_from},
          {"local_rank", scope.local_rank}, {"local_rank_from", scope.rank_from},
          {"range", {range.first, range.second}}, {"ports", ports},
          {"ephemeral", {local.ephemeral_first, local.ephemeral_last}}, {"ephemeral_from", local.source},
          {"reserved", local.reserved}};
}

}  // namespace pacer::run
