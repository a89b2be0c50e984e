// Fuzzes the activation-dump reader (common/activation_dump): a safetensors file (any bytes)
// must read as a dump whose tensors have the sizes its metadata says, or give
// INVALID_ARGUMENT / NOT_FOUND (a named tensor missing).
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/activation_dump.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = kvcd::SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  auto dump = kvcd::ParseActivationDump(*file, "fuzz");
  if (!dump.ok()) {
    const auto code = dump.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kNotFound) {
      __builtin_trap();
    }
    return 0;
  }
  if (static_cast<int>(dump->layers.size()) != dump->num_layers) __builtin_trap();
  for (const auto& layer : dump->layers) {
    const size_t kv = static_cast<size_t>(dump->tokens) * dump->num_kv_heads * dump->head_dim;
    if (layer.k.size() != kv || layer.v.size() != kv) __builtin_trap();
  }
  return 0;
}
