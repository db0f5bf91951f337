#include "pacer/core/table.hpp"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace pacer {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

TEST(DisplayWidth, CountsCodePointsNotBytes) {
  EXPECT_EQ(display_width(""), 0u);
  EXPECT_EQ(display_width("abc"), 3u);
  EXPECT_EQ(display_width("h\xc3\xa9llo"), 5u);       // héllo
  EXPECT_EQ(display_width("\xe2\x9c\x93"), 1u);        // ✓
  EXPECT_EQ(display_width("\xf0\x9f\x94\xa5 ok"), 4u);  // 🔥 ok
}

TEST(Table, HeaderOnlyWhenNoRows) {
  Table t({{"CHECK"}, {"STATUS"}});
  EXPECT_EQ(t.render(), "CHECK  STATUS\n");
}

TEST(Table, ColumnsAsWideAsWidestCellWithTwoSpaceGap) {
  Table t({{"CHECK"}, {"STATUS"}, {"REASON"}});
  t.add_row({"system.load", "pass", "3% busy"});
  t.add_row({"gpu.ecc", "fail", "2 errors"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "CHECK        STATUS  REASON");
  EXPECT_EQ(lines[1], "system.load  pass    3% busy");
  EXPECT_EQ(lines[2], "gpu.ecc      fail    2 errors");
}

TEST(Table, NoTrailingSpacesWhenLastCellIsShortOrEmpty) {
  Table t({{"A"}, {"LONGHEADER"}});
  t.add_row({"x", ""});
  t.add_row({"y", "z"});
  for (const auto& line : lines_of(t.render())) {
    ASSERT_FALSE(line.empty());
    EXPECT_NE(line.back(), ' ') << "'" << line << "'";
  }
}

TEST(Table, RightAlignedNumericColumn) {
  Table t({{"NAME"}, {"VALUE", true}, {"UNIT"}});
  t.add_row({"a", "1", "GB/s"});
  t.add_row({"longer", "12345", "%"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "NAME    VALUE  UNIT");
  EXPECT_EQ(lines[1], "a           1  GB/s");
  EXPECT_EQ(lines[2], "longer  12345  %");
}

TEST(Table, RightAlignedLastColumnKeepsLeadingPadding) {
  Table t({{"NAME"}, {"N", true}});
  t.add_row({"a", "7"});
  t.add_row({"b", "100"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "NAME    N");
  EXPECT_EQ(lines[1], "a       7");
  EXPECT_EQ(lines[2], "b     100");
}

TEST(Table, MissingCellsAreBlank) {
  Table t({{"A"}, {"B"}, {"C"}});
  t.add_row({"1"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "1");
}

TEST(Table, LongCellsCutWithEllipsisToMaxWidth) {
  Table t({{"PATH", false, 8}, {"X"}});
  t.add_row({"abcdefghijkl", "1"});
  t.add_row({"abcdefgh", "2"});  // exactly max_width: kept whole
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], "abcde...  1");
  EXPECT_EQ(lines[2], "abcdefgh  2");
}

TEST(Table, ShortCellsNotCut) {
  Table t({{"P", false, 10}});
  t.add_row({"short"});
  EXPECT_EQ(lines_of(t.render()).at(1), "short");
}

TEST(Table, HeaderWiderThanMaxWidthSetsColumnWidth) {
  Table t({{"A_LONG_HEADER", false, 5}, {"B"}});
  t.add_row({"abcdefgh", "x"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "ab...          x");
}

TEST(Table, Utf8CellsAlignByDisplayWidth) {
  Table t({{"S"}, {"NAME"}});
  t.add_row({"\xe2\x9c\x93", "ok"});   // ✓
  t.add_row({"ab", "also"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "S   NAME");
  EXPECT_EQ(lines[1], "\xe2\x9c\x93   ok");
  EXPECT_EQ(lines[2], "ab  also");
  EXPECT_EQ(display_width(lines[1]), display_width(lines[2]) - 2);
}

TEST(Table, Utf8TruncationKeepsWholeCodePoints) {
  // Eleven "é" (two bytes each): a byte-based cut would split one in half.
  std::string cell;
  for (int i = 0; i < 11; ++i) cell += "\xc3\xa9";
  Table t({{"C", false, 8}});
  t.add_row({cell});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9...");
  EXPECT_EQ(display_width(lines[1]), 8u);
}

TEST(Table, Utf8RightAlignment) {
  Table t({{"V", true}});
  t.add_row({"\xc2\xb5s"});  // µs: two code points, three bytes
  t.add_row({"1234"});
  const auto lines = lines_of(t.render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], "  \xc2\xb5s");
  EXPECT_EQ(lines[2], "1234");
}

}  // namespace
}  // namespace pacer
