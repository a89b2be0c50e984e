// INT2 paged decode attention, AVX-512 instantiation.
//
// With VNNI (vpdpbusd: u8 x s8 products summed 4 to a 32-bit lane) and head_dim >= 64 both
// matrix products run on the 2-bit codes as integers, 16 lanes at a time:
//  - logits: a K lane holds 4 code bytes of one token (page layout [Q/4][page][4]); plane
//    k of those bytes, (x >> 2k) & 3, is 4 consecutive elements of quarter k, multiplied
//    by the matching 4 query digits. The scaled rotated query is split into two int8
//    digits, q ~= step*hi + (step/254)*lo (step = max|q|/127), so
//      logit_t = scale_t (step Σ hi c_t + step/254 Σ lo c_t) + lo_t Σ q.
//  - values: a V lane holds byte j of 4 consecutive tokens (layout [page/4][Q][4]); plane
//    k gives element j + kQ of those 4 tokens, multiplied by the 4 tokens' weight digits
//    (w = p * scale_v split the same way per block of 64 tokens), accumulated per element.
// Digit rounding leaves <= step/508 per query element and <= max(w)/64516 per weight,
// about 1e-5 relative: below the FP32 tolerance of the oracle comparison.
#include <immintrin.h>

#include <cmath>

#include "int2_attention_impl.h"
#include "simd_avx512.h"

namespace kvcd::kernels::internal {
namespace {

// Round to nearest (current MXCSR mode, i.e. ties to even) without a libm call.
inline int RoundToInt(float x) { return _mm_cvtss_si32(_mm_set_ss(x)); }

inline void SplitDigits(float x, float step, int* hi, int* lo) {
  *hi = std::max(-127, std::min(127, RoundToInt(x / step)));
  *lo = std::max(-127, std::min(127, RoundToInt((x - *hi * step) * 254.0f / step)));
}

inline uint32_t Pack4(const int* v) {
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k)
    r |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(v[k]))) << (8 * k);
  return r;
}

// acc[2h + j] += x · digits (vpdpbusd) for 4 heads x 2 digits. Written in asm because
// GCC 12 otherwise moves every loop-carried accumulator through a second register each
// iteration (8 to 15 vmovdqa per 8 vpdpbusd in the logit and value loops).
inline void Dpbusd4x2(__m512i x, const __m512i& d0, const __m512i& d1, const __m512i& d2,
                      const __m512i& d3, const __m512i& d4, const __m512i& d5, const __m512i& d6,
                      const __m512i& d7, __m512i& a0, __m512i& a1, __m512i& a2, __m512i& a3,
                      __m512i& a4, __m512i& a5, __m512i& a6, __m512i& a7) {
  __asm__(
      "vpdpbusd %[d0], %[x], %[a0]\n\tvpdpbusd %[d1], %[x], %[a1]\n\t"
      "vpdpbusd %[d2], %[x], %[a2]\n\tvpdpbusd %[d3], %[x], %[a3]\n\t"
      "vpdpbusd %[d4], %[x], %[a4]\n\tvpdpbusd %[d5], %[x], %[a5]\n\t"
      "vpdpbusd %[d6], %[x], %[a6]\n\tvpdpbusd %[d7], %[x], %[a7]"
      : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5),
        [a6] "+v"(a6), [a7] "+v"(a7)
      : [x] "v"(x), [d0] "m"(d0), [d1] "m"(d1), [d2] "m"(d2), [d3] "m"(d3), [d4] "m"(d4),
        [d5] "m"(d5), [d6] "m"(d6), [d7] "m"(d7));
}

// kGroup is a compile-time constant so the per-head accumulators live in registers.
template <int kGroup>
void AttendInt2Vnni(const Int2PageTable& kv, int kv_head, const float* q, float softmax_scale,
                    int64_t token_begin, int64_t token_end, float* o, float* lse) {
  constexpr int G = kGroup, kMaxD = 256, kBlock = 64;
  const int d = kv.head_dim, ps = kv.page_size, q4 = d / 4, groups4 = q4 / 4;
  const Int2PageLayout layout{kv.num_kv_heads, ps, d};
  // Query digits, lane order [plane k][4-byte group]: element k*Q + 4*grp + b.
  alignas(64) int32_t qhi[G][kMaxD / 4], qlo[G][kMaxD / 4];
  // The same digits broadcast to full vectors, so vpdpbusd takes them as memory operands.
  alignas(64) __m512i qvh[G][kMaxD / 4], qvl[G][kMaxD / 4];
  alignas(64) __m512i wvh[G][kBlock / 4 + 4], wvl[G][kBlock / 4 + 4];
  alignas(64) float sbuf[G][kBlock + 32];
  float* sp[G];  // sp[i][j] = logit / weight of block token j; 16 floats of slack before
  for (int i = 0; i < G; ++i) sp[i] = sbuf[i] + 16;
  alignas(64) int32_t whi[G][kBlock / 4 + 4], wlo[G][kBlock / 4 + 4];
  float qsum[G], qstep[G], m[G], l[G], lacc[G];
  for (int i = 0; i < G; ++i) {
    float qs[kMaxD];
    float qmax = 0.0f;
    qsum[i] = 0.0f;
    for (int c = 0; c < d; ++c) {
      qs[c] = q[i * d + c] * softmax_scale;
      qsum[i] += qs[c];
      qmax = std::max(qmax, std::fabs(qs[c]));
    }
    qstep[i] = qmax > 0.0f ? qmax / 127.0f : 1.0f;
    for (int k = 0; k < 4; ++k) {
      for (int grp = 0; grp < groups4; ++grp) {
        int hi[4], lo[4];
        for (int b = 0; b < 4; ++b) SplitDigits(qs[k * q4 + 4 * grp + b], qstep[i], &hi[b], &lo[b]);
        qhi[i][k * groups4 + grp] = static_cast<int32_t>(Pack4(hi));
        qlo[i][k * groups4 + grp] = static_cast<int32_t>(Pack4(lo));
        qvh[i][k * groups4 + grp] = _mm512_set1_epi32(qhi[i][k * groups4 + grp]);
        qvl[i][k * groups4 + grp] = _mm512_set1_epi32(qlo[i][k * groups4 + grp]);
      }
    }
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    lacc[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  const __m512i three = _mm512_set1_epi8(3);
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const int64_t page = t0 / ps;
    const int off = static_cast<int>(t0 % ps);
    const int n = static_cast<int>(std::min<int64_t>({ps - off, token_end - t0, kBlock}));
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[page] * kv.page_stride;
    const Int2RowRef kr = layout.K(pb, kv_head);
    const Int2RowRef vr = layout.V(pb, kv_head);
    // --- logits, 16 tokens per vector ---
    for (int g0 = 0; g0 < n; g0 += 16) {
      const int cnt = std::min(16, n - g0);
      const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
      const __mmask64 bmask = cnt == 16 ? ~__mmask64{0} : ((__mmask64{1} << (4 * cnt)) - 1);
      __m512i ahi[G], alo[G];
      for (int i = 0; i < G; ++i) ahi[i] = alo[i] = _mm512_setzero_si512();
      const uint8_t* kc = kr.codes + int64_t{off + g0} * 4;
      if constexpr (G % 4 == 0) {
        for (int i0 = 0; i0 < G; i0 += 4) {
          __m512i h0 = ahi[i0], l0 = alo[i0], h1 = ahi[i0 + 1], l1 = alo[i0 + 1];
          __m512i h2 = ahi[i0 + 2], l2 = alo[i0 + 2], h3 = ahi[i0 + 3], l3 = alo[i0 + 3];
          for (int grp = 0; grp < groups4; ++grp) {
            const __m512i raw = _mm512_maskz_loadu_epi8(bmask, kc + int64_t{grp} * ps * 4);
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) {
              const __m512i x = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * k), three);
              const int e = k * groups4 + grp;
              Dpbusd4x2(x, qvh[i0][e], qvl[i0][e], qvh[i0 + 1][e], qvl[i0 + 1][e], qvh[i0 + 2][e],
                        qvl[i0 + 2][e], qvh[i0 + 3][e], qvl[i0 + 3][e], h0, l0, h1, l1, h2, l2, h3,
                        l3);
            }
          }
          ahi[i0] = h0, alo[i0] = l0, ahi[i0 + 1] = h1, alo[i0 + 1] = l1;
          ahi[i0 + 2] = h2, alo[i0 + 2] = l2, ahi[i0 + 3] = h3, alo[i0 + 3] = l3;
        }
      } else {
        for (int grp = 0; grp < groups4; ++grp) {
          const __m512i raw = _mm512_maskz_loadu_epi8(bmask, kc + int64_t{grp} * ps * 4);
          for (int k = 0; k < 4; ++k) {
            const __m512i x = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * k), three);
            for (int i = 0; i < G; ++i) {
              ahi[i] = _mm512_dpbusd_epi32(ahi[i], x, qvh[i][k * groups4 + grp]);
              alo[i] = _mm512_dpbusd_epi32(alo[i], x, qvl[i][k * groups4 + grp]);
            }
          }
        }
      }
      const __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, kr.scale + off + g0));
      const __m512 lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, kr.lo + off + g0));
      for (int i = 0; i < G; ++i) {
        const __m512 dot = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(ahi[i]), _mm512_set1_ps(qstep[i]),
            _mm512_mul_ps(_mm512_cvtepi32_ps(alo[i]), _mm512_set1_ps(qstep[i] / 254.0f)));
        _mm512_mask_storeu_ps(sp[i] + g0, mask,
                              _mm512_fmadd_ps(dot, sc, _mm512_mul_ps(lo, _mm512_set1_ps(qsum[i]))));
      }
    }
    for (int i = 0; i < G; ++i) {
      __m512 vmx = _mm512_set1_ps(m[i]);
      for (int j = 0; j < n; j += 16) {
        const __mmask16 mk = static_cast<__mmask16>(n - j >= 16 ? 0xffffu : (1u << (n - j)) - 1u);
        vmx = _mm512_mask_max_ps(vmx, mk, vmx, _mm512_maskz_loadu_ps(mk, sp[i] + j));
      }
      const float mx = _mm512_reduce_max_ps(vmx);
      RaiseInt2Max<Avx512Ops>(mx, d, m[i], l[i], lacc[i], o + i * d);
      l[i] += Avx512Ops::ExpSub(sp[i], n, mx);
    }
    // --- values: weights w = p * scale_v in two digits per 4-token quad ---
    const int quad0 = off / 4;
    const int quads = (off + n + 3) / 4 - quad0;
    float wstep[G];
    {
      // w = p * scale_v over the block's quad-aligned slots (slots outside weigh 0).
      const int lead = off - quad0 * 4;
      alignas(64) float wv[G][kBlock + 16];
      __m512 wmax[G], lsum[G];
      for (int i = 0; i < G; ++i) wmax[i] = lsum[i] = _mm512_setzero_ps();
      for (int j = 0; j < quads * 4; j += 16) {
        // lanes j..j+15 hold slots quad0*4 + j..; valid where lead <= j+lane < lead+n
        const int lo_lane = std::max(0, lead - j), hi_lane = std::min(16, lead + n - j);
        const __mmask16 valid =
            hi_lane > lo_lane
                ? static_cast<__mmask16>(((1u << hi_lane) - 1u) & ~((1u << lo_lane) - 1u))
                : 0;
        const __m512 sc =
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, vr.scale + quad0 * 4 + j));
        const __m512 lov = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, vr.lo + quad0 * 4 + j));
        for (int i = 0; i < G; ++i) {
          const __m512 p = _mm512_maskz_loadu_ps(valid, sp[i] + (j - lead));
          const __m512 w = _mm512_mul_ps(p, sc);
          _mm512_store_ps(wv[i] + j, w);
          wmax[i] = _mm512_max_ps(wmax[i], w);
          lsum[i] = _mm512_fmadd_ps(p, lov, lsum[i]);
        }
      }
      for (int i = 0; i < G; ++i) {
        lacc[i] += _mm512_reduce_add_ps(lsum[i]);
        const float mx = _mm512_reduce_max_ps(wmax[i]);
        wstep[i] = mx > 0.0f ? mx / 127.0f : 1.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / wstep[i]);
        const __m512 step = _mm512_set1_ps(wstep[i]);
        const __m512 inv2 = _mm512_set1_ps(254.0f / wstep[i]);
        // 16 weights -> 16 int8 digits = 4 quads of 4 tokens, one 32-bit lane each.
        for (int j = 0; j < quads * 4; j += 16) {
          const __m512 w = _mm512_load_ps(wv[i] + j);
          const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(w, inv));
          const __m512i lo = _mm512_cvtps_epi32(
              _mm512_mul_ps(_mm512_fnmadd_ps(_mm512_cvtepi32_ps(hi), step, w), inv2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&whi[i][j / 4]), _mm512_cvtsepi32_epi8(hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&wlo[i][j / 4]), _mm512_cvtsepi32_epi8(lo));
        }
        for (int qd = 0; qd < quads; ++qd) {
          wvh[i][qd] = _mm512_set1_epi32(whi[i][qd]);
          wvl[i][qd] = _mm512_set1_epi32(wlo[i][qd]);
        }
      }
    }
    const uint8_t* vc = vr.codes + int64_t{quad0} * 4 * q4;
    for (int c0 = 0; c0 < q4; c0 += 16) {
      for (int k = 0; k < 4; ++k) {
        __m512i ahi[G], alo[G];
        for (int i = 0; i < G; ++i) ahi[i] = alo[i] = _mm512_setzero_si512();
        if constexpr (G % 4 == 0) {
          for (int i0 = 0; i0 < G; i0 += 4) {
            __m512i h0 = ahi[i0], l0 = alo[i0], h1 = ahi[i0 + 1], l1 = alo[i0 + 1];
            __m512i h2 = ahi[i0 + 2], l2 = alo[i0 + 2], h3 = ahi[i0 + 3], l3 = alo[i0 + 3];
            for (int qd = 0; qd < quads; ++qd) {
              const __m512i raw = _mm512_loadu_si512(vc + int64_t{qd} * 4 * q4 + c0 * 4);
              const __m512i x = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * k), three);
              Dpbusd4x2(x, wvh[i0][qd], wvl[i0][qd], wvh[i0 + 1][qd], wvl[i0 + 1][qd],
                        wvh[i0 + 2][qd], wvl[i0 + 2][qd], wvh[i0 + 3][qd], wvl[i0 + 3][qd], h0, l0,
                        h1, l1, h2, l2, h3, l3);
            }
            ahi[i0] = h0, alo[i0] = l0, ahi[i0 + 1] = h1, alo[i0 + 1] = l1;
            ahi[i0 + 2] = h2, alo[i0 + 2] = l2, ahi[i0 + 3] = h3, alo[i0 + 3] = l3;
          }
        } else {
          for (int qd = 0; qd < quads; ++qd) {
            const __m512i raw = _mm512_loadu_si512(vc + int64_t{qd} * 4 * q4 + c0 * 4);
            const __m512i x = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * k), three);
            for (int i = 0; i < G; ++i) {
              ahi[i] = _mm512_dpbusd_epi32(ahi[i], x, wvh[i][qd]);
              alo[i] = _mm512_dpbusd_epi32(alo[i], x, wvl[i][qd]);
            }
          }
        }
        for (int i = 0; i < G; ++i) {
          float* dst = o + i * d + k * q4 + c0;
          const __m512 add = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(ahi[i]), _mm512_set1_ps(wstep[i]),
              _mm512_mul_ps(_mm512_cvtepi32_ps(alo[i]), _mm512_set1_ps(wstep[i] / 254.0f)));
          _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), add));
        }
      }
    }
    t0 += n;
  }
  FinishInt2States(G, d, m, l, lacc, o, lse);
}

}  // namespace

void AttendInt2PagesAvx512(const Int2PageTable& kv, int kv_head, const float* q, int group,
                           float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                           float* lse) {
  if (CpuHasAvx512Vnni() && kv.head_dim % 64 == 0) {
    switch (group) {  // one instantiation per GQA group size in common use
      case 1:
        return AttendInt2Vnni<1>(kv, kv_head, q, softmax_scale, token_begin, token_end, o, lse);
      case 2:
        return AttendInt2Vnni<2>(kv, kv_head, q, softmax_scale, token_begin, token_end, o, lse);
      case 4:
        return AttendInt2Vnni<4>(kv, kv_head, q, softmax_scale, token_begin, token_end, o, lse);
      case 8:
        return AttendInt2Vnni<8>(kv, kv_head, q, softmax_scale, token_begin, token_end, o, lse);
      default:
        break;  // other group sizes: the generic AVX-512 path below
    }
  }
  AttendInt2PagesImpl<Avx512Ops>(kv, kv_head, q, group, softmax_scale, token_begin, token_end, o,
                                 lse);
}

}  // namespace kvcd::kernels::internal
