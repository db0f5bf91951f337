// Helpers shared by the unit tests: a substring assertion and a self-cleaning temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <system_error>

namespace pacer::test {

// A substring check with the whole message in the failure output (gmock is
// not linked into the unit tests).
inline ::testing::AssertionResult contains(const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << haystack << "' does not contain '" << needle << "'";
}

// A fresh directory under ::testing::TempDir(), named `prefix` plus a unique
// suffix, removed with everything in it when the object goes away.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string tmpl = ::testing::TempDir() + prefix + "XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

  // Writes `text` to `name` (which may contain directories, created as
  // needed) inside the directory and returns the file's full path.
  std::string file(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = std::filesystem::path(path_) / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }

  // The names of what the directory holds (not recursive).
  std::set<std::string> entries() const {
    std::set<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.insert(e.path().filename().string());
    return names;
  }

 private:
  std::string path_;
};

}  // namespace pacer::test
