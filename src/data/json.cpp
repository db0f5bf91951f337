// The JSON records of `pacer shard index` and `pacer shard tokenize` (pack, inspect and verify: pack.cpp).
#include "pacer/data.hpp"

namespace pacer::data {

using nlohmann::json;

json to_json(const IndexReport& report) {
  json shards = json::array();
  for (const auto& s : report.shards)
    shards.push_back({{"path", s.path}, {"samples", s.samples}, {"bytes", s.bytes}, {"index", s.index}});
  return {{"schema", "pacer.shard.index/1"}, {"shards", shards}, {"samples", report.samples}};
}

json to_json(const TokenizeReport& report, const std::string& input, const std::string& prefix,
             const std::string& vocabulary_file, std::size_t vocabulary_size) {
  return {{"schema", "pacer.shard.tokenize/1"}, {"input", input}, {"prefix", prefix},
          {"vocabulary", vocabulary_file.empty() ? json(nullptr) : json(vocabulary_file)},
          {"vocabulary_size", vocabulary_size}, {"documents", report.documents}, {"tokens", report.tokens},
          {"bytes", report.bytes}, {"fallback_bytes", report.fallback_bytes}, {"dtype", report.dtype}};
}

}  // namespace pacer::data
