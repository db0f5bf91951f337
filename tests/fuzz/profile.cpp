// Fuzzes vet profiles: arbitrary bytes as a profile's TOML, resolved (inherits) and rendered as the
// report records it.
#include <unistd.h>

#include "fuzz.hpp"
#include "pacer/vet/profile.hpp"

using namespace pacer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // `inherits` may name files relative to the profile, or to the working directory: both are the
  // scratch directory, so the inputs reach no file of the machine's but those they name absolutely.
  static const std::string source = [] {
    if (::chdir(fuzz::scratch().c_str()) != 0) std::abort();
    return fuzz::scratch() + "/profile.toml";
  }();
  auto p = vet::parse_profile(std::string_view(reinterpret_cast<const char*>(data), size), source);
  if (!p) return 0;
  (void)vet::to_json(*p).dump();
  return 0;
}
