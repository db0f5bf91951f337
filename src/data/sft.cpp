// SFT data: a token dataset with a parallel uint8 loss mask (PREFIX.mask.bin/.idx).
#include <fmt/format.h>
#include <sys/stat.h>

#include "loader_internal.hpp"
#include "pacer/data.hpp"

namespace pacer::data {

std::string sft_mask_prefix(const std::string& prefix) { return prefix + ".mask"; }

Status attach_loss_mask(const TokenDataset& tokens, std::shared_ptr<TokenDataset>& mask) {
  const std::string& prefix = tokens.prefix();
  if (prefix.ends_with(".mask")) return {};
  const std::string mp = sft_mask_prefix(prefix);
  struct stat st {};
  if (::stat((mp + ".idx").c_str(), &st) != 0) return {};
  auto m = TokenDataset::open(mp);
  if (!m) return m.error();
  const std::string idx = mp + ".idx";
  auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}: {} (the loss mask of {})", idx, why, prefix)}; };
  if ((*m)->dtype() != "uint8") return bad(fmt::format("dtype {}, a loss mask is uint8", (*m)->dtype()));
  if ((*m)->sequences() != tokens.sequences() || (*m)->documents() != tokens.documents())
    return bad(fmt::format("{} sequences in {} documents, the tokens have {} in {}", (*m)->sequences(), (*m)->documents(), tokens.sequences(),
                           tokens.documents()));
  for (std::uint64_t q = 0; q < tokens.sequences(); ++q)
    if ((*m)->length(q) != tokens.length(q))
      return bad(fmt::format("sequence {} has {} elements, its tokens {}", q, (*m)->length(q), tokens.length(q)));
  for (std::uint64_t d = 0; d < tokens.documents(); ++d)
    if ((*m)->document(d) != tokens.document(d)) return bad(fmt::format("document {} has other sequence boundaries than its tokens", d));
  mask = std::move(*m);
  return {};
}

Status write_sft_dataset(const std::string& prefix, const std::string& dtype, const std::vector<std::vector<std::int64_t>>& documents,
                         const std::vector<std::vector<std::uint8_t>>& masks) {
  if (masks.size() != documents.size())
    return Error{ErrorKind::kUsage, fmt::format("{}: {} masks for {} documents", prefix, masks.size(), documents.size())};
  std::vector<std::vector<std::int64_t>> wide(masks.size());
  for (std::size_t d = 0; d < masks.size(); ++d) {
    if (masks[d].size() != documents[d].size())
      return Error{ErrorKind::kUsage, fmt::format("{}: document {} has {} tokens and a mask of {}", prefix, d, documents[d].size(), masks[d].size())};
    wide[d].reserve(masks[d].size());
    for (auto v : masks[d]) {
      if (v > 1) return Error{ErrorKind::kUsage, fmt::format("{}: document {}: mask value {} (0 or 1)", prefix, d, int(v))};
      wide[d].push_back(v);
    }
  }
  if (Status st = write_token_dataset(sft_mask_prefix(prefix), "uint8", wide); !st) return st;
  return write_token_dataset(prefix, dtype, documents);
}

}  // namespace pacer::data
