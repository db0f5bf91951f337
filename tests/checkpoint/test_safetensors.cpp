// safetensors export: the blobs under a prefix, named by the rest of their
// name, in files a safetensors reader parses (checked here by a reader written
// from the format's description), sharded with a Hugging Face index.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/checkpoint.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = pacer::ckpt;
using nlohmann::json;
using pacer::test::contains;
using pacer::test::TempDir;

struct Blob {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;
};

Blob blob(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape, int seed) {
  std::uint64_t n = ckpt::dtype_size(dtype);
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  Blob b{name, dtype, std::move(shape), std::vector<unsigned char>(n)};
  for (std::size_t i = 0; i < n; ++i) b.bytes[i] = static_cast<unsigned char>(seed * 31 + i * 7);
  return b;
}

// Saves the blobs as step `step` under root; returns a Reader of it.
ckpt::Reader save(const std::string& root, std::uint64_t step, const std::vector<Blob>& blobs) {
  ckpt::Options o;
  o.root = root;
  o.keep_last = 0;
  o.chunk_bytes = 4096;
  o.staging_bytes = 1 << 20;
  o.pin_staging = false;
  auto ck = ckpt::Checkpointer::open(o).value();
  std::vector<ckpt::BlobView> views;
  for (const auto& b : blobs) {
    ckpt::BlobView v;
    v.name = b.name;
    v.data = b.bytes.data();
    v.size = b.bytes.size();
    v.dtype = b.dtype;
    v.shape = b.shape;
    views.push_back(v);
  }
  auto h = ck->save(step, views);
  EXPECT_TRUE(h) << h.error().message;
  EXPECT_TRUE(h->wait());
  return ckpt::Reader::open(root + "/" + ckpt::step_dir_name(step)).value();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A safetensors file as the format describes it: u64 little-endian header
// size, the JSON header, then the data; tensors by name.
struct Parsed {
  json header;
  std::uint64_t header_len = 0;
  std::map<std::string, std::string> data;  // name -> bytes
  std::string error;
};

Parsed failed(const std::string& why) {
  Parsed p;
  p.error = why;
  return p;
}

Parsed parse(const std::string& path) {
  Parsed p;
  const std::string f = slurp(path);
  if (f.size() < 8) return failed("shorter than 8 bytes");
  for (int i = 7; i >= 0; --i) p.header_len = (p.header_len << 8) | static_cast<unsigned char>(f[i]);
  if (8 + p.header_len > f.size()) return failed("header beyond the file");
  const std::string text = f.substr(8, p.header_len);
  p.header = json::parse(text, nullptr, false);
  if (p.header.is_discarded()) return failed("header is not JSON: " + text);
  const std::uint64_t base = 8 + p.header_len;
  std::uint64_t expect = 0;  // data offsets are contiguous, in increasing order
  std::vector<std::pair<std::uint64_t, std::string>> order;
  for (auto& [k, v] : p.header.items())
    if (k != "__metadata__") order.emplace_back(v["data_offsets"][0].get<std::uint64_t>(), k);
  std::sort(order.begin(), order.end());
  for (const auto& [begin, k] : order) {
    const auto& v = p.header[k];
    const std::uint64_t end = v["data_offsets"][1].get<std::uint64_t>();
    if (begin != expect || end < begin) return failed("offsets of '" + k + "' are not contiguous");
    expect = end;
    p.data[k] = f.substr(base + begin, end - begin);
  }
  if (base + expect != f.size()) return failed(fmt::format("{} bytes of data, file has {}", expect, f.size() - base));
  return p;
}

std::string as_string(const std::vector<unsigned char>& v) { return std::string(v.begin(), v.end()); }

TEST(SafetensorsExport, ModelBlobsInOneFileNamedByTheRestOfTheirName) {
  TempDir dir("pacer-st-");
  const std::vector<Blob> blobs = {blob("model/a", "float32", {2, 3}, 1), blob("model/b", "bfloat16", {5}, 2),
                                   blob("model/layers.0.weight", "float8_e4m3fn", {4, 4}, 3), blob("model/step", "int64", {}, 4),
                                   blob("optim/x", "float32", {7}, 5)};
  auto r = save(dir.path() + "/root", 7, blobs);
  const std::string out = dir.path() + "/hf";
  auto res = ckpt::export_safetensors(r, out, {});
  ASSERT_TRUE(res) << res.error().message;
  EXPECT_EQ(res->step, 7u);
  EXPECT_EQ(res->tensors, 4u);
  EXPECT_EQ(res->files, std::vector<std::string>{out + "/model.safetensors"});
  Parsed p = parse(out + "/model.safetensors");
  ASSERT_EQ(p.error, "");
  EXPECT_EQ((8 + p.header_len) % 8, 0u) << "the data must start 8-byte aligned";
  EXPECT_EQ(p.header["__metadata__"], json({{"format", "pt"}}));
  EXPECT_EQ(p.header.size(), 5u);  // four tensors and the metadata: no optim/x
  EXPECT_FALSE(p.header.contains("optim/x"));
  EXPECT_EQ(p.header["a"]["dtype"], "F32");
  EXPECT_EQ(p.header["a"]["shape"], json({2, 3}));
  EXPECT_EQ(p.header["b"]["dtype"], "BF16");
  EXPECT_EQ(p.header["layers.0.weight"]["dtype"], "F8_E4M3");
  EXPECT_EQ(p.header["step"]["dtype"], "I64");
  EXPECT_EQ(p.header["step"]["shape"], json::array());
  EXPECT_EQ(p.data["a"], as_string(blobs[0].bytes));
  EXPECT_EQ(p.data["b"], as_string(blobs[1].bytes));
  EXPECT_EQ(p.data["layers.0.weight"], as_string(blobs[2].bytes));
  EXPECT_EQ(p.data["step"], as_string(blobs[3].bytes));
  std::uint64_t tensor_bytes = 0;
  for (int i = 0; i < 4; ++i) tensor_bytes += blobs[i].bytes.size();
  EXPECT_EQ(res->bytes, tensor_bytes);
  // Nothing but the file: the temporary is gone.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsExport, ShardsWithAnIndexAboveTheMaximumSize) {
  TempDir dir("pacer-st-");
  std::vector<Blob> blobs;
  for (int i = 0; i < 5; ++i) blobs.push_back(blob(fmt::format("model/w{}", i), "float32", {250}, i));  // 1000 bytes each
  blobs.push_back(blob("model/big", "int16", {1500}, 9));                                             // 3000 bytes, over the limit
  auto r = save(dir.path() + "/root", 3, blobs);
  const std::string out = dir.path() + "/hf";
  // A single-file export first: the sharded one replaces it.
  ASSERT_TRUE(ckpt::export_safetensors(r, out, {}));
  auto res = ckpt::export_safetensors(r, out, {.max_shard_bytes = 2500});
  ASSERT_TRUE(res) << res.error().message;
  // Name order: big, w0..w4 -> [big] [w0 w1] [w2 w3] [w4].
  ASSERT_EQ(res->files.size(), 5u);
  EXPECT_EQ(res->files.back(), out + "/model.safetensors.index.json");
  const json index = json::parse(slurp(out + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 8000);
  std::map<std::string, std::string> want_map = {{"big", "model-00001-of-00004.safetensors"}, {"w0", "model-00002-of-00004.safetensors"},
                                                 {"w1", "model-00002-of-00004.safetensors"}, {"w2", "model-00003-of-00004.safetensors"},
                                                 {"w3", "model-00003-of-00004.safetensors"}, {"w4", "model-00004-of-00004.safetensors"}};
  const auto weight_map = index["weight_map"].get<std::map<std::string, std::string>>();
  EXPECT_EQ(weight_map, want_map);
  for (const auto& [name, file] : want_map) {
    Parsed p = parse(out + "/" + file);
    ASSERT_EQ(p.error, "") << file;
    const std::string blob_name = "model/" + name;  // clang before 16 cannot capture a structured binding
    const Blob& b = *std::find_if(blobs.begin(), blobs.end(), [&](const Blob& x) { return x.name == blob_name; });
    EXPECT_EQ(p.data[name], as_string(b.bytes)) << name;
  }
  EXPECT_FALSE(fs::exists(out + "/model.safetensors")) << "the earlier single file would shadow the shards";
  // And back to one file: the shards and the index go.
  ASSERT_TRUE(ckpt::export_safetensors(r, out, {}));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsExport, EmptyPrefixExportsEveryNumericBlob) {
  TempDir dir("pacer-st-");
  const std::vector<Blob> blobs = {blob("model/a", "float32", {2}, 1), blob("optim/x", "uint8", {3}, 2), blob("tokens", "bytes", {5}, 3)};
  auto r = save(dir.path() + "/root", 1, blobs);
  auto res = ckpt::export_safetensors(r, dir.path() + "/hf", {.prefix = ""});
  ASSERT_TRUE(res) << res.error().message;
  Parsed p = parse(dir.path() + "/hf/model.safetensors");
  ASSERT_EQ(p.error, "");
  EXPECT_EQ(p.data.size(), 2u);
  EXPECT_EQ(p.header["model/a"]["dtype"], "F32");
  EXPECT_EQ(p.header["optim/x"]["dtype"], "U8");
  EXPECT_EQ(p.data["optim/x"], as_string(blobs[1].bytes));
}

TEST(SafetensorsExport, UnsupportedDtypeOrNothingToExportIsAnErrorNamingTheBlob) {
  TempDir dir("pacer-st-");
  auto r = save(dir.path() + "/root", 1, {blob("model/a", "float32", {2}, 1), blob("model/z", "complex64", {2}, 2)});
  auto res = ckpt::export_safetensors(r, dir.path() + "/hf", {});
  ASSERT_FALSE(res);
  EXPECT_TRUE(contains(res.error().message, "blob 'model/z'"));
  EXPECT_TRUE(contains(res.error().message, "complex64"));
  EXPECT_FALSE(fs::exists(dir.path() + "/hf/model.safetensors"));
  auto r2 = save(dir.path() + "/root", 2, {blob("model/tok", "bytes", {3}, 1)});
  res = ckpt::export_safetensors(r2, dir.path() + "/hf", {});
  ASSERT_FALSE(res);
  EXPECT_TRUE(contains(res.error().message, "blob 'model/tok'"));
  res = ckpt::export_safetensors(r2, dir.path() + "/hf", {.prefix = "ema"});
  ASSERT_FALSE(res);
  EXPECT_TRUE(contains(res.error().message, "'ema/...'"));
  EXPECT_TRUE(contains(res.error().message, "model/tok"));
}

// A tensor saved as shards by several ranks is one tensor in the export,
// assembled by byte range through Reader::read.
TEST(SafetensorsExport, ShardsOfSeveralRanksBecomeOneTensor) {
  TempDir dir("pacer-st-");
  const std::string root = dir.path() + "/root";
  const Blob whole = blob("model/w", "float32", {6, 500}, 3);  // 12,000 bytes, 3 chunks of 4 KiB
  const std::uint64_t half = 5000;                              // not on a chunk boundary
  pacer::test::ThreadWorld world(2);
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto comm = world.rank(r);
      ckpt::Options o;
      o.root = root;
      o.keep_last = 0;
      o.chunk_bytes = 4096;
      o.staging_bytes = 1 << 20;
      o.pin_staging = false;
      o.comm = comm.get();
      auto ck = ckpt::Checkpointer::open(o).value();
      ckpt::BlobView v;
      v.name = whole.name;
      v.dtype = whole.dtype;
      v.layout = ckpt::Layout::kShard;
      v.shard_offset = r == 0 ? 0 : half;
      v.data = whole.bytes.data() + v.shard_offset;
      v.size = r == 0 ? half : whole.bytes.size() - half;
      v.global_size = whole.bytes.size();
      v.global_shape = whole.shape;
      auto h = ck->save(5, {v});
      if (!h) errors[static_cast<std::size_t>(r)] = h.error().message;
      else if (pacer::Status st = h->wait(); !st) errors[static_cast<std::size_t>(r)] = st.error().message;
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_EQ(errors, std::vector<std::string>(2)) << errors[0] << " / " << errors[1];
  auto res = ckpt::export_safetensors(root, std::nullopt, dir.path() + "/hf", {});
  ASSERT_TRUE(res) << res.error().message;
  EXPECT_EQ(res->tensors, 1u);
  Parsed p = parse(dir.path() + "/hf/model.safetensors");
  ASSERT_EQ(p.error, "");
  EXPECT_EQ(p.header["w"]["shape"], json({6, 500}));
  EXPECT_EQ(p.data["w"], as_string(whole.bytes));
}

// From a root: the newest step that reads back whole; a damaged newer one is
// passed over and named.
TEST(SafetensorsExport, FromARootSkipsADamagedNewestStep) {
  TempDir dir("pacer-st-");
  const std::string root = dir.path() + "/root";
  const Blob good = blob("model/a", "float32", {3000}, 1);
  (void)save(root, 1, {good});
  (void)save(root, 2, {blob("model/a", "float32", {3000}, 2)});
  {
    std::fstream f(root + "/" + ckpt::step_dir_name(2) + "/rank-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9000);
    f.put('\x01');
  }
  auto res = ckpt::export_safetensors(root, std::nullopt, dir.path() + "/hf", {});
  ASSERT_TRUE(res) << res.error().message;
  EXPECT_EQ(res->step, 1u);
  ASSERT_EQ(res->skipped.size(), 1u);
  EXPECT_TRUE(contains(res->skipped[0], "step 2"));
  EXPECT_TRUE(contains(res->skipped[0], "checksum mismatch"));
  EXPECT_EQ(parse(dir.path() + "/hf/model.safetensors").data["a"], as_string(good.bytes));
  res = ckpt::export_safetensors(root, 2, dir.path() + "/hf2", {});
  ASSERT_FALSE(res);
  EXPECT_TRUE(contains(res.error().message, "checksum mismatch"));
  EXPECT_FALSE(fs::exists(dir.path() + "/hf2/model.safetensors"));
}

}  // namespace
