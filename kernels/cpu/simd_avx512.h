// AVX-512 primitives (F+BW+VL). Internal header: include only from translation units
// compiled with -mavx512f -mavx512bw -mavx512vl -mfma.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_scalar.h"

namespace kvcd::kernels::internal {

// exp(x) for x <= 0 (inputs are logits minus their max), relative error ~2e-7:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, times 2^n by vscalefps (exact
// like multiplying by the exponent bits of 2^n: n >= -126 after the clamp).
inline __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Avx512Ops {
  // Planar INT2 row -> d floats: plane k of 16-byte chunk c is ((x >> 2k) & 3).
  static void UnpackInt2(const uint8_t* codes, int d, float* out) {
    const int quarter = d / 4;
    if (quarter % 16 != 0) {
      UnpackInt2Scalar(codes, d, out);
      return;
    }
    const __m128i three = _mm_set1_epi8(3);
    for (int c = 0; c < quarter; c += 16) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
      for (int k = 0; k < 4; ++k) {
        const __m128i q = _mm_and_si128(_mm_srli_epi16(x, 2 * k), three);
        _mm512_storeu_ps(out + k * quarter + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)));
      }
    }
  }
  static void Widen(const uint16_t* src, float* out, int d) {
    for (int c = 0; c < d; c += 16) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
      _mm512_storeu_ps(out + c,
                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
  }
  static float Dot(const float* a, const float* b, int d) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
  static void Axpy(float a, const float* x, float* y, int d) {
    const __m512 va = _mm512_set1_ps(a);
    for (int c = 0; c < d; c += 16) {
      _mm512_storeu_ps(y + c, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c)));
    }
  }
  static void Scale(float a, float* y, int d) {
    const __m512 va = _mm512_set1_ps(a);
    for (int c = 0; c < d; c += 16)
      _mm512_storeu_ps(y + c, _mm512_mul_ps(va, _mm512_loadu_ps(y + c)));
  }
  static float ExpSub(float* x, int n, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = Exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm));
      _mm512_storeu_ps(x + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 e = Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + j), vm));
      _mm512_mask_storeu_ps(x + j, mask, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(sum);
  }
};

}  // namespace kvcd::kernels::internal
