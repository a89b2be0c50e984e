// Transform-coded key rows (codec file version 3, common/key_transform_profile.h): the
// daemon's encoder and decoder of one KV head's key code. Framework-free.
//
// A key row k of d values is coded as y = E (k - mean) (E = k_encode, rows: directions),
// z_i = y_i / sigma_i, one gain g per row and codes
//   c_i = clamp(floor(z_i / (g step(b_i)) + 2^(b_i - 1)), 0, 2^b_i - 1)   (b_i > 0 bits)
// where step(b) is the unit Gaussian's optimal uniform step (TransformStep) and
//   g = FP16 of max(RMS of z over the coded directions, max_i |z_i| / half range_i)
//       times (1 + 2^-10) (never below the exact value after rounding); 1 for a row with
//       no coded direction or a gain that is 0 / not finite in FP16.
// It decodes as y_i = sigma_i g step(b_i) (c_i - (2^b_i - 1) / 2), k = mean + D y (D =
// k_decode). Every step runs in float64 in the order of tools/transform_codec.cc
// (TransformRoundTrip), so codes, gains and decoded rows are bit-identical to the tools'.
//
// Stored row: code_bytes = sum(b_i) / 8 bytes, direction i at bits[i] bits LSB first in
// direction order (a plain bit stream), and the gain as FP16 elsewhere.
#pragma once

#include <cstdint>

namespace kvcd::kernels {

inline constexpr int kMaxTransformBits = 8;

// step(b) for b = 0..8 (0 for b = 0); equal to tools' GaussianUniformStep(b).
double TransformStep(int bits);

struct TransformKeyCode {
  int d = 0;
  const float* encode = nullptr;  // [d][d]
  const float* decode = nullptr;  // [d][d]: k_j = mean_j + sum_i decode[j * d + i] y_i
  const float* mean = nullptr;    // [d]
  const float* sigma = nullptr;   // [d], > 0 where bits > 0
  const int* bits = nullptr;      // [d], 0..8, summing to 8 * code_bytes
  int code_bytes = 0;
};

// Encodes n rows ([n][d] float): row t's codes at codes + t * code_stride (code_bytes
// bytes), its FP16 gain at gains[t * gain_stride].
void EncodeTransformKeys(const TransformKeyCode& c, const float* rows, int64_t n, uint8_t* codes,
                         int64_t code_stride, uint16_t* gains, int64_t gain_stride = 1);

// Code of direction i of a row (the bit stream above); bit_offset = sum of bits before i.
inline int TransformCodeAt(const uint8_t* row, int bit_offset, int bits) {
  int v = 0;
  for (int b = 0; b < bits; ++b) {
    const int pos = bit_offset + b;
    v |= ((row[pos >> 3] >> (pos & 7)) & 1) << b;
  }
  return v;
}

// Decodes n rows into out ([n][d] float).
void DecodeTransformKeys(const TransformKeyCode& c, const uint8_t* codes, int64_t code_stride,
                         const uint16_t* gains, int64_t gain_stride, int64_t n, float* out);

}  // namespace kvcd::kernels
