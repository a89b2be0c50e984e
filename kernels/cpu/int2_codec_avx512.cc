// AVX-512 row rotation for the INT2 codec: out[j] = sum_i x[i] * R[i][j], accumulated over
// i in order with separate multiply and add (no FMA), exactly like the scalar loop.
#include <immintrin.h>

#include <cstdint>

namespace kvcd::kernels::internal {

void RotateRowsAvx512(const float* x, int64_t n, int d, const float* r, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * d;
    float* o = out + t * d;
    for (int j0 = 0; j0 < d; j0 += 128) {  // 8 accumulators of 16 columns
      const int w = d - j0 < 128 ? d - j0 : 128;
      __m512 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
      for (int i = 0; i < d; ++i) {
        const __m512 xi = _mm512_set1_ps(xr[i]);
        const float* ri = r + static_cast<int64_t>(i) * d + j0;
        for (int c = 0; c < w / 16; ++c) {
          acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(xi, _mm512_loadu_ps(ri + 16 * c)));
        }
      }
      for (int c = 0; c < w / 16; ++c) _mm512_storeu_ps(o + j0 + 16 * c, acc[c]);
    }
  }
}

}  // namespace kvcd::kernels::internal
