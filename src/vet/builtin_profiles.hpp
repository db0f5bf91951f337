// Internal: the profiles compiled into the binary from profiles/*.toml.
#pragma once

#include <string>
#include <vector>

namespace pacer::vet {

struct BuiltinProfile {
  const char* name;
  const char* text;
};
const std::vector<BuiltinProfile>& builtin_profiles();

}  // namespace pacer::vet
