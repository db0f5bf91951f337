// Tmpfs: a tmpfs mounted for one test, to make a dataset directory read-only (the data tests).
#pragma once

#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "test_util.hpp"

namespace pacer::test {

// A tmpfs mounted at DIR/mnt, unmounted on destruction; `error` is set when
// it cannot be mounted (EPERM/EACCES: not root, or no mount namespace).
struct Tmpfs {
  TempDir dir{"pacer-ro-"};
  std::string mnt = dir.path() + "/mnt";
  int error = 0;
  Tmpfs() {
    std::filesystem::create_directories(mnt);
    if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=4m") != 0) error = errno;
  }
  ~Tmpfs() {
    if (!error && ::umount2(mnt.c_str(), 0) != 0) ::umount2(mnt.c_str(), MNT_DETACH);
  }
  Tmpfs(const Tmpfs&) = delete;
  Tmpfs& operator=(const Tmpfs&) = delete;
  bool read_only() const { return ::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) == 0; }
};

}  // namespace pacer::test

// GTEST_SKIP and ASSERT return from the test body, hence a macro.
#define PACER_MOUNT_TMPFS_OR_SKIP(t)                                             \
  do {                                                                           \
    if ((t).error == EPERM || (t).error == EACCES)                               \
      GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror((t).error); \
    ASSERT_EQ((t).error, 0) << "mount: " << std::strerror((t).error);            \
  } while (0)
