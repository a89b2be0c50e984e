// Saturation into FP16's finite range, for the values whose FP16 image is stored: an INT2
// row's scale and offset (the rotated row they come from) and a transform-coded key row's
// gain. Finite K/V of any size must never be stored as Inf or NaN (issue #35.2), so the
// encoders saturate instead of refusing: INT2 already clips every row at its rho-quantile,
// and this is the same clip at FP16's largest finite value (docs/formats.md "int2-oscar").
// Shared by the CPU codecs and the CUDA kernels, which must give the same bits.
#pragma once

#include "kvcd/kernels/host_device.h"

namespace kvcd::kernels {

// FP16's largest finite value.
inline constexpr float kFp16Max = 65504.0f;

// x clamped into [-65504, 65504]; NaN (a rotation that overflowed FP32: Inf - Inf) -> 0.
KVCD_HOST_DEVICE inline float SaturateToFp16Range(float x) {
  if (x >= -kFp16Max) return x <= kFp16Max ? x : kFp16Max;
  return x < -kFp16Max ? -kFp16Max : 0.0f;
}

}  // namespace kvcd::kernels
