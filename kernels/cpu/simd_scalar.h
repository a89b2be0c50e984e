// Portable primitives for the CPU kernels (the scalar ISA). Internal header.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvcd/kernels/bf16.h"

namespace kvcd::kernels::internal {

// Unpacks one planar INT2 row (d/4 bytes) into d floats 0..3 (int2_codec.h packing).
inline void UnpackInt2Scalar(const uint8_t* codes, int d, float* out) {
  const int quarter = d / 4;
  for (int k = 0; k < 4; ++k) {
    for (int j = 0; j < quarter; ++j)
      out[k * quarter + j] = static_cast<float>((codes[j] >> (2 * k)) & 3);
  }
}

struct ScalarOps {
  static void UnpackInt2(const uint8_t* codes, int d, float* out) {
    UnpackInt2Scalar(codes, d, out);
  }
  static void Widen(const uint16_t* src, float* out, int d) {
    for (int c = 0; c < d; ++c) out[c] = Bf16ToFloat(src[c]);
  }
  static float Dot(const float* a, const float* b, int d) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc += a[c] * b[c];
    return acc;
  }
  static void Axpy(float a, const float* x, float* y, int d) {
    for (int c = 0; c < d; ++c) y[c] += a * x[c];
  }
  static void Scale(float a, float* y, int d) {
    for (int c = 0; c < d; ++c) y[c] *= a;
  }
  static float ExpSub(float* x, int n, float m) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      x[j] = std::exp(x[j] - m);
      sum += x[j];
    }
    return sum;
  }
};

}  // namespace kvcd::kernels::internal
