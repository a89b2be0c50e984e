// The FSQ encoder with AVX2: 8 latent rows per pair of float64 vectors (lane r = row g0+r),
// 4 consecutive c of each row loaded and transposed in registers, one FMA per row lane per c.
// Each lane is one in-order chain of the definition (fsq_encode.h: FMA of an exact product
// equals multiply-then-add), so the codes are the scalar encoder's bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "fsq_encode.h"

namespace kvcd::kernels::internal {
namespace {

// u[t][r] for rows g0..g0+8*kB-1 and kT tokens; xd holds the kT rows of x widened to double.
template <int kT, int kB>
void DotRows8(const float* e, int64_t C, const double* xd, double (&u)[kT][8 * kB]) {
  __m256d acc[kT][2 * kB];
  for (int t = 0; t < kT; ++t)
    for (int v = 0; v < 2 * kB; ++v) acc[t][v] = _mm256_setzero_pd();
  int64_t c = 0;
  for (; c + 4 <= C; c += 4) {
    for (int b = 0; b < kB; ++b) {
      __m128 r[8];
      for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_ps(e + (8 * b + k) * C + c);
      _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
      _MM_TRANSPOSE4_PS(r[4], r[5], r[6], r[7]);
      for (int j = 0; j < 4; ++j) {
        const __m256d lo = _mm256_cvtps_pd(r[j]), hi = _mm256_cvtps_pd(r[4 + j]);
        for (int t = 0; t < kT; ++t) {
          const __m256d xb = _mm256_broadcast_sd(xd + t * C + c + j);
          acc[t][2 * b] = _mm256_fmadd_pd(lo, xb, acc[t][2 * b]);
          acc[t][2 * b + 1] = _mm256_fmadd_pd(hi, xb, acc[t][2 * b + 1]);
        }
      }
    }
  }
  for (; c < C; ++c) {
    for (int b = 0; b < kB; ++b) {
      const float* eb = e + 8 * b * C + c;
      const __m256d lo = _mm256_set_pd(eb[3 * C], eb[2 * C], eb[C], eb[0]);
      const __m256d hi = _mm256_set_pd(eb[7 * C], eb[6 * C], eb[5 * C], eb[4 * C]);
      for (int t = 0; t < kT; ++t) {
        const __m256d xb = _mm256_broadcast_sd(xd + t * C + c);
        acc[t][2 * b] = _mm256_fmadd_pd(lo, xb, acc[t][2 * b]);
        acc[t][2 * b + 1] = _mm256_fmadd_pd(hi, xb, acc[t][2 * b + 1]);
      }
    }
  }
  for (int t = 0; t < kT; ++t)
    for (int v = 0; v < 2 * kB; ++v) _mm256_storeu_pd(u[t] + 4 * v, acc[t][v]);
}

template <int kT, int kB>
void EncodeRows8(const FsqLayerCodec& codec, const double* xd, int g0, uint8_t* codes) {
  const int64_t C = codec.residual_width;
  const int64_t cb = FsqCodeBytes(codec.latent_width);
  double u[kT][8 * kB];
  DotRows8<kT, kB>(codec.encoder + g0 * C, C, xd, u);
  for (int t = 0; t < kT; ++t)
    for (int r = 0; r < 8 * kB; ++r)
      FsqPutNibble(codes + t * cb, g0 + r, FsqQuantizeLatent(u[t][r], codec.encoder_bias[g0 + r]));
}

}  // namespace

void FsqEncodeRowsAvx2(const FsqLayerCodec& codec, const float* x, int64_t tokens, uint8_t* codes) {
  constexpr int kT = 4;
  const int64_t C = codec.residual_width;
  const int G = codec.latent_width, g8 = G / 8 * 8;
  const int64_t cb = FsqCodeBytes(G);
  std::vector<double> xd(static_cast<size_t>(kT * C));
  for (int64_t t = 0; t < tokens;) {
    const int n = static_cast<int>(std::min<int64_t>(kT, tokens - t));
    for (int64_t i = 0; i < n * C; ++i) xd[i] = x[t * C + i];
    uint8_t* ct = codes + t * cb;
    if (n == kT) {
      for (int g = 0; g < g8; g += 8) EncodeRows8<kT, 1>(codec, xd.data(), g, ct);
    } else {
      // Few tokens (an Append): two bands of 8 rows at once for enough independent chains.
      for (int j = 0; j < n; ++j) {
        int g = 0;
        for (; g + 16 <= g8; g += 16) EncodeRows8<1, 2>(codec, xd.data() + j * C, g, ct + j * cb);
        for (; g < g8; g += 8) EncodeRows8<1, 1>(codec, xd.data() + j * C, g, ct + j * cb);
      }
    }
    if (g8 < G) FsqEncodeRowsScalar(codec, x + t * C, n, g8, G, ct);
    t += n;
  }
}

}  // namespace kvcd::kernels::internal
