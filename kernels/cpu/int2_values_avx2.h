// The value half of the AVX2 integer INT2 attention (int2_attention_avx2.cc): softmax of a
// block of logits and the weighted sum of INT2 value rows on their 2-bit codes with
// vpmaddubsw (weights split into two int8 digits per block of <= 64 tokens). Shared by the
// int2-oscar kernel and the transform-coded key kernel (transform_attention_avx2.cc), whose
// value pages have the same layout ([page/4][Q][4] codes, FP16 scale and minimum runs).
// Internal header; include only from translation units compiled with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "int2_attention_impl.h"
#include "simd_avx2.h"

namespace kvcd::kernels::internal {

#define KVCD_INT2_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

inline constexpr int kInt2MaddBlock = 64;

KVCD_INT2_AVX2_TARGET inline float HorizontalMax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
  return _mm_cvtss_f32(m);
}

// Plane k (2-bit codes at bits 2k) of every byte.
template <int k>
KVCD_INT2_AVX2_TARGET inline __m256i Plane(__m256i raw, __m256i three) {
  if constexpr (k == 0) {
    return _mm256_and_si256(raw, three);
  } else {
    return _mm256_and_si256(_mm256_srli_epi16(raw, 2 * k), three);
  }
}

// acc += codes · digits (pairs summed, int16).
KVCD_INT2_AVX2_TARGET inline __m256i MaddAcc(__m256i acc, __m256i codes, const __m256i& digits) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, digits));
}

// The same for 4 heads x 2 digits: acc[2h + j] += codes · digits[h][j]. Written in asm
// because GCC 12 otherwise copies (vmovdqa) or spills a loop-carried accumulator per
// product when 8 of them are live: 16 instructions, the digits as memory operands.
KVCD_INT2_AVX2_TARGET inline void MaddAcc4x2(__m256i x, const __m256i (*const* digits)[2], int row,
                                             __m256i& a0, __m256i& a1, __m256i& a2, __m256i& a3,
                                             __m256i& a4, __m256i& a5, __m256i& a6, __m256i& a7) {
  __m256i t;
  __asm__(
      "vpmaddubsw %[d0], %[x], %[t]\n\tvpaddw %[t], %[a0], %[a0]\n\t"
      "vpmaddubsw %[d1], %[x], %[t]\n\tvpaddw %[t], %[a1], %[a1]\n\t"
      "vpmaddubsw %[d2], %[x], %[t]\n\tvpaddw %[t], %[a2], %[a2]\n\t"
      "vpmaddubsw %[d3], %[x], %[t]\n\tvpaddw %[t], %[a3], %[a3]\n\t"
      "vpmaddubsw %[d4], %[x], %[t]\n\tvpaddw %[t], %[a4], %[a4]\n\t"
      "vpmaddubsw %[d5], %[x], %[t]\n\tvpaddw %[t], %[a5], %[a5]\n\t"
      "vpmaddubsw %[d6], %[x], %[t]\n\tvpaddw %[t], %[a6], %[a6]\n\t"
      "vpmaddubsw %[d7], %[x], %[t]\n\tvpaddw %[t], %[a7], %[a7]"
      : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
        [a6] "+x"(a6), [a7] "+x"(a7), [t] "=&x"(t)
      : [x] "x"(x), [d0] "m"(digits[0][row][0]), [d1] "m"(digits[0][row][1]),
        [d2] "m"(digits[1][row][0]), [d3] "m"(digits[1][row][1]), [d4] "m"(digits[2][row][0]),
        [d5] "m"(digits[2][row][1]), [d6] "m"(digits[3][row][0]), [d7] "m"(digits[3][row][1]));
}

// 254 * Σhi + Σlo per 32-bit lane (the two int16 halves of a lane summed).
KVCD_INT2_AVX2_TARGET inline __m256i CombineDigits(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(254)),
                          _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
}

// o[h][k*Q + c0*8 .. +8] += unit[h] * Σ_quads codes · weight digits, plane k, for kH heads.
// kQuads > 0: the quad count is known (a full block of 64 tokens) and the loop unrolls.
template <int kH, int k, int kQuads>
KVCD_INT2_AVX2_TARGET inline void ValuePlane(const uint8_t* vc, int64_t quad_stride, int quads,
                                             const __m256i (*const* wd)[2], const float* unit,
                                             float* const* dst) {
  const __m256i three = _mm256_set1_epi8(3);
  __m256i ahi[kH], alo[kH];
  for (int h = 0; h < kH; ++h) ahi[h] = alo[h] = _mm256_setzero_si256();
  if constexpr (kH == 4) {
    __m256i h0 = ahi[0], l0 = alo[0], h1 = ahi[1], l1 = alo[1];
    __m256i h2 = ahi[2], l2 = alo[2], h3 = ahi[3], l3 = alo[3];
    const int nq = kQuads > 0 ? kQuads : quads;
#pragma GCC unroll 16
    for (int qd = 0; qd < nq; ++qd) {
      const __m256i x = Plane<k>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + qd * quad_stride)), three);
      MaddAcc4x2(x, wd, qd, h0, l0, h1, l1, h2, l2, h3, l3);
    }
    ahi[0] = h0, alo[0] = l0, ahi[1] = h1, alo[1] = l1;
    ahi[2] = h2, alo[2] = l2, ahi[3] = h3, alo[3] = l3;
  } else {
    for (int qd = 0; qd < quads; ++qd) {
      const __m256i x = Plane<k>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + qd * quad_stride)), three);
      for (int h = 0; h < kH; ++h) {
        ahi[h] = MaddAcc(ahi[h], x, wd[h][qd][0]);
        alo[h] = MaddAcc(alo[h], x, wd[h][qd][1]);
      }
    }
  }
  for (int h = 0; h < kH; ++h) {
    const __m256 add = _mm256_cvtepi32_ps(CombineDigits(ahi[h], alo[h]));
    _mm256_storeu_ps(dst[h],
                     _mm256_fmadd_ps(add, _mm256_set1_ps(unit[h]), _mm256_loadu_ps(dst[h])));
  }
}

// The 4 planes of one 8-byte column of V codes: o[h][k*Q + ..] for k = 0..3.
template <int kH, int kQuads>
KVCD_INT2_AVX2_TARGET inline void ValuePlanes(const uint8_t* vc, int64_t quad_stride, int quads,
                                              const __m256i (*const* wd)[2], const float* unit,
                                              float** dst, int q4) {
  ValuePlane<kH, 0, kQuads>(vc, quad_stride, quads, wd, unit, dst);
  for (int h = 0; h < kH; ++h) dst[h] += q4;
  ValuePlane<kH, 1, kQuads>(vc, quad_stride, quads, wd, unit, dst);
  for (int h = 0; h < kH; ++h) dst[h] += q4;
  ValuePlane<kH, 2, kQuads>(vc, quad_stride, quads, wd, unit, dst);
  for (int h = 0; h < kH; ++h) dst[h] += q4;
  ValuePlane<kH, 3, kQuads>(vc, quad_stride, quads, wd, unit, dst);
}

// One block of the decode loop at token t0: tokens [t0, t0 + n) of page t0 / page_size,
// worked on the 8-aligned slots [a0, a0 + span) of that page (span <= 64, nv vectors of 8),
// the first `lead` and last `tail` of them outside [t0, end) and masked.
struct Int2MaddSpan {
  int64_t page;
  int off, n, a0, span, nv, lead, tail;
  Int2MaddSpan(int64_t t0, int64_t end, int page_size) {
    page = t0 / page_size;
    off = static_cast<int>(t0 % page_size);
    n = static_cast<int>(std::min<int64_t>({page_size - off, end - t0, kInt2MaddBlock - off % 8}));
    a0 = off & ~7;
    const int a1 = (off + n + 7) & ~7;
    span = a1 - a0;
    nv = span / 8;
    lead = off - a0;
    tail = a1 - (off + n);
  }
};

// One block of logits sb[i][0..span) of kGroup query heads over the 8-aligned slots
// [a0, a0 + span) of the value rows vr (span <= 64; the first `lead` and last `tail` slots
// lie outside [begin, end) and are masked): the online-softmax update of (m, l, lacc, o)
// and o[i] += Σ_j p_ij scale_j c_j on the codes. sb is overwritten.
template <int kGroup>
KVCD_INT2_AVX2_TARGET void Int2MaddValues(const Int2RowRef& vr, int a0, int span, int lead,
                                          int tail, int d, float (*sb)[kInt2MaddBlock], float* m,
                                          float* l, float* lacc, float* o) {
  constexpr int G = kGroup, kH = G < 4 ? G : 4, kBlock = kInt2MaddBlock;
  const int q4 = d / 4, nv = span / 8;
  // Weight digits of the block's quads, broadcast: wd[i][quad][0 hi / 1 lo].
  alignas(32) __m256i wd[G][kBlock / 4][2];
  alignas(32) float vsc[kBlock], vlo[kBlock];
  alignas(32) int8_t dig[2][kBlock] = {};  // zeroed: GCC 12 misses the vector stores
  float wunit[G];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 vneg_inf = _mm256_set1_ps(neg_inf);
  // Value scales and minimums of the block; 0 in the masked slots (whose bytes may be
  // anything), so they add nothing.
  for (int v = 0; v < nv; ++v) {
    _mm256_store_ps(
        vsc + 8 * v,
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr.scale + a0 + 8 * v))));
    _mm256_store_ps(
        vlo + 8 * v,
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr.lo + a0 + 8 * v))));
  }
  for (int j = 0; j < lead; ++j) vsc[j] = vlo[j] = 0.0f;
  for (int j = span - tail; j < span; ++j) vsc[j] = vlo[j] = 0.0f;
  for (int i = 0; i < G; ++i) {
    for (int j = 0; j < lead; ++j) sb[i][j] = neg_inf;
    for (int j = span - tail; j < span; ++j) sb[i][j] = neg_inf;
    __m256 vmx = _mm256_set1_ps(m[i]);
    for (int v = 0; v < nv; ++v) vmx = _mm256_max_ps(vmx, _mm256_load_ps(sb[i] + 8 * v));
    RaiseInt2Max<Avx2Ops>(HorizontalMax256(vmx), d, m[i], l[i], lacc[i], o + i * d);
    // p = exp(s - m) (0 in masked slots); w = p * scale_v; lacc += Σ p lo_v.
    const __m256 vm = _mm256_set1_ps(m[i]);
    __m256 psum = _mm256_setzero_ps(), lsum = _mm256_setzero_ps(), wmax = _mm256_setzero_ps();
    for (int v = 0; v < nv; ++v) {
      const __m256 s = _mm256_load_ps(sb[i] + 8 * v);
      const __m256 p =
          _mm256_and_ps(Exp256(_mm256_sub_ps(s, vm)), _mm256_cmp_ps(s, vneg_inf, _CMP_NEQ_OQ));
      psum = _mm256_add_ps(psum, p);
      lsum = _mm256_fmadd_ps(p, _mm256_load_ps(vlo + 8 * v), lsum);
      const __m256 w = _mm256_mul_ps(p, _mm256_load_ps(vsc + 8 * v));
      wmax = _mm256_max_ps(wmax, w);
      _mm256_store_ps(sb[i] + 8 * v, w);
    }
    l[i] += HorizontalSum256(psum);
    lacc[i] += HorizontalSum256(lsum);
    // Two int8 digits per weight, 4 tokens (one quad) per 32-bit lane.
    const float mx = HorizontalMax256(wmax);
    const float step = mx > 0.0f ? mx / 127.0f : 1.0f;
    wunit[i] = step / 254.0f;
    const __m256 inv = _mm256_set1_ps(1.0f / step), vstep = _mm256_set1_ps(step);
    const __m256 inv2 = _mm256_set1_ps(254.0f / step), vunit = _mm256_set1_ps(wunit[i]);
    __m256 wresid = _mm256_setzero_ps();  // Σ (w - digits), added back at the mean code
    for (int v0 = 0; v0 < nv; v0 += 4) {
      __m256i hi[4], lo[4];
      for (int u = 0; u < 4; ++u) {
        if (v0 + u < nv) {
          const __m256 w = _mm256_load_ps(sb[i] + 8 * (v0 + u));
          hi[u] = _mm256_cvtps_epi32(_mm256_mul_ps(w, inv));
          const __m256 r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(hi[u]), vstep, w);
          lo[u] = _mm256_cvtps_epi32(_mm256_mul_ps(r, inv2));
          wresid = _mm256_add_ps(wresid, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(lo[u]), vunit, r));
        } else {
          hi[u] = lo[u] = _mm256_setzero_si256();
        }
      }
      // packs work per 128-bit lane; the permute restores token order.
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const __m256i h8 = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3])),
          order);
      const __m256i l8 = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3])),
          order);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dig[0] + 8 * v0), h8);
      _mm256_store_si256(reinterpret_cast<__m256i*>(dig[1] + 8 * v0), l8);
    }
    lacc[i] += 1.5f * HorizontalSum256(wresid);
    for (int qd4 = 0; qd4 < span / 4; ++qd4) {
      int32_t hbits, lbits;
      std::memcpy(&hbits, dig[0] + 4 * qd4, 4);
      std::memcpy(&lbits, dig[1] + 4 * qd4, 4);
      wd[i][qd4][0] = _mm256_set1_epi32(hbits);
      wd[i][qd4][1] = _mm256_set1_epi32(lbits);
    }
  }
  // --- values: o[i] += wunit Σ_quads codes · weight digits ---
  const int64_t quad_stride = int64_t{4} * q4;
  const uint8_t* vc = vr.codes + int64_t{a0 / 4} * quad_stride;
  const int quads = span / 4;
  for (int h0 = 0; h0 < G; h0 += kH) {
    const __m256i(*wh[kH])[2];
    for (int h = 0; h < kH; ++h) wh[h] = wd[h0 + h];
    for (int c0 = 0; c0 < q4 / 8; ++c0) {
      float* dst[kH];
      const uint8_t* vcc = vc + 32 * c0;
      for (int h = 0; h < kH; ++h) dst[h] = o + (h0 + h) * d + 8 * c0;
      if (quads == kBlock / 4) {
        ValuePlanes<kH, kBlock / 4>(vcc, quad_stride, quads, wh, wunit + h0, dst, q4);
      } else {
        ValuePlanes<kH, 0>(vcc, quad_stride, quads, wh, wunit + h0, dst, q4);
      }
    }
  }
}

}  // namespace kvcd::kernels::internal
