// Fuzzes checkpoint manifests: arbitrary bytes as MANIFEST.json, parsed as they come and again with
// their self-checksum made right (else nearly every mutation stops there), then opened, listed,
// verified and loaded over the data files of a fixed, real checkpoint (fixtures/ckpt).
#include <fmt/format.h>
#include <xxhash.h>

#include <deque>
#include <nlohmann/json.hpp>

#include "fuzz.hpp"
#include "pacer/checkpoint.hpp"

using namespace pacer;
using nlohmann::json;

namespace {

// The manifest's self-checksum as the writer computes it: XXH3-64 of the compact dump without the key.
std::string with_checksum(const std::uint8_t* data, std::size_t size) {
  json j = json::parse(data, data + size, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return {};
  j.erase("manifest_xxh3");
  const std::string body = j.dump();
  j["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
  return j.dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The fixture is step 7: a manifest for another step is refused by the directory's name, as it should be.
  static const std::string root = fuzz::scratch() + "/root";
  static const std::string step_dir = [] {
    std::filesystem::create_directories(root);
    return fuzz::place_fixture("ckpt", "root/" + ckpt::step_dir_name(7));
  }();
  const std::string manifest = step_dir + "/" + ckpt::kManifestName;

  (void)ckpt::manifest_from_json(std::string(reinterpret_cast<const char*>(data), size), manifest);
  const std::string text = with_checksum(data, size);
  if (text.empty()) return 0;
  auto m = ckpt::manifest_from_json(text, manifest);
  if (!m) return 0;

  fuzz::write_bytes(manifest, reinterpret_cast<const std::uint8_t*>(text.data()), text.size());
  auto r = ckpt::Reader::open(step_dir);
  if (r) {
    for (const auto& b : r->logical_blobs()) {
      if (b.size > (1u << 20)) continue;
      std::string dst(b.size, '\0');
      (void)r->read(b.name, dst.data(), b.size);
    }
    (void)r->verify_all();
  }
  (void)ckpt::list(root, true);

  ckpt::Options o;
  o.root = root;
  o.keep_last = 0;  // never prune the fixture
  o.warn = [](const std::string&) {};
  auto c = ckpt::Checkpointer::open(o);
  if (!c) return 0;
  (void)(*c)->latest();
  // As a loader would allocate: for what the manifest says, within reason.
  std::deque<std::string> targets;  // a deque: earlier targets stay where they are
  (void)(*c)->load([&](const ckpt::Reader::Logical& b) {
    if (b.size > (1u << 20)) return ckpt::LoadTarget{};
    targets.emplace_back(b.size, '\0');
    return ckpt::LoadTarget{targets.back().data(), 0, b.size};
  });
  return 0;
}
