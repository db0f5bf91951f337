// Internal: what a loader reads (Loader::Source), shared by the loader (loader.cpp) and blends (blend.cpp).
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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
  // Work for epoch `epoch` that can be done before it starts (a token
  // source's shuffled packing plan), called by an idle reader once the
  // current epoch is fully scheduled, so the next one does not start with it.
  virtual void prepare(std::uint64_t /*seed*/, std::uint64_t /*epoch*/) {}
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

  // Token sources. One row's metadata: its real tokens, those cut by
  // seq_len, and its segments as (end within the row, document; -1 for the
  // padded tail).
  struct TokenRow {
    std::uint64_t length = 0;
    std::uint64_t truncated = 0;
    std::vector<std::pair<std::uint64_t, std::int64_t>> segments;
  };
  // Whether rows carry labels and a loss mask.
  virtual bool token_labels() const { return false; }
  // The columns rows [lo, hi) need: seq_len packed, else their longest
  // document cut to seq_len.
  virtual std::uint64_t token_cols(std::uint64_t /*seed*/, std::uint64_t /*epoch*/, std::uint64_t /*lo*/, std::uint64_t /*hi*/) { return 0; }
  // Writes rows [lo, hi) straight into rows dest[0 .. hi-lo) of b (laid out
  // by allocate_token_rows with `cols` >= token_cols columns), padding each,
  // and their metadata into rows[dest[k]]. A blend fills its batch this way,
  // each child its own rows, with no scratch batch and second copy.
  virtual Status fill_token_rows(std::uint64_t /*seed*/, std::uint64_t /*epoch*/, std::uint64_t /*lo*/, std::uint64_t /*hi*/, Batch& /*b*/,
                                 std::uint64_t /*cols*/, const std::uint64_t* /*dest*/, TokenRow* /*rows*/) {
    return Error{ErrorKind::kRuntime, "not a token source"};
  }
};

// The sources of one dataset, with the option checks Loader::open makes
// (all but the world size, which the caller checks against what it reads).
Expected<std::unique_ptr<Loader::Source>> make_sample_source(std::shared_ptr<Dataset> ds, const LoaderOptions& o);
Expected<std::unique_ptr<Loader::Source>> make_token_source(std::shared_ptr<TokenDataset> ds, LoaderOptions o);
// Checks rank, world size and batch size against `items` per epoch.
Status check_loader_options(const LoaderOptions& o, std::uint64_t items, const char* what, const std::string& name);

// The counts of a saved state (seed, epoch, position, per-dataset counts)
// must be non-negative JSON integers, or arrays of them: nlohmann's get
// would turn -1 into 2^64-1 and 1.5 or 1e30 into whatever the cast gives.
// Checks the keys of `s` that are present; the error names `where`.key.
Status check_state_counts(const nlohmann::json& s, std::initializer_list<const char*> keys, std::string_view where);

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

// Appends the metadata of rows (in batch order) to b: cu_seqlens over the
// flattened rows x cols, documents, lengths, padding and truncation.
inline void append_token_rows(Batch& b, std::uint64_t cols, const std::vector<Loader::Source::TokenRow>& rows) {
  b.cu_seqlens.assign(1, 0);
  for (std::uint64_t r = 0; r < rows.size(); ++r) {
    for (const auto& [end, doc] : rows[r].segments) {
      b.cu_seqlens.push_back(static_cast<std::int32_t>(r * cols + end));
      b.documents.push_back(doc);
    }
    b.lengths.push_back(static_cast<std::int64_t>(rows[r].length));
    b.padding += cols - rows[r].length;
    b.truncated += rows[r].truncated;
  }
}

// Opens sft_mask_prefix(tokens.prefix()) into `mask` when it exists (not for
// a prefix that is itself a mask), checking that it has the tokens' shape.
Status attach_loss_mask(const TokenDataset& tokens, std::shared_ptr<TokenDataset>& mask);

}  // namespace pacer::data
