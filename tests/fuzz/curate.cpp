// Fuzzes pacer curate's parsers of untrusted input: the input as a filter expression (parsed, then
// every clause evaluated against a row whose values cycle through the JSON types), as a JSON line
// (the simdjson path must give the nlohmann reference's verdict, text, id and reason), and as a
// fastText model file (checked before libfasttext may read it).
#include <cstdint>

#include "curate/curate_internal.hpp"
#include "fuzz.hpp"
#include "pacer/curate.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (auto e = curate::Expr::parse(text)) {
    const nlohmann::json values[] = {nullptr, true, 0.5, "en", 0};
    std::size_t k = 0;
    auto lookup = [&](const std::string&) -> const nlohmann::json& { return values[k++ % 5]; };
    const auto clauses = e->clauses();
    PACER_FUZZ_CHECK(!clauses.empty(), "an expression of %zu bytes parsed to no clause", size);
    for (std::size_t c = 0; c < clauses.size(); ++c) (void)e->eval_clause(c, lookup);
  }
  {
    static curate::SampleParser parser;
    static const curate::Input in{"/fuzz/set.jsonl", "jsonl", 0, ""};
    curate::RawChunk c;
    c.in = &in;
    c.base = "set.jsonl";
    const std::string padded = text + std::string(64, '\0');  // as the block reader leaves it
    for (auto kind : {curate::RawSample::Kind::kJsonLine, curate::RawSample::Kind::kShardJson}) {
      const curate::RawSample s{kind, 1, std::string_view(padded.data(), size), "k1"};
      std::string_view fast_text, ref_text;
      std::string fast_id, ref_id, fast_why, ref_why;
      const bool fast = parser.parse(c, s, fast_text, &fast_id, fast_why);
      const std::string fast_copy(fast_text);
      const bool ref = parser.parse_reference(c, s, ref_text, &ref_id, ref_why);
      PACER_FUZZ_CHECK(fast == ref, "a line of %zu bytes: fast path %d, reference %d (%s)", size, fast, ref, ref_why.c_str());
      PACER_FUZZ_CHECK(!ref || (fast_copy == ref_text && fast_id == ref_id), "a line of %zu bytes: text or id differ", size);
      PACER_FUZZ_CHECK(ref || fast_why == ref_why, "a line of %zu bytes: '%s' vs '%s'", size, fast_why.c_str(), ref_why.c_str());
    }
  }
  static const std::string path = fuzz::scratch() + "/model.bin";
  fuzz::write_bytes(path, data, size);
  (void)curate::Model::load(path);
  return 0;
}
