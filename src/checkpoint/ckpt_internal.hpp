// Internal: pieces of the checkpoint format shared by the reader, the writer and retention.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/checkpoint.hpp"

namespace pacer::ckpt {

// A save in progress lives in ".partial-step-<step>-<host>-<pid>-<nonce>"
// until it is renamed to its step name; a crash leaves it for cleanup.
struct TempName {
  std::uint64_t step = 0;
  std::string host;
  int pid = 0;
};
std::string temp_dir_name(std::uint64_t step, const std::string& host, int pid);
std::optional<TempName> parse_temp_dir_name(const std::string& name);

// A .partial-* directory that no saver can still be filling: its saver's pid
// is gone on this host, or (a saver on another host, which this host cannot
// ask) a step at or after its own is committed on the same tier and nothing
// in it was modified for `stale_after_s`. One whose pid is alive on this host
// is never stale. `why` says which rule applied.
struct StalePartial {
  std::string path;
  std::uint64_t step = 0;
  std::string why;
  bool saver_gone_here = false;  // the first rule: a crash on this host, removed without a warning
};
std::vector<StalePartial> stale_partials(const std::string& tier, const std::string& this_host, double stale_after_s);

// The manifest without its self-checksum.
nlohmann::json manifest_body(const Manifest& m);

// The blobs of a manifest fit together: a shape that says the blob's size,
// one entry per replicated name, and shards of one name that agree on dtype
// and global size and shape, lie inside it without overlapping and, when the
// manifest is `complete` (not one node's share), cover it exactly. What the
// checksums cannot see (pieces cut differently) and what a loader would
// allocate from (shapes, global sizes) are checked here, before any read.
Status check_layout(const Manifest& m, bool complete, const std::string& source);

// Removes a step directory (or a damaged or partial one): false, and nothing
// done, while a Reader holds it.
Expected<bool> remove_checkpoint_dir(const std::string& path);

// A damaged step moved aside by a save of the same step lives in
// ".damaged-step-<step>-<UTC time>-<pid>": never a checkpoint, listed as
// damaged, removed by `pacer ckpt prune --remove-damaged`.
inline constexpr const char* kDamagedPrefix = ".damaged-";
std::string damaged_dir_name(std::uint64_t step, int pid);
std::optional<std::uint64_t> parse_damaged_dir_name(const std::string& name);
// Renames a damaged step directory to its .damaged-* name; an error when a
// Reader holds it. Returns the new path.
Expected<std::string> move_aside_damaged(const std::string& step_dir, std::uint64_t step);

// Checks every checksum of a step, or answers from this process's cache of
// earlier checks of the same bytes.
Status verify_step(const std::string& step_dir);
// Records a step this process has just written as valid without reading it back.
void note_verified(const std::string& step_dir, const Manifest& m);

// Steps to delete from a tier, given its valid-candidate steps newest first.
std::vector<std::uint64_t> retention_victims(const std::vector<std::uint64_t>& committed_desc, int keep_last, int keep_every);

// What retention would do to one directory (see prune() in checkpoint.hpp).
struct RetentionPlan {
  std::optional<std::uint64_t> newest_valid;
  std::vector<std::uint64_t> victims;  // newest first
  std::vector<std::uint64_t> kept;
  std::vector<Entry> damaged;
  std::map<std::uint64_t, std::string> paths;  // of the candidates
};
RetentionPlan plan_retention(const std::string& root, int keep_last, int keep_every);
// rename(2) that refuses to replace an existing target where the filesystem allows.
Status rename_no_replace(const std::string& from, const std::string& to);

// Several ranks given the same replicated blobs write each byte once. The
// blobs, ordered by name, are cut into one contiguous byte range per rank, at
// 4 KiB boundaries of a blob (whole elements of every dtype); a blob under
// `whole_below` bytes goes whole to the rank with the fewest bytes so far.
// Every rank computes the same pieces from the same list.
struct ReplicatedPiece {
  std::size_t blob = 0;  // index into the blobs given
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  int rank = 0;
};
std::vector<ReplicatedPiece> split_replicated(const std::vector<BlobView>& blobs, int ranks,
                                              std::uint64_t whole_below = 1ull << 20);

}  // namespace pacer::ckpt
