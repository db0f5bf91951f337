// Fuzzes the Megatron .idx reader: arbitrary bytes as the .idx of a fixed, real token file
// (fixtures/tokens.bin), then every sequence and document read and packed through it.
#include <numeric>

#include "fuzz.hpp"
#include "pacer/data.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string prefix = fuzz::scratch() + "/tokens";
  static const std::string bin = fuzz::place_fixture("tokens.bin", "tokens.bin");
  fuzz::write_bytes(prefix + ".idx", data, size);

  auto ds = data::TokenDataset::open(prefix);
  if (!ds) return 0;
  const data::TokenDataset& t = **ds;
  // Bounded: a valid index may name millions of empty sequences.
  const std::uint64_t seqs = std::min<std::uint64_t>(t.sequences(), 4096);
  for (std::uint64_t s = 0; s < seqs; ++s) {
    auto r = t.read(s);
    if (r) PACER_FUZZ_CHECK(r->size() == t.length(s), "sequence %llu: %zu tokens read, length %llu", (unsigned long long)s, r->size(),
                            (unsigned long long)t.length(s));
  }
  const std::uint64_t docs = std::min<std::uint64_t>(t.documents(), 256);
  std::vector<std::int64_t> out;
  for (std::uint64_t d = 0; d < docs; ++d) {
    const auto [first, last] = t.document(d);
    PACER_FUZZ_CHECK(first <= last && last <= t.sequences(), "document %llu: sequences [%llu, %llu) of %llu",
                     (unsigned long long)d, (unsigned long long)first, (unsigned long long)last,
                     (unsigned long long)t.sequences());
    const std::uint64_t n = std::min<std::uint64_t>(t.document_tokens(d), 1 << 16);
    out.resize(n);
    (void)t.copy_tokens(d, 0, n, out.data());
  }
  std::vector<std::uint64_t> order(docs);
  std::iota(order.begin(), order.end(), 0);
  auto plan = data::plan_packing(t, order, 16, 8);
  auto packed = data::pack_documents(t, order, 16, 8, -1);
  if (plan && packed)
    PACER_FUZZ_CHECK(plan->rows() == packed->size(), "plan_packing: %llu rows, pack_documents: %zu",
                     (unsigned long long)plan->rows(), packed->size());
  return 0;
}
