// The FSQ decoder math of docs/fsq.md in float64, one token at a time: the definition the
// expand path and the attention oracle share. Internal header.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels::internal {

// f_i = theta^(-2i/r) for pair i < r/2.
inline double FsqRopeFrequency(const RopeSpec& rope, int i) {
  return std::pow(rope.theta, -2.0 * i / rope.rotary_dims);
}

// The two dims rotated together by pair i (docs/fsq.md: half or interleaved pairing).
inline void FsqRopePair(const RopeSpec& rope, int i, int* a, int* b) {
  if (rope.pairing == RopePairing::kInterleaved) {
    *a = 2 * i;
    *b = 2 * i + 1;
  } else {
    *a = i;
    *b = i + rope.rotary_dims / 2;
  }
}

// Rotates dims < rotary_dims of one head row in place by the angles of `position`.
inline void FsqApplyRopeDouble(const RopeSpec& rope, int64_t position, double* k) {
  const double p = static_cast<double>(position) / rope.scaling;
  for (int i = 0; i < rope.rotary_dims / 2; ++i) {
    int a, b;
    FsqRopePair(rope, i, &a, &b);
    const double angle = p * FsqRopeFrequency(rope, i);
    const double c = std::cos(angle), s = std::sin(angle);
    const double x = k[a], y = k[b];
    k[a] = x * c - y * s;
    k[b] = x * s + y * c;
  }
}

// y = W z + b over the d rows of KV head h of a decoder W [Hkv*d][G].
inline void FsqDecodeHeadDouble(const float* w, const float* bias, int head, int d, int latent,
                                const int8_t* z, double* y) {
  for (int i = 0; i < d; ++i) {
    const int64_t row = int64_t{head} * d + i;
    double acc = bias[row];
    const float* wr = w + row * latent;
    for (int g = 0; g < latent; ++g) acc += static_cast<double>(wr[g]) * z[g];
    y[i] = acc;
  }
}

// k_t of KV head h: RoPE_t(N_k(W_k z + b_k)).
inline void FsqRebuildKeyDouble(const FsqLayerCodec& codec, const RopeSpec& rope, int head,
                                const int8_t* z, int64_t position, double* k) {
  const int d = codec.head_dim;
  FsqDecodeHeadDouble(codec.decoder_k, codec.bias_k, head, d, codec.latent_width, z, k);
  if (codec.key_norm != nullptr) {
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += k[i] * k[i];
    const double inv = 1.0 / std::sqrt(ss / d + static_cast<double>(codec.key_norm_eps));
    for (int i = 0; i < d; ++i) k[i] = k[i] * inv * codec.key_norm[i];
  }
  FsqApplyRopeDouble(rope, position, k);
}

}  // namespace kvcd::kernels::internal
