// Pieces of the FSQ encoder shared by its scalar and SIMD versions (docs/fsq.md). Every
// version sums u = sum_c E[g][c] x[c] in order of c in float64; a float*float product is
// exact in float64, so a fused multiply-add gives the same sums as a multiply and an add,
// and all versions produce the same bits. Internal header.
#pragma once

#include <cstdint>

#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels::internal {

// z = clamp(round_half_even(h tanh(u + atanh(delta/h)) - delta), -8, 7), u = E x + e
// (the sum already taken, the bias not yet added). NaN -> 0.
int FsqQuantizeLatent(double sum, float bias);

// Writes z + 8 into nibble g of a packed code.
inline void FsqPutNibble(uint8_t* code, int g, int z) {
  const uint8_t nib = static_cast<uint8_t>(z + 8);
  if (g % 2 == 0) {
    code[g / 2] = static_cast<uint8_t>((code[g / 2] & 0xF0) | nib);
  } else {
    code[g / 2] = static_cast<uint8_t>((code[g / 2] & 0x0F) | (nib << 4));
  }
}

// The scalar encoder over latent rows [g_begin, g_end) of `tokens` tokens (codes zeroed by
// the caller).
void FsqEncodeRowsScalar(const FsqLayerCodec& codec, const float* x, int64_t tokens, int g_begin,
                         int g_end, uint8_t* codes);

// The AVX2 encoder (all rows; the rows past a multiple of 8 go through the scalar one).
void FsqEncodeRowsAvx2(const FsqLayerCodec& codec, const float* x, int64_t tokens, uint8_t* codes);

}  // namespace kvcd::kernels::internal
