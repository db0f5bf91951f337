#include "pacer/vet/profile.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace pacer::vet {
namespace {

namespace fs = std::filesystem;
using pacer::test::contains;

class ProfileTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (fs::path(dir_.path()) / name).string(); }

  // Parses text as if read from <dir>/site.toml and expects a config error
  // pointing at `line` and mentioning every string in `needles`.
  void expect_config_error(const std::string& text, int line, const std::vector<std::string>& needles) const {
    const std::string source = path("site.toml");
    auto p = parse_profile(text, source);
    ASSERT_FALSE(p.has_value()) << "accepted:\n" << text;
    EXPECT_EQ(p.error().kind, ErrorKind::kConfig) << p.error().message;
    EXPECT_TRUE(contains(p.error().message, source + ":" + std::to_string(line) + ":"));
    for (const auto& n : needles) EXPECT_TRUE(contains(p.error().message, n));
  }

  pacer::test::TempDir dir_{"pacer_profile_"};
};

TEST(BuiltinProfiles, NamesIncludeDefaultAndH200) {
  const auto names = builtin_profile_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "default"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "h200"), names.end());
}

TEST(BuiltinProfiles, DefaultLoads) {
  auto p = load_profile("default");
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->name, "default");
  EXPECT_EQ(p->sources, (std::vector<std::string>{"builtin:default"}));
  EXPECT_DOUBLE_EQ(p->baseline_fail_ratio, 0.90);
  EXPECT_DOUBLE_EQ(p->baseline_warn_ratio, 0.95);
  EXPECT_EQ(p->storage_paths, (std::vector<std::string>{".", "$TMPDIR"}));
  const CheckConfig& load = p->checks.at("system.load");
  EXPECT_EQ(load.warn_above, 25);
  EXPECT_EQ(load.fail_above, 75);
  EXPECT_FALSE(load.fail_below.has_value());
  const CheckConfig& thp = p->checks.at("system.thp_enabled");
  EXPECT_EQ(thp.pass, (std::vector<std::string>{"madvise", "never"}));
  EXPECT_EQ(thp.warn, (std::vector<std::string>{"always"}));
}

TEST(BuiltinProfiles, H200InheritsDefault) {
  auto p = load_profile("h200");
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->name, "h200");
  EXPECT_EQ(p->sources, (std::vector<std::string>{"builtin:default", "builtin:h200"}));
  // Only in default.
  const CheckConfig& free = p->checks.at("storage.free");
  EXPECT_EQ(free.fail_below, 1);
  EXPECT_EQ(free.warn_below, 10);
  EXPECT_EQ(p->storage_paths, (std::vector<std::string>{".", "$TMPDIR"}));
  EXPECT_DOUBLE_EQ(p->baseline_fail_ratio, 0.90);
  // Overridden by h200.
  const CheckConfig& load = p->checks.at("system.load");
  EXPECT_EQ(load.warn_above, 10);
  EXPECT_EQ(load.fail_above, 25);
  EXPECT_EQ(p->checks.at("system.nofile").fail_below, 65536);
  // Untouched by the override: default's warn_below survives the merge.
  EXPECT_EQ(p->checks.at("system.nofile").warn_below, 65536);
  // Only in h200.
  EXPECT_EQ(p->checks.at("gpu.name").pass, (std::vector<std::string>{"NVIDIA H200"}));
  // An empty list replaces the inherited one instead of merging with it.
  EXPECT_TRUE(p->checks.at("system.thp_enabled").warn.empty());
}

TEST(BuiltinProfiles, UnknownNameIsUsageErrorListingBuiltins) {
  auto p = load_profile("no-such-profile");
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(p.error().message, "no-such-profile"));
  EXPECT_TRUE(contains(p.error().message, "default"));
  EXPECT_TRUE(contains(p.error().message, "h200"));
}

TEST_F(ProfileTest, MissingFileIsConfigErrorNamingPath) {
  const std::string p = path("absent.toml");
  auto r = load_profile(p);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(r.error().message, p));
}

TEST_F(ProfileTest, LoadProfileFromFileInheritsDefaultImplicitly) {
  dir_.file("site.toml",
            "name = \"site\"\n"
            "[checks.\"system.load\"]\n"
            "warn_above = 5\n");
  auto p = load_profile(path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->name, "site");
  EXPECT_EQ(p->sources, (std::vector<std::string>{"builtin:default", path("site.toml")}));
  EXPECT_EQ(p->checks.at("system.load").warn_above, 5);
  EXPECT_EQ(p->checks.at("system.load").fail_above, 75);
  EXPECT_EQ(p->checks.at("storage.free").fail_below, 1);
}

TEST_F(ProfileTest, InheritsChainThroughRelativePath) {
  dir_.file("sub/base.toml",
            "name = \"base\"\n"
            "inherits = \"h200\"\n"
            "[checks.\"system.load\"]\n"
            "warn_above = 5\n"
            "[checks.\"storage.free\"]\n"
            "warn_below = 100\n");
  const std::string source = path("site.toml");
  auto p = parse_profile(
      "name = \"site\"\n"
      "inherits = \"sub/base.toml\"\n"
      "[checks.\"system.load\"]\n"
      "fail_above = 20\n",
      source);
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->name, "site");
  EXPECT_EQ(p->sources,
            (std::vector<std::string>{"builtin:default", "builtin:h200", path("sub/base.toml"), source}));
  EXPECT_EQ(p->checks.at("system.load").warn_above, 5);   // base
  EXPECT_EQ(p->checks.at("system.load").fail_above, 20);  // site
  EXPECT_EQ(p->checks.at("storage.free").warn_below, 100);
  EXPECT_EQ(p->checks.at("storage.free").fail_below, 1);  // default
  EXPECT_EQ(p->checks.at("gpu.temperature").fail_above, 70);  // h200
}

TEST_F(ProfileTest, InheritsIsRelativeToTheInheritingFile) {
  // base.toml sits in sub/ and names its own parent "root.toml" in sub/.
  dir_.file("sub/root.toml", "name = \"root\"\ninherits = \"none\"\n[checks.\"system.load\"]\nwarn_above = 3\n");
  dir_.file("sub/base.toml", "name = \"base\"\ninherits = \"root.toml\"\n");
  dir_.file("root.toml", "name = \"decoy\"\ninherits = \"none\"\n[checks.\"system.load\"]\nwarn_above = 99\n");
  auto p = parse_profile("inherits = \"sub/base.toml\"\n", path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->checks.at("system.load").warn_above, 3);
  EXPECT_EQ(p->sources, (std::vector<std::string>{path("sub/root.toml"), path("sub/base.toml"), path("site.toml")}));
}

TEST_F(ProfileTest, InheritsNoneStartsEmpty) {
  auto p = parse_profile(
      "name = \"solo\"\n"
      "inherits = \"none\"\n"
      "[checks.\"system.load\"]\n"
      "warn_above = 5\n",
      path("solo.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->name, "solo");
  EXPECT_EQ(p->sources, (std::vector<std::string>{path("solo.toml")}));
  EXPECT_EQ(p->checks.size(), 1u);
  EXPECT_EQ(p->checks.at("system.load").warn_above, 5);
  EXPECT_FALSE(p->checks.at("system.load").fail_above.has_value());
  EXPECT_TRUE(p->storage_paths.empty());
  // The ratios keep their built-in values when nothing sets them.
  EXPECT_DOUBLE_EQ(p->baseline_fail_ratio, 0.90);
  EXPECT_DOUBLE_EQ(p->baseline_warn_ratio, 0.95);
}

TEST_F(ProfileTest, MissingInheritedFileNamesIt) {
  auto p = parse_profile("inherits = \"missing.toml\"\n", path("site.toml"));
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(p.error().message, path("missing.toml")));
}

TEST_F(ProfileTest, InheritanceCycleIsAnError) {
  dir_.file("a.toml", "inherits = \"b.toml\"\n");
  dir_.file("b.toml", "inherits = \"a.toml\"\n");
  auto p = load_profile(path("a.toml"));
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(p.error().message, "cycle"));
}

TEST_F(ProfileTest, ErrorInInheritedFileNamesThatFileAndLine) {
  dir_.file("base.toml", "name = \"base\"\n\n[checks.\"system.load\"]\nwarn_above = \"high\"\n");
  auto p = parse_profile("inherits = \"base.toml\"\n", path("site.toml"));
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(p.error().message, path("base.toml") + ":4:"));
}

TEST_F(ProfileTest, MalformedTomlReportsLine) {
  expect_config_error(
      "name = \"x\"\n"
      "[checks.\"system.load\"]\n"
      "warn_above = = 5\n",
      3, {});
}

TEST_F(ProfileTest, MalformedTomlUnterminatedStringReportsLine) {
  expect_config_error(
      "name = \"x\"\n"
      "description = \"ok\"\n"
      "\n"
      "inherits = \"default\n",
      4, {});
}

TEST_F(ProfileTest, UnknownTopLevelKey) {
  expect_config_error("name = \"x\"\nthresholds = 3\n", 2, {"'thresholds'"});
}

TEST_F(ProfileTest, UnknownCheckNameNamesItAndLine) {
  expect_config_error(
      "name = \"x\"\n"
      "\n"
      "[checks.\"system.bogus\"]\n"
      "warn_above = 5\n",
      3, {"system.bogus"});
}

TEST_F(ProfileTest, UnknownKeyInCheckTableNamesKeyAndLine) {
  expect_config_error(
      "[checks.\"system.load\"]\n"
      "warn_above = 5\n"
      "warn_abov = 6\n",
      3, {"warn_abov", "system.load"});
}

TEST_F(ProfileTest, ThresholdMustBeNumber) {
  expect_config_error(
      "[checks.\"system.load\"]\n"
      "fail_below = \"x\"\n",
      2, {"fail_below", "number"});
}

// TOML has nan and inf; nan compares false with every value, so a nan
// threshold would pass them all.
TEST_F(ProfileTest, NonFiniteThresholdsAreConfigErrors) {
  for (const char* v : {"nan", "+nan", "-nan", "inf", "-inf"}) {
    SCOPED_TRACE(v);
    for (const char* key : {"fail_below", "warn_below", "fail_above", "warn_above"})
      expect_config_error(std::string("[checks.\"system.load\"]\n") + key + " = " + v + "\n", 2, {key, "system.load", "finite"});
    expect_config_error(std::string("[cluster]\noutlier_fail = ") + v + "\n", 2, {"outlier_fail", "finite"});
    expect_config_error(std::string("[cluster]\noutlier_min_nodes = ") + v + "\n", 2, {"outlier_min_nodes"});
    expect_config_error(std::string("[baseline]\nfail_ratio = ") + v + "\n", 2, {"fail_ratio"});
    expect_config_error(std::string("[checks.\"system.load\"]\ntimeout = ") + v + "\n", 2, {"timeout"});
  }
  expect_config_error("[checks.\"system.load\"]\ntimeout = \"1e308d\"\n", 2, {"timeout", "too large"});
}

TEST_F(ProfileTest, PassListMustHoldStrings) {
  expect_config_error(
      "[checks.\"system.thp_enabled\"]\n"
      "\n"
      "pass = [1]\n",
      3, {"pass", "strings"});
}

TEST_F(ProfileTest, PassMustBeAnArray) {
  expect_config_error(
      "[checks.\"system.thp_enabled\"]\n"
      "pass = \"madvise\"\n",
      2, {"pass", "array"});
}

TEST_F(ProfileTest, TimeoutMustBeDuration) {
  expect_config_error(
      "[checks.\"memory.bandwidth\"]\n"
      "timeout = \"abc\"\n",
      2, {"timeout", "abc"});
}

TEST_F(ProfileTest, TimeoutMustBePositive) {
  expect_config_error(
      "[checks.\"memory.bandwidth\"]\n"
      "timeout = 0\n",
      2, {"timeout", "positive"});
}

TEST_F(ProfileTest, SizeParamWithUnknownUnit) {
  expect_config_error(
      "name = \"x\"\n"
      "[checks.\"memory.bandwidth\"]\n"
      "size = \"12 parsecs\"\n",
      3, {"size", "12 parsecs"});
}

TEST_F(ProfileTest, NegativeSizeParam) {
  expect_config_error(
      "[checks.\"memory.bandwidth\"]\n"
      "size = -5\n",
      2, {"size", "negative"});
}

TEST_F(ProfileTest, IntegerParamRejectsFraction) {
  expect_config_error(
      "[checks.\"memory.bandwidth\"]\n"
      "reps = 2.5\n",
      2, {"reps"});
}

TEST_F(ProfileTest, EnabledMustBeBoolean) {
  expect_config_error(
      "[checks.\"memory.bandwidth\"]\n"
      "enabled = \"no\"\n",
      2, {"enabled"});
}

TEST_F(ProfileTest, NumericThresholdOnTextCheckRejected) {
  expect_config_error(
      "[checks.\"system.clocksource\"]\n"
      "fail_below = 1\n",
      2, {"fail_below", "system.clocksource"});
}

TEST_F(ProfileTest, PassListOnNumericCheckRejected) {
  expect_config_error(
      "[checks.\"system.load\"]\n"
      "pass = [\"low\"]\n",
      2, {"pass", "system.load"});
}

TEST_F(ProfileTest, ParamsOnlyInTheOwningCheckTable) {
  // storage.read's parameters live in [storage], not in its own table.
  expect_config_error(
      "[checks.\"storage.read\"]\n"
      "size = \"1GiB\"\n",
      2, {"'size'"});
}

TEST_F(ProfileTest, CheckParamsAndTimeoutsParsed) {
  auto p = parse_profile(
      "inherits = \"none\"\n"
      "[checks.\"memory.bandwidth\"]\n"
      "enabled = false\n"
      "size = \"2GiB\"\n"
      "reps = 3\n"
      "timeout = \"2m\"\n"
      "fail_below = 50.5\n"
      "[checks.\"memory.bandwidth\".quick]\n"
      "size = 1048576\n"
      "timeout = 5\n",
      path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  const CheckConfig& c = p->checks.at("memory.bandwidth");
  EXPECT_FALSE(c.enabled);
  EXPECT_EQ(c.fail_below, 50.5);
  EXPECT_EQ(c.timeout_s, 120);
  EXPECT_EQ(c.quick_timeout_s, 5);
  const auto& params = p->params.at("memory.bandwidth");
  EXPECT_EQ(params.at("normal").at("size").get<std::uint64_t>(), 2ull << 30);
  EXPECT_EQ(params.at("normal").at("reps").get<long long>(), 3);
  EXPECT_EQ(params.at("quick").at("size").get<std::uint64_t>(), 1048576u);
}

TEST_F(ProfileTest, StoragePathsAndQuickParams) {
  auto p = parse_profile(
      "[storage]\n"
      "paths = [\"/scratch\", \"$TMPDIR\"]\n"
      "size = \"2GiB\"\n"
      "files = 200\n"
      "[storage.quick]\n"
      "size = \"64MiB\"\n"
      "files = 100\n",
      path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->storage_paths, (std::vector<std::string>{"/scratch", "$TMPDIR"}));
  const auto& s = p->params.at("storage");
  ASSERT_TRUE(s.at("quick").at("size").is_number_unsigned()) << s.dump();
  EXPECT_EQ(s.at("quick").at("size").get<std::uint64_t>(), 64ull << 20);
  EXPECT_EQ(s.at("quick").at("files").get<long long>(), 100);
  EXPECT_EQ(s.at("normal").at("size").get<std::uint64_t>(), 2ull << 30);
  EXPECT_EQ(s.at("normal").at("files").get<long long>(), 200);
}

TEST_F(ProfileTest, StorageOverridesMergeWithInheritedOnes) {
  dir_.file("base.toml", "inherits = \"none\"\n[storage]\nsize = \"2GiB\"\nblock = \"1MiB\"\n");
  auto p = parse_profile("inherits = \"base.toml\"\n[storage]\nblock = \"8MiB\"\n", path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  const auto& n = p->params.at("storage").at("normal");
  EXPECT_EQ(n.at("size").get<std::uint64_t>(), 2ull << 30);
  EXPECT_EQ(n.at("block").get<std::uint64_t>(), 8ull << 20);
}

TEST_F(ProfileTest, StorageUnknownKeyAndBadPaths) {
  expect_config_error("[storage]\nsizes = 1\n", 2, {"'sizes'", "storage"});
  expect_config_error("[storage]\npaths = \"/scratch\"\n", 2, {"paths"});
  expect_config_error("[storage]\n\n[storage.quick]\nsize = \"1 lightyear\"\n", 4, {"size"});
}

TEST_F(ProfileTest, BaselineRatiosParsed) {
  auto p = parse_profile("[baseline]\nfail_ratio = 0.8\nwarn_ratio = 1.0\n", path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_DOUBLE_EQ(p->baseline_fail_ratio, 0.8);
  EXPECT_DOUBLE_EQ(p->baseline_warn_ratio, 1.0);
}

TEST_F(ProfileTest, BaselineRatioOutOfRangeRejected) {
  expect_config_error("[baseline]\nfail_ratio = 1.5\n", 2, {"fail_ratio", "(0, 1]"});
  expect_config_error("[baseline]\nwarn_ratio = 0.9\nfail_ratio = 0\n", 3, {"fail_ratio"});
  expect_config_error("[baseline]\nwarn_ratio = -0.5\n", 2, {"warn_ratio"});
  expect_config_error("[baseline]\nwarn_ratio = \"high\"\n", 2, {"warn_ratio"});
  expect_config_error("[baseline]\nratio = 0.5\n", 2, {"'ratio'"});
}

// Found by tests/fuzz/profile.cpp: 1.5e14 was converted to unsigned, undefined behaviour.
TEST_F(ProfileTest, OutlierMinNodesMustBeAWholeCount) {
  expect_config_error("[cluster]\noutlier_min_nodes = 1.5e14\n", 2, {"outlier_min_nodes", "whole number"});
  expect_config_error("[cluster]\noutlier_min_nodes = 2.5\n", 2, {"outlier_min_nodes"});
  expect_config_error("[cluster]\noutlier_min_nodes = nan\n", 2, {"outlier_min_nodes"});
  auto p = parse_profile("[cluster]\noutlier_min_nodes = 4\n", path("site.toml"));
  ASSERT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p->cluster.outlier_min_nodes, 4u);
}

TEST_F(ProfileTest, ProfileToJsonRecordsThresholdsAndSources) {
  auto p = load_profile("h200");
  ASSERT_TRUE(p.has_value()) << p.error().message;
  const auto j = to_json(*p);
  EXPECT_EQ(j.at("name"), "h200");
  EXPECT_EQ(j.at("sources").size(), 2u);
  EXPECT_EQ(j.at("checks").at("system.load").at("fail_above"), 25);
  EXPECT_EQ(j.at("baseline").at("fail_ratio"), 0.90);
}

}  // namespace
}  // namespace pacer::vet
