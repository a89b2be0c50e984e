// Fuzzes the INT2 codec-file reader (common/codec_profile): a safetensors file (any bytes)
// read as the codec profile of a 2-layer, head_dim-8 model must load or give
// INVALID_ARGUMENT. The first input byte picks the geometry so that every (layers,
// head_dim) the seeds use is reachable: byte % 4 -> head_dim 4, 8, 16, 64; byte / 4 % 4 + 1
// -> layers.
//
// The FSQ codec reader (docs/fsq.md; being written on its own branch) gets a target of the
// same form when it lands: parse, then FSQ's profile loader, INVALID_ARGUMENT or OK.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/codec_profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static constexpr int kHeadDims[] = {4, 8, 16, 64};
  const int head_dim = kHeadDims[data[0] % 4];
  const int layers = data[0] / 4 % 4 + 1;
  auto file =
      kvcd::SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  if (!file.ok()) return 0;
  auto profile = kvcd::CodecProfile::FromSafetensors(*file, layers, head_dim, "fuzz");
  if (profile.ok()) {
    if (profile->num_layers() != layers || profile->head_dim() != head_dim) __builtin_trap();
    float acc = 0;
    for (int l = 0; l < layers; ++l) {
      acc += profile->RK(l)[head_dim * head_dim - 1] + profile->RVT(l)[0] + profile->RhoK(l);
    }
    (void)acc;
  } else if (profile.status().code() != absl::StatusCode::kInvalidArgument) {
    __builtin_trap();
  }
  return 0;
}
