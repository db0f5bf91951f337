#include "pacer/core/table.hpp"

#include <algorithm>

namespace pacer {

std::size_t display_width(const std::string& s) {
  std::size_t n = 0;
  for (unsigned char c : s) {
    if ((c & 0xC0) != 0x80) ++n;
  }
  return n;
}

namespace {

std::string fit(const std::string& cell, std::size_t max_width) {
  if (max_width == 0 || display_width(cell) <= max_width) return cell;
  std::string out;
  std::size_t w = 0;
  for (std::size_t i = 0; i < cell.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(cell[i]);
    if ((c & 0xC0) != 0x80) {
      if (w + 3 >= max_width) break;
      ++w;
    }
    out.push_back(cell[i]);
  }
  return out + "...";
}

}  // namespace

void Table::add_row(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  for (std::size_t i = 0; i < cells.size(); ++i) cells[i] = fit(cells[i], columns_[i].max_width);
  rows_.push_back(std::move(cells));
}

std::string Table::render() const {
  std::vector<std::size_t> width(columns_.size());
  for (std::size_t i = 0; i < columns_.size(); ++i) width[i] = display_width(columns_[i].header);
  for (const auto& row : rows_)
    for (std::size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], display_width(row[i]));

  std::string out;
  auto emit = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      const std::size_t pad = width[i] - display_width(cells[i]);
      const bool last = i + 1 == cells.size();
      if (columns_[i].right_align) line.append(pad, ' ');
      line += cells[i];
      if (!columns_[i].right_align && !last) line.append(pad, ' ');
      if (!last) line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  };
  std::vector<std::string> headers;
  for (const auto& c : columns_) headers.push_back(c.header);
  emit(headers);
  for (const auto& row : rows_) emit(row);
  return out;
}

}  // namespace pacer
