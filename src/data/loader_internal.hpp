// Internal: what a loader reads (Loader::Source), shared by the loader (loader.cpp) and blends (blend.cpp).
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "pacer/data.hpp"

namespace pacer::data {

// An epoch is a sequence of positions, each an item (a sample, a document or
// a packed row) that `fill` reads into a batch.
struct Loader::Source {
  virtual ~Source() = default;
  // The dataset, for messages.
  virtual std::string name() const = 0;
  // Items the dataset holds (what a saved state is checked against).
  virtual std::uint64_t items() const = 0;
  // How positions map to items: part of the state, checked on load.
  virtual std::string order() const = 0;
  // The order string states saved before it named everything it depends on
  // (the global batch); such a state applies when its global_batch matches.
  virtual std::string legacy_order() const { return ""; }
  // Positions in epoch `epoch`.
  virtual std::uint64_t epoch_size(std::uint64_t seed, std::uint64_t epoch) = 0;
  // Reads positions [lo, hi) of the epoch into b (its buffer already set);
  // `bytes` gets the payload, `skipped` what skip_bad dropped. Appends to
  // what b already holds where the batch kind allows it (tar samples).
  virtual Status fill(std::uint64_t seed, std::uint64_t epoch, std::uint64_t lo, std::uint64_t hi, Batch& b, std::uint64_t& bytes,
                      std::uint64_t& skipped) = 0;
  // What the state needs beyond (seed, epoch, position), added to `state`.
  virtual void save_state(nlohmann::json& /*state*/, std::uint64_t /*epoch*/, std::uint64_t /*position*/) {}
  // Checks those additions before anything changes (an error names the key
  // or dataset), then applies them once every other check has passed.
  virtual Status check_state(const nlohmann::json& /*state*/, std::uint64_t /*seed*/, std::uint64_t /*epoch*/, std::uint64_t /*position*/) {
    return {};
  }
  virtual void apply_state(const nlohmann::json& /*state*/, std::uint64_t /*epoch*/, std::uint64_t /*position*/) {}
};

// The sources of one dataset, with the option checks Loader::open makes
// (all but the world size, which the caller checks against what it reads).
Expected<std::unique_ptr<Loader::Source>> make_sample_source(std::shared_ptr<Dataset> ds, const LoaderOptions& o);
Expected<std::unique_ptr<Loader::Source>> make_token_source(std::shared_ptr<TokenDataset> ds, LoaderOptions o);
// Checks rank, world size and batch size against `items` per epoch.
Status check_loader_options(const LoaderOptions& o, std::uint64_t items, const char* what, const std::string& name);

// Lays out a token batch's arrays in its buffer: rows x cols tokens and
// position ids, and with `labels` the labels and loss mask.
inline void allocate_token_rows(Batch& b, std::uint64_t rows, std::uint64_t cols, bool labels) {
  b.rows = rows;
  b.cols = cols;
  b.tokens_offset = b.buffer->append(rows * cols * sizeof(std::int64_t));
  b.positions_offset = b.buffer->append(rows * cols * sizeof(std::int32_t));
  if (!labels) return;
  b.has_labels = true;
  b.labels_offset = b.buffer->append(rows * cols * sizeof(std::int64_t));
  b.loss_mask_offset = b.buffer->append(rows * cols);
}

// Opens sft_mask_prefix(tokens.prefix()) into `mask` when it exists (not for
// a prefix that is itself a mask), checking that it has the tokens' shape.
Status attach_loss_mask(const TokenDataset& tokens, std::shared_ptr<TokenDataset>& mask);

}  // namespace pacer::data
