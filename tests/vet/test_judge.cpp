#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "pacer/vet/vet.hpp"
#include "test_util.hpp"

namespace pacer::vet {
namespace {

using pacer::test::contains;

Measurement number(const std::string& check, double value, std::string target = {}) {
  Measurement m;
  m.check = check;
  m.value = value;
  m.target = std::move(target);
  return m;
}

Measurement text(const std::string& check, std::string value) {
  Measurement m;
  m.check = check;
  m.text = std::move(value);
  return m;
}

Profile profile_with(const std::string& check, CheckConfig cfg) {
  Profile p;
  p.name = "test";
  p.checks[check] = std::move(cfg);
  return p;
}

CheckStatus status_of(const Profile& p, const Measurement& m, std::optional<double> baseline = std::nullopt) {
  return judge(m, p, baseline).status;
}

// system.load has no baseline direction, so only the thresholds decide.
TEST(Judge, FailBelowBoundaryPasses) {
  CheckConfig c;
  c.fail_below = 10;
  const Profile p = profile_with("system.load", c);
  EXPECT_EQ(status_of(p, number("system.load", 10)), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, number("system.load", 9.999)), CheckStatus::kFail);
  EXPECT_EQ(status_of(p, number("system.load", 1e9)), CheckStatus::kPass);
}

// nan compares false with every threshold: it must fail, never pass.
TEST(Judge, NonFiniteMeasurementFails) {
  CheckConfig c;
  c.fail_below = 10;
  c.warn_above = 100;
  for (const Profile& p : {profile_with("system.load", c), profile_with("system.load", CheckConfig{})}) {
    for (double v : {std::nan(""), -std::nan(""), HUGE_VAL, -HUGE_VAL}) {
      SCOPED_TRACE(v);
      const CheckResult r = judge(number("system.load", v), p, std::nullopt);
      EXPECT_EQ(r.status, CheckStatus::kFail);
      EXPECT_TRUE(contains(r.reason, "not a number")) << r.reason;
    }
  }
  // With a baseline too (memory.bandwidth: higher is better).
  EXPECT_EQ(status_of(Profile{}, number("memory.bandwidth", std::nan("")), 100.0), CheckStatus::kFail);
}

TEST(Judge, WarnBelowBoundaryPasses) {
  CheckConfig c;
  c.fail_below = 10;
  c.warn_below = 50;
  const Profile p = profile_with("system.load", c);
  EXPECT_EQ(status_of(p, number("system.load", 50)), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, number("system.load", 49.9)), CheckStatus::kWarn);
  EXPECT_EQ(status_of(p, number("system.load", 10)), CheckStatus::kWarn);
  EXPECT_EQ(status_of(p, number("system.load", 9)), CheckStatus::kFail);
}

TEST(Judge, FailAboveAndWarnAboveBoundariesPass) {
  CheckConfig c;
  c.warn_above = 25;
  c.fail_above = 75;
  const Profile p = profile_with("system.load", c);
  EXPECT_EQ(status_of(p, number("system.load", 0)), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, number("system.load", 25)), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, number("system.load", 25.1)), CheckStatus::kWarn);
  EXPECT_EQ(status_of(p, number("system.load", 75)), CheckStatus::kWarn);
  EXPECT_EQ(status_of(p, number("system.load", 75.1)), CheckStatus::kFail);
}

TEST(Judge, ZeroLimitCountsEvenOneError) {
  CheckConfig c;
  c.fail_above = 0;
  const Profile p = profile_with("memory.pattern", c);
  EXPECT_EQ(status_of(p, number("memory.pattern", 0)), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, number("memory.pattern", 1)), CheckStatus::kFail);
}

TEST(Judge, FailureReasonNamesValueAndLimitAndKeepsDetail) {
  CheckConfig c;
  c.fail_above = 75;
  const Profile p = profile_with("system.load", c);
  Measurement m = number("system.load", 90);
  m.detail = "12 of 16 CPUs busy";
  const CheckResult r = judge(m, p, std::nullopt);
  EXPECT_EQ(r.status, CheckStatus::kFail);
  EXPECT_TRUE(contains(r.reason, "90"));
  EXPECT_TRUE(contains(r.reason, "75"));
  EXPECT_TRUE(contains(r.reason, "12 of 16 CPUs busy"));
}

TEST(Judge, PassReasonIsTheDetail) {
  CheckConfig c;
  c.fail_above = 75;
  Measurement m = number("system.load", 3);
  m.detail = "quiet";
  const CheckResult r = judge(m, profile_with("system.load", c), std::nullopt);
  EXPECT_EQ(r.status, CheckStatus::kPass);
  EXPECT_EQ(r.reason, "quiet");
}

TEST(Judge, CopiesIdentityCategoryAndUnit) {
  const CheckResult r = judge(number("memory.bandwidth", 42, "numa0"), Profile{}, std::nullopt);
  EXPECT_EQ(r.name, "memory.bandwidth");
  EXPECT_EQ(r.target, "numa0");
  EXPECT_EQ(r.category, "memory");
  EXPECT_EQ(r.unit, "GB/s");
  ASSERT_TRUE(r.value.has_value());
  EXPECT_EQ(*r.value, 42);
}

TEST(Judge, ThresholdTextListsLimits) {
  CheckConfig c;
  c.warn_above = 25;
  c.fail_above = 75;
  const CheckResult with = judge(number("system.load", 1), profile_with("system.load", c), std::nullopt);
  EXPECT_FALSE(with.threshold.empty());
  EXPECT_TRUE(contains(with.threshold, "75"));
  EXPECT_TRUE(contains(with.threshold, "25"));

  const CheckResult without = judge(number("system.load", 1), Profile{}, std::nullopt);
  EXPECT_TRUE(without.threshold.empty()) << without.threshold;
  EXPECT_EQ(without.status, CheckStatus::kPass);
}

TEST(Judge, TextPassAndWarnLists) {
  CheckConfig c;
  c.pass = {"madvise", "never"};
  c.warn = {"always"};
  const Profile p = profile_with("system.thp_enabled", c);
  EXPECT_EQ(status_of(p, text("system.thp_enabled", "madvise")), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, text("system.thp_enabled", "never")), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, text("system.thp_enabled", "always")), CheckStatus::kWarn);
  const CheckResult bad = judge(text("system.thp_enabled", "sometimes"), p, std::nullopt);
  EXPECT_EQ(bad.status, CheckStatus::kFail);
  EXPECT_TRUE(contains(bad.reason, "sometimes"));
  EXPECT_TRUE(contains(bad.reason, "madvise"));
  EXPECT_TRUE(contains(bad.threshold, "madvise"));
}

TEST(Judge, TextWithoutPassListPassesAnythingNotWarned) {
  CheckConfig c;
  c.warn = {"hpet"};
  const Profile p = profile_with("system.clocksource", c);
  EXPECT_EQ(status_of(p, text("system.clocksource", "tsc")), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, text("system.clocksource", "whatever")), CheckStatus::kPass);
  EXPECT_EQ(status_of(p, text("system.clocksource", "hpet")), CheckStatus::kWarn);
}

TEST(Judge, TextInBothListsPasses) {
  CheckConfig c;
  c.pass = {"tsc", "hpet"};
  c.warn = {"hpet"};
  EXPECT_EQ(status_of(profile_with("system.clocksource", c), text("system.clocksource", "hpet")), CheckStatus::kPass);
}

TEST(Judge, ProbeSetStatusPassesThroughUntouched) {
  CheckConfig c;
  c.fail_above = 0;
  const Profile p = profile_with("gpu.ecc", c);
  for (CheckStatus s : {CheckStatus::kSkip, CheckStatus::kError, CheckStatus::kFail}) {
    Measurement m = number("gpu.ecc", 0);  // would pass if judged
    m.status = s;
    m.reason = "no NVIDIA driver";
    const CheckResult r = judge(m, p, 1.0);
    EXPECT_EQ(r.status, s);
    EXPECT_EQ(r.reason, "no NVIDIA driver");
    EXPECT_FALSE(r.baseline.has_value());
  }
  // A probe-set skip wins even over a value far outside the limits.
  Measurement m = number("gpu.ecc", 1000);
  m.status = CheckStatus::kSkip;
  m.reason = "not applicable";
  EXPECT_EQ(judge(m, p, std::nullopt).status, CheckStatus::kSkip);
}

TEST(Judge, MissingValueOnNumericCheckIsError) {
  CheckConfig c;
  c.fail_below = 1;
  Measurement m;
  m.check = "memory.bandwidth";
  const CheckResult r = judge(m, profile_with("memory.bandwidth", c), std::nullopt);
  EXPECT_EQ(r.status, CheckStatus::kError);
  EXPECT_TRUE(contains(r.reason, "no value"));
}

class JudgeBaseline : public ::testing::Test {
 protected:
  void SetUp() override {
    profile_.name = "test";
    profile_.baseline_fail_ratio = 0.90;
    profile_.baseline_warn_ratio = 0.95;
    profile_.checks["memory.bandwidth"] = CheckConfig{};
    profile_.checks["system.load"] = CheckConfig{};
  }
  Profile profile_;
};

TEST_F(JudgeBaseline, HigherIsBetterFailsBelowFailRatio) {
  const CheckResult r = judge(number("memory.bandwidth", 89), profile_, 100.0);
  EXPECT_EQ(r.status, CheckStatus::kFail);
  ASSERT_TRUE(r.baseline.has_value());
  EXPECT_EQ(*r.baseline, 100);
  EXPECT_TRUE(contains(r.reason, "89%"));
  EXPECT_TRUE(contains(r.threshold, "90%"));
}

TEST_F(JudgeBaseline, HigherIsBetterWarnsBetweenRatios) {
  // Exactly at the fail ratio is not a failure.
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 90), 100.0), CheckStatus::kWarn);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 94.9), 100.0), CheckStatus::kWarn);
}

TEST_F(JudgeBaseline, HigherIsBetterPassesAtOrAboveWarnRatio) {
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 95), 100.0), CheckStatus::kPass);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 100), 100.0), CheckStatus::kPass);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 250), 100.0), CheckStatus::kPass);
}

TEST_F(JudgeBaseline, RatiosComeFromTheProfile) {
  profile_.baseline_fail_ratio = 0.5;
  profile_.baseline_warn_ratio = 0.8;
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 49), 100.0), CheckStatus::kFail);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 60), 100.0), CheckStatus::kWarn);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 85), 100.0), CheckStatus::kPass);
}

TEST_F(JudgeBaseline, AbsoluteFailStillAppliesWithBaseline) {
  profile_.checks["memory.bandwidth"].fail_below = 200;
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 150), 100.0), CheckStatus::kFail);
}

TEST_F(JudgeBaseline, DirectionlessCheckIgnoresBaseline) {
  const CheckResult r = judge(number("system.load", 50), profile_, 1.0);
  EXPECT_EQ(r.status, CheckStatus::kPass);
  EXPECT_FALSE(r.baseline.has_value());
  EXPECT_TRUE(r.threshold.empty()) << r.threshold;
  EXPECT_EQ(judge(number("system.load", 0.01), profile_, 100.0).status, CheckStatus::kPass);
}

TEST_F(JudgeBaseline, NonPositiveBaselineIgnored) {
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 1), 0.0), CheckStatus::kPass);
  EXPECT_EQ(status_of(profile_, number("memory.bandwidth", 1), -5.0), CheckStatus::kPass);
}

class LoadBaseline : public ::testing::Test {
 protected:
  pacer::test::TempDir dir_{"pacer_baseline_"};
};

TEST_F(LoadBaseline, ReadsNumericFiguresKeyedByNameAndTarget) {
  const std::string p = dir_.file("good.json", R"({
    "schema": "pacer.vet/1",
    "checks": [
      {"name": "memory.bandwidth", "target": "", "value": 50.5, "status": "pass"},
      {"name": "storage.write", "target": "/scratch", "value": 1000, "status": "warn"},
      {"name": "storage.write", "target": "/tmp", "value": 700, "status": "fail"},
      {"name": "gpu.name", "target": "gpu0", "value": "NVIDIA H200", "status": "pass"},
      {"name": "cpu.flops", "target": "", "value": 10, "status": "error"},
      {"name": "gpu.ecc", "target": "gpu0", "value": null, "status": "skip"}
    ]})");
  auto b = load_baseline(p);
  ASSERT_TRUE(b.has_value()) << b.error().message;
  const std::map<std::string, double> expected{
      {"memory.bandwidth|", 50.5}, {"storage.write|/scratch", 1000}, {"storage.write|/tmp", 700}};
  EXPECT_EQ(*b, expected);
}

TEST_F(LoadBaseline, ReadsAReportWrittenByToJson) {
  VetReport r;
  r.host = "node1";
  r.mode = "full";
  r.profile.name = "default";
  CheckResult bw;
  bw.name = "memory.bandwidth";
  bw.value = 123.5;
  CheckResult wr;
  wr.name = "storage.write";
  wr.target = "/scratch";
  wr.value = 900;
  wr.status = CheckStatus::kWarn;
  CheckResult skipped;
  skipped.name = "gpu.temperature";
  skipped.target = "gpu0";
  skipped.status = CheckStatus::kSkip;
  r.checks = {bw, wr, skipped};
  const std::string p = dir_.file("report.json", to_json(r).dump(2));
  auto b = load_baseline(p);
  ASSERT_TRUE(b.has_value()) << b.error().message;
  const std::map<std::string, double> expected{{"memory.bandwidth|", 123.5}, {"storage.write|/scratch", 900}};
  EXPECT_EQ(*b, expected);
}

TEST_F(LoadBaseline, InvalidJsonIsConfigErrorNamingPath) {
  const std::string p = dir_.file("bad.json", "{\"schema\": \"pacer.vet/1\", \"checks\": [");
  auto b = load_baseline(p);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(b.error().message, p));
}

// Found by fuzz.baseline in make test: a schema of another type threw
// json::type_error out of load_baseline.
TEST_F(LoadBaseline, ASchemaThatIsNoStringIsConfigErrorNamingPath) {
  for (const char* text : {R"({"schema": 0, "checks": []})", R"({"schema": null, "checks": []})", R"({"schema": ["pacer.vet/1"]})"}) {
    const std::string p = dir_.file("schema.json", text);
    auto b = load_baseline(p);
    ASSERT_FALSE(b.has_value()) << text;
    EXPECT_EQ(b.error().kind, ErrorKind::kConfig);
    EXPECT_TRUE(contains(b.error().message, p));
  }
}

// Found by tests/fuzz/baseline.cpp: both threw out of load_baseline (std::terminate in a caller
// without a handler) instead of an error or a skipped entry.
TEST_F(LoadBaseline, ANumberBeyondDoubleIsConfigErrorNamingPath) {
  const std::string p = dir_.file("huge.json", R"({"schema": "pacer.vet/1", "checks": [{"name": "a", "value": 1e999}]})");
  auto b = load_baseline(p);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(b.error().message, p));
}

TEST_F(LoadBaseline, FieldsOfAnotherTypeAreNoFigure) {
  const std::string p = dir_.file("types.json", R"({"schema": "pacer.vet/1", "checks": [
      {"name": 5, "value": 1},
      {"name": "a", "value": 2, "status": 3},
      {"name": "b", "value": 3, "target": ["x"]},
      {"name": "c", "value": 4, "status": "pass", "target": "/t"}
    ]})");
  auto b = load_baseline(p);
  ASSERT_TRUE(b.has_value()) << b.error().message;
  const std::map<std::string, double> expected{{"a|", 2}, {"b|", 3}, {"c|/t", 4}};
  EXPECT_EQ(*b, expected);
}

TEST_F(LoadBaseline, WrongSchemaIsConfigErrorNamingPath) {
  for (const char* text : {R"({"schema": "pacer.bench/1", "checks": []})",
                           R"({"checks": []})",
                           R"({"schema": "pacer.vet/1"})",
                           R"({"schema": "pacer.vet/1", "checks": {}})",
                           R"([1, 2, 3])"}) {
    const std::string p = dir_.file("wrong.json", text);
    auto b = load_baseline(p);
    ASSERT_FALSE(b.has_value()) << text;
    EXPECT_EQ(b.error().kind, ErrorKind::kConfig) << text;
    EXPECT_TRUE(contains(b.error().message, p)) << text;
  }
}

TEST_F(LoadBaseline, MissingFileIsConfigErrorNamingPath) {
  const std::string p = dir_.path() + "/absent.json";
  auto b = load_baseline(p);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(b.error().message, p));
}

CheckResult result(CheckStatus s) {
  CheckResult r;
  r.name = "system.load";
  r.status = s;
  return r;
}

TEST(VetReportVerdict, EmptyReportPasses) {
  VetReport r;
  EXPECT_EQ(r.verdict(), "pass");
  EXPECT_EQ(exit_code(r), ExitCode::kOk);
}

TEST(VetReportVerdict, WarningsAndSkipsPass) {
  VetReport r;
  r.checks = {result(CheckStatus::kPass), result(CheckStatus::kWarn), result(CheckStatus::kSkip)};
  EXPECT_EQ(r.verdict(), "pass");
  EXPECT_EQ(exit_code(r), ExitCode::kOk);
  EXPECT_EQ(static_cast<int>(exit_code(r)), 0);
}

TEST(VetReportVerdict, FailFails) {
  VetReport r;
  r.checks = {result(CheckStatus::kPass), result(CheckStatus::kFail), result(CheckStatus::kWarn)};
  EXPECT_EQ(r.verdict(), "fail");
  EXPECT_EQ(static_cast<int>(exit_code(r)), 1);
}

TEST(VetReportVerdict, ErrorFails) {
  VetReport r;
  r.checks = {result(CheckStatus::kError), result(CheckStatus::kPass)};
  EXPECT_EQ(r.verdict(), "fail");
  EXPECT_EQ(static_cast<int>(exit_code(r)), 1);
}

TEST(VetReportVerdict, InterruptedIs130) {
  VetReport r;
  r.checks = {result(CheckStatus::kPass)};
  r.interrupted = true;
  EXPECT_EQ(r.verdict(), "fail");
  EXPECT_EQ(static_cast<int>(exit_code(r)), 130);
  r.checks.push_back(result(CheckStatus::kFail));
  EXPECT_EQ(static_cast<int>(exit_code(r)), 130);
}

TEST(VetReportVerdict, CountsEveryStatus) {
  VetReport r;
  r.checks = {result(CheckStatus::kPass), result(CheckStatus::kPass), result(CheckStatus::kWarn),
              result(CheckStatus::kError)};
  const auto n = r.counts();
  EXPECT_EQ(n.at("pass"), 2);
  EXPECT_EQ(n.at("warn"), 1);
  EXPECT_EQ(n.at("fail"), 0);
  EXPECT_EQ(n.at("skip"), 0);
  EXPECT_EQ(n.at("error"), 1);
}

TEST(VetReportVerdict, JsonCarriesVerdictAndSchema) {
  VetReport r;
  r.checks = {result(CheckStatus::kWarn)};
  const auto j = to_json(r);
  EXPECT_EQ(j.at("schema"), kReportSchema);
  EXPECT_EQ(j.at("verdict"), "pass");
  r.checks.push_back(result(CheckStatus::kFail));
  EXPECT_EQ(to_json(r).at("verdict"), "fail");
}

}  // namespace
}  // namespace pacer::vet
