#include "kvcd/kernels/bf16.h"

namespace kvcd::kernels {

void FloatToBf16N(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

void Bf16ToFloatN(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

}  // namespace kvcd::kernels
