// hw's run-time libraries: the symbol binder every dlopen'ed library (NCCL, cuBLASLt) is read through.
#include "pacer/hw/libraries.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>

namespace pacer::hw {
namespace {

TEST(HwSymbolBinder, BindsPresentSymbolsAndNamesTheFirstMissingOne) {
  void* libc = ::dlopen("libc.so.6", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(libc, nullptr);
  std::size_t (*len)(const char*) = nullptr;
  int (*missing)() = nullptr;
  int (*also_missing)() = nullptr;
  SymbolBinder bind(libc, "libc");
  bind(len, "strlen");
  ASSERT_NE(len, nullptr);
  EXPECT_EQ(len("pacer"), 5u);
  EXPECT_TRUE(bind.ok());
  EXPECT_EQ(bind.error(), "");
  bind(missing, "pacer_no_such_function");
  bind(also_missing, "pacer_nor_this_one");
  EXPECT_EQ(missing, nullptr);
  EXPECT_FALSE(bind.ok());
  EXPECT_EQ(bind.error(), "libc lacks pacer_no_such_function (too old?)");
  ::dlclose(libc);
}

TEST(HwSymbolBinder, NoLibraryBindsNothing) {
  int (*fn)() = reinterpret_cast<int (*)()>(1);
  SymbolBinder bind(nullptr, "NCCL");
  bind(fn, "ncclGetVersion");
  EXPECT_EQ(fn, nullptr);
  EXPECT_EQ(bind.error(), "NCCL lacks ncclGetVersion (too old?)");
}

TEST(HwNcclLibrary, LoadedOnceAndEitherAHandleOrAReason) {
  const NcclLibrary& a = nccl_library();
  EXPECT_EQ(&a, &nccl_library());  // every user shares the one load
  EXPECT_NE(a.handle == nullptr, a.error.empty());
  if (!a.handle) {
    EXPECT_NE(a.error.find("PACER_NCCL_LIBRARY"), std::string::npos) << a.error;
  }
}

}  // namespace
}  // namespace pacer::hw
