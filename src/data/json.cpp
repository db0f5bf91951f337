// The JSON record of `pacer shard index` (pack, inspect and verify: pack.cpp; tokenize: tokenize.cpp).
#include "pacer/data.hpp"

namespace pacer::data {

using nlohmann::json;

json to_json(const IndexReport& report) {
  json shards = json::array();
  for (const auto& s : report.shards)
    shards.push_back({{"path", s.path}, {"samples", s.samples}, {"bytes", s.bytes}, {"index", s.index}});
  return {{"schema", "pacer.shard.index/1"}, {"shards", shards}, {"samples", report.samples}};
}

}  // namespace pacer::data
