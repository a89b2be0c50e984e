// bfloat16 <-> float conversion. Header-only, framework-free.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcd::kernels {

// Round-to-nearest-even float -> bfloat16 bits; NaN stays a (quiet) NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// f rounded to the nearest bfloat16 (ties to even), as a float.
inline float RoundBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// Converts n floats to bfloat16 (dst may not alias src).
void FloatToBf16N(const float* src, uint16_t* dst, int64_t n);
// Converts n bfloat16 values to floats.
void Bf16ToFloatN(const uint16_t* src, float* dst, int64_t n);

}  // namespace kvcd::kernels
