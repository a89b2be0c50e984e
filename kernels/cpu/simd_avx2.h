// AVX2+FMA primitives. Internal header: include only from translation units compiled
// with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_scalar.h"

namespace kvcd::kernels::internal {

inline float HorizontalSum256(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0; same reduction as Exp512.
inline __m256 Exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct Avx2Ops {
  static void UnpackInt2(const uint8_t* codes, int d, float* out) {
    const int quarter = d / 4;
    if (quarter % 8 != 0) {
      UnpackInt2Scalar(codes, d, out);
      return;
    }
    const __m128i three = _mm_set1_epi8(3);
    for (int c = 0; c < quarter; c += 8) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c));
      for (int k = 0; k < 4; ++k) {
        const __m128i q = _mm_and_si128(_mm_srli_epi16(x, 2 * k), three);
        _mm256_storeu_ps(out + k * quarter + c, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
      }
    }
  }
  // head_dim is a multiple of 8 for every supported geometry.
  static void Widen(const uint16_t* src, float* out, int d) {
    for (int c = 0; c < d; c += 8) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      _mm256_storeu_ps(out + c,
                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
    }
  }
  static float Dot(const float* a, const float* b, int d) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    }
    return HorizontalSum256(acc);
  }
  static void Axpy(float a, const float* x, float* y, int d) {
    const __m256 va = _mm256_set1_ps(a);
    for (int c = 0; c < d; c += 8) {
      _mm256_storeu_ps(y + c, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
    }
  }
  static void Scale(float a, float* y, int d) {
    const __m256 va = _mm256_set1_ps(a);
    for (int c = 0; c < d; c += 8)
      _mm256_storeu_ps(y + c, _mm256_mul_ps(va, _mm256_loadu_ps(y + c)));
  }
  static float ExpSub(float* x, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = Exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
      _mm256_storeu_ps(x + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    float tail = 0.0f;
    for (; j < n; ++j) {
      alignas(32) float buf[8] = {x[j] - m, 0, 0, 0, 0, 0, 0, 0};
      const __m256 e = Exp256(_mm256_load_ps(buf));
      x[j] = _mm256_cvtss_f32(e);
      tail += x[j];
    }
    return HorizontalSum256(sum) + tail;
  }
};

}  // namespace kvcd::kernels::internal
