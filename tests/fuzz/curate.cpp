// Fuzzes pacer curate's parsers of untrusted input: the input as a filter expression (parsed, then
// every clause evaluated against a row whose values cycle through the JSON types), and as a fastText
// model file (checked before libfasttext may read it).
#include <cstdint>

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
  static const std::string path = fuzz::scratch() + "/model.bin";
  fuzz::write_bytes(path, data, size);
  (void)curate::Model::load(path);
  return 0;
}
