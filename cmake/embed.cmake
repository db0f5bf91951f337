# Turns the built-in profiles into a C++ source file, so the binary carries
# them and the TOML files in profiles/ stay the single source of truth.
# Usage: cmake -DOUT=file.cpp -DINPUTS="a.toml|b.toml" -P embed.cmake
string(REPLACE "|" ";" INPUTS "${INPUTS}")
set(body "// Generated from profiles/*.toml by cmake/embed.cmake; do not edit.\n#include \"vet/builtin_profiles.hpp\"\n\nnamespace pacer::vet {\n\nconst std::vector<BuiltinProfile>& builtin_profiles() {\n  static const std::vector<BuiltinProfile> kProfiles = {\n")
foreach(f IN LISTS INPUTS)
  get_filename_component(name ${f} NAME_WE)
  file(READ ${f} text)
  string(APPEND body "    {\"${name}\", R\"pacer_toml(${text})pacer_toml\"},\n")
endforeach()
string(APPEND body "  };\n  return kProfiles;\n}\n\n}  // namespace pacer::vet\n")
file(WRITE ${OUT}.tmp "${body}")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
