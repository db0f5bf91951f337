#include "pacer/core/error.hpp"

namespace pacer {

ExitCode exit_code_for(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUsage:
    case ErrorKind::kConfig:
      return ExitCode::kUsage;
    case ErrorKind::kIo:
    case ErrorKind::kRuntime:
      return ExitCode::kRuntime;
  }
  return ExitCode::kRuntime;
}

}  // namespace pacer
