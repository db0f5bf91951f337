// Writes a synthetic job catalog for the CLI tests: make_catalog PATH WORKLOAD.
#include <cstdio>

#include "score/synthetic.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_catalog PATH WORKLOAD\n");
    return 2;
  }
  const pacer::Status s = pacer::test::write_synthetic_catalog(argv[1], argv[2]);
  if (!s) {
    std::fprintf(stderr, "make_catalog: %s\n", s.error().message.c_str());
    return 3;
  }
  return 0;
}
