// Compact fixed-column text tables for human output.
#pragma once

#include <string>
#include <vector>

namespace pacer {

// Collects rows, then renders them with each column as wide as its widest
// cell. Columns flagged numeric are right-aligned. Not thread-safe.
class Table {
 public:
  struct Column {
    std::string header;
    bool right_align = false;
    std::size_t max_width = 0;  // 0: unlimited; longer cells are cut with "..."
  };

  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}
  void add_row(std::vector<std::string> cells);
  std::string render() const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// Display width of UTF-8 text (code points; good enough for the symbols we print).
std::size_t display_width(const std::string& s);

}  // namespace pacer
