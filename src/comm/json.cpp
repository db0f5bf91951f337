// The JSON record of a broadcast (pacer.bcast/1); bench and tune keep theirs beside their code.
#include <fmt/format.h>

#include "pacer/comm/bcast.hpp"

namespace pacer::comm {

nlohmann::json to_json(const BcastReport& r) {
  const auto& st = r.stats;
  nlohmann::json compare = nullptr;
  if (r.every_rank_reads) compare = {{"bytes_read", r.every_rank_reads->bytes_read}, {"seconds", r.every_rank_reads->seconds}};
  return {{"schema", "pacer.bcast/1"}, {"src", r.src},       {"dst", r.dst},       {"ranks", r.ranks},
          {"nodes", st.nodes},         {"files", st.files},  {"bytes", st.bytes},  {"bytes_read", st.bytes_read},
          {"chunks", st.chunks},       {"chunk_bytes", r.chunk_bytes}, {"xxh3", fmt::format("{:016x}", st.xxh3)},
          {"seconds", st.seconds},     {"unchanged", st.unchanged}, {"every_rank_reads", compare}};
}

}  // namespace pacer::comm
