// Fuzzes the safetensors reader (common/safetensors): any bytes must parse or give
// INVALID_ARGUMENT; every tensor of a parsed file must be readable within the file's bytes
// (ASan checks the reads), and ReadFloats must answer without faulting.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = kvcd::SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) {
    if (file.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  for (const std::string& name : file->Names()) {
    auto view = file->Get(name);
    if (!view.ok()) __builtin_trap();  // a listed tensor must be there
    uint8_t sum = 0;
    for (int64_t i = 0; i < view->size_bytes; ++i) sum ^= view->data[i];
    (void)sum;
    (void)file->ReadFloats(name, {});
  }
  (void)file->Get("absent");
  return 0;
}
