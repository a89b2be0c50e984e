// Fuzzes the daemon's YAML configuration parser (server/config): any bytes must give a
// config or an INVALID_ARGUMENT, never a crash, hang or sanitizer report; a config that
// parses must also pass the exposure check and a byte-size re-parse without faulting.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/config/config.h"

// The exposure check resolves host names (a name counts as loopback only if every address
// it resolves to is): one DNS try of at most a second per lookup keeps an unreachable
// resolver from stalling the fuzzer into its per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("RES_OPTIONS", "timeout:1 attempts:1", /*overwrite=*/0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = kvcd::ParseConfig(text);
  if (config.ok()) {
    (void)kvcd::CheckExposure(*config);
    (void)kvcd::IsLoopbackAddress(config->listen);
  } else if (config.status().code() != absl::StatusCode::kInvalidArgument) {
    __builtin_trap();  // a parse error must be INVALID_ARGUMENT
  }
  (void)kvcd::ParseByteSize(text);
  return 0;
}
