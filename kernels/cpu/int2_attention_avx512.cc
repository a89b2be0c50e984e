// INT2 paged decode attention, AVX-512 instantiation.
//
// With VNNI (vpdpbusd: u8 x s8 products summed 4 to a 32-bit lane) and head_dim >= 64 both
// matrix products run on the 2-bit codes as integers, 16 lanes at a time:
//  - logits: a K lane holds 4 code bytes of one token (page layout [Q/4][page][4]); plane
//    k of those bytes, (x >> 2k) & 3, is 4 consecutive elements of quarter k, multiplied
//    by the matching 4 query digits. The scaled rotated query is split into two int8
//    digits, q ~= step*hi + (step/254)*lo (step = max|q|/127), so
//      logit_t = scale_t (step/254) Σ c_t (254 hi + lo) + lo_t Σ q.
//  - values: a V lane holds byte j of 4 consecutive tokens (layout [page/4][Q][4]); plane
//    k gives element j + kQ of those 4 tokens, multiplied by the 4 tokens' weight digits
//    (w = p * scale_v split the same way per block of 64 tokens, the step from the bound
//    |w| <= exp(block max logit - m) * max|scale_v|), accumulated per element.
// Digit rounding leaves <= step/508 per query element and <= that bound/64516 per weight;
// the exactly known residuals Σ(q - digits) and Σ(w - digits) are added back at the mean code
// 1.5 (into each logit and into the value-minimum term), as in the AVX2 path.
//
// The digits are dwords broadcast from memory by vpdpbusd itself ({1to16}), so the digit
// tables stay small (2 KB of query digits at head_dim 128 and group 4) and leave the L1
// cache to the page stream; the next page's rows of the head are prefetched while a block
// computes. On a core that runs vpdpbusd zmm at one per cycle (AMD Zen 4) the 32 per token
// and KV head (group 4, head_dim 128: 16 for the logits, 16 for the values) bound the loop.
#include <immintrin.h>

#include <cmath>

#include "int2_attention_impl.h"
#include "int2_page_prefetch.h"
#include "kvcd/kernels/dispatch.h"
#include "simd_avx512.h"

namespace kvcd::kernels::internal {
namespace {

// kQuads: the quads a block of <= 64 tokens can touch (17 where it starts mid-quad).
constexpr int kMaxD = 256, kBlock = 64, kQuads = kBlock / 4 + 4;

// Round to nearest (current MXCSR mode, i.e. ties to even) without a libm call.
inline int RoundToInt(float x) { return _mm_cvtss_si32(_mm_set_ss(x)); }

inline void SplitDigits(float x, float step, int* hi, int* lo) {
  *hi = std::max(-127, std::min(127, RoundToInt(x / step)));
  *lo = std::max(-127, std::min(127, RoundToInt((x - *hi * step) * 254.0f / step)));
}

inline int32_t Pack4(const int* v) {
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k)
    r |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(v[k]))) << (8 * k);
  return static_cast<int32_t>(r);
}

template <bool kMasked>
inline __m512i Load(const uint8_t* p, __mmask64 mask) {
  return kMasked ? _mm512_maskz_loadu_epi8(mask, p) : _mm512_loadu_si512(p);
}

// Plane k (the 2-bit codes at bits 2k) of every byte; k is a constant after unrolling.
inline __m512i Plane(__m512i raw, int k, __m512i three) {
  return _mm512_and_si512(k == 0 ? raw : _mm512_srli_epi16(raw, 2 * k), three);
}

// 254 * hi + lo per lane (the two digit sums of one dot product), without a multiply.
inline __m512i CombineDigits(__m512i hi, __m512i lo) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)), lo);
}

// acc[2h + j] += x · digit (vpdpbusd, the digit dword broadcast to all 16 lanes from
// memory) for 4 heads x 2 digits. Written in asm because GCC 12 otherwise moves every
// loop-carried accumulator through a second register each iteration.
inline void Dpbusd4x2(__m512i x, const int32_t& d0, const int32_t& d1, const int32_t& d2,
                      const int32_t& d3, const int32_t& d4, const int32_t& d5, const int32_t& d6,
                      const int32_t& d7, __m512i& a0, __m512i& a1, __m512i& a2, __m512i& a3,
                      __m512i& a4, __m512i& a5, __m512i& a6, __m512i& a7) {
  __asm__(
      "vpdpbusd %[d0]%{1to16%}, %[x], %[a0]\n\tvpdpbusd %[d1]%{1to16%}, %[x], %[a1]\n\t"
      "vpdpbusd %[d2]%{1to16%}, %[x], %[a2]\n\tvpdpbusd %[d3]%{1to16%}, %[x], %[a3]\n\t"
      "vpdpbusd %[d4]%{1to16%}, %[x], %[a4]\n\tvpdpbusd %[d5]%{1to16%}, %[x], %[a5]\n\t"
      "vpdpbusd %[d6]%{1to16%}, %[x], %[a6]\n\tvpdpbusd %[d7]%{1to16%}, %[x], %[a7]"
      : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5),
        [a6] "+v"(a6), [a7] "+v"(a7)
      : [x] "v"(x), [d0] "m"(d0), [d1] "m"(d1), [d2] "m"(d2), [d3] "m"(d3), [d4] "m"(d4),
        [d5] "m"(d5), [d6] "m"(d6), [d7] "m"(d7));
}

// Integer dot products of G heads with n code vectors at src + r * stride (r < n, loaded
// under `bmask` when kMasked), planes kFirst .. kFirst + kPlanes - 1 of each: plane kFirst + j of
// vector r meets digit dword e = j * n + r of head i's rows hi[i], lo[i], and sum[i] = Σ_r Σ_j (254
// hi[i][e] + lo[i][e]) · plane(codes_r), per 32-bit lane. Logits: all 4 planes of the K byte groups
// (the 4 quarters of the head); values: one plane (one quarter of the output) of the V quads.
template <int G, int kFirst, int kPlanes, int kN, int kRow, bool kMasked>
inline void PlaneDots(const uint8_t* src, int64_t stride, int nr, __mmask64 bmask,
                      const int32_t (*hi)[kRow], const int32_t (*lo)[kRow], __m512i* sum) {
  const __m512i three = _mm512_set1_epi8(3);
  const int n = kN > 0 ? kN : nr;
  if constexpr (G % 4 == 0) {
    for (int i0 = 0; i0 < G; i0 += 4) {
      __m512i h0 = _mm512_setzero_si512(), l0 = h0, h1 = h0, l1 = h0, h2 = h0, l2 = h0, h3 = h0,
              l3 = h0;
      const int32_t *hi0 = hi[i0], *lo0 = lo[i0], *hi1 = hi[i0 + 1], *lo1 = lo[i0 + 1];
      const int32_t *hi2 = hi[i0 + 2], *lo2 = lo[i0 + 2], *hi3 = hi[i0 + 3], *lo3 = lo[i0 + 3];
#pragma GCC unroll 16
      for (int r = 0; r < n; ++r) {
        const __m512i raw = Load<kMasked>(src + r * stride, bmask);
#pragma GCC unroll 4
        for (int j = 0; j < kPlanes; ++j) {
          const int e = j * n + r;
          Dpbusd4x2(Plane(raw, kFirst + j, three), hi0[e], lo0[e], hi1[e], lo1[e], hi2[e], lo2[e],
                    hi3[e], lo3[e], h0, l0, h1, l1, h2, l2, h3, l3);
        }
      }
      sum[i0] = CombineDigits(h0, l0);
      sum[i0 + 1] = CombineDigits(h1, l1);
      sum[i0 + 2] = CombineDigits(h2, l2);
      sum[i0 + 3] = CombineDigits(h3, l3);
    }
  } else {
    __m512i ah[G], al[G];
    for (int i = 0; i < G; ++i) ah[i] = al[i] = _mm512_setzero_si512();
    for (int r = 0; r < n; ++r) {
      const __m512i raw = Load<kMasked>(src + r * stride, bmask);
      for (int j = 0; j < kPlanes; ++j) {
        const __m512i x = Plane(raw, kFirst + j, three);
        for (int i = 0; i < G; ++i) {
          ah[i] = _mm512_dpbusd_epi32(ah[i], x, _mm512_set1_epi32(hi[i][j * n + r]));
          al[i] = _mm512_dpbusd_epi32(al[i], x, _mm512_set1_epi32(lo[i][j * n + r]));
        }
      }
    }
    for (int i = 0; i < G; ++i) sum[i] = CombineDigits(ah[i], al[i]);
  }
}

// o[i][k*Q + c0 ..+16] += unit[i] * value dots of plane k, for the 4 planes.
template <int G, int kN>
inline void ValueColumn(const uint8_t* src, int64_t stride, int nr, const int32_t (*hi)[kQuads],
                        const int32_t (*lo)[kQuads], const float* unit, float* o, int d, int q4) {
  __m512i sum[G];
  const auto flush = [&](int k) {
    for (int i = 0; i < G; ++i) {
      float* dst = o + i * d + k * q4;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_set1_ps(unit[i]),
                                            _mm512_loadu_ps(dst)));
    }
  };
  PlaneDots<G, 0, 1, kN, kQuads, false>(src, stride, nr, 0, hi, lo, sum);
  flush(0);
  PlaneDots<G, 1, 1, kN, kQuads, false>(src, stride, nr, 0, hi, lo, sum);
  flush(1);
  PlaneDots<G, 2, 1, kN, kQuads, false>(src, stride, nr, 0, hi, lo, sum);
  flush(2);
  PlaneDots<G, 3, 1, kN, kQuads, false>(src, stride, nr, 0, hi, lo, sum);
  flush(3);
}

// kGroup is a compile-time constant so the per-head accumulators live in registers.
template <int kGroup>
void AttendInt2Vnni(const Int2PageTable& kv, int kv_head, const float* q, float softmax_scale,
                    int64_t token_begin, int64_t token_end, float* o, float* lse) {
  constexpr int G = kGroup;
  const int d = kv.head_dim, ps = kv.page_size, q4 = d / 4, groups4 = q4 / 4;
  const Int2PageLayout layout{kv.num_kv_heads, ps, d};
  // Query digits, element k*Q + 4*e' + b in byte b of dword [k * groups4 + e'].
  alignas(64) int32_t qhi[G][kMaxD / 4], qlo[G][kMaxD / 4];
  // Weight digits of the block's quads (token 4*quad + b in byte b).
  alignas(64) int32_t whi[G][kQuads], wlo[G][kQuads];
  alignas(64) float sbuf[G][kBlock + 32];
  float* sp[G];  // sp[i][j] = logit / weight of block token j; 16 floats of slack before
  for (int i = 0; i < G; ++i) sp[i] = sbuf[i] + 16;
  float qsum[G], qunit[G], qbias[G], wunit[G], m[G], l[G], lacc[G];
  for (int i = 0; i < G; ++i) {
    float qs[kMaxD];
    float qmax = 0.0f;
    qsum[i] = 0.0f;
    for (int c = 0; c < d; ++c) {
      qs[c] = q[i * d + c] * softmax_scale;
      qsum[i] += qs[c];
      qmax = std::max(qmax, std::fabs(qs[c]));
    }
    const float step = qmax > 0.0f ? qmax / 127.0f : 1.0f;
    qunit[i] = step / 254.0f;
    double resid = 0.0;  // Σ (q - digits): times the mean code 1.5, added to each logit
    for (int k = 0; k < 4; ++k) {
      for (int grp = 0; grp < groups4; ++grp) {
        int hi[4], lo[4];
        for (int b = 0; b < 4; ++b) {
          const float x = qs[k * q4 + 4 * grp + b];
          SplitDigits(x, step, &hi[b], &lo[b]);
          resid += static_cast<double>(x) -
                   (static_cast<double>(hi[b]) * step + static_cast<double>(lo[b]) * qunit[i]);
        }
        qhi[i][k * groups4 + grp] = Pack4(hi);
        qlo[i][k * groups4 + grp] = Pack4(lo);
      }
    }
    qbias[i] = static_cast<float>(1.5 * resid);
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    lacc[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  Int2PagePrefetch prefetch(kv, kv_head);
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const int64_t page = t0 / ps;
    const int off = static_cast<int>(t0 % ps);
    const int n = static_cast<int>(std::min<int64_t>({ps - off, token_end - t0, kBlock}));
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[page] * kv.page_stride;
    const Int2RowRef kr = layout.K(pb, kv_head);
    const Int2RowRef vr = layout.V(pb, kv_head);
    if (off + n == ps && (page + 1) * ps < token_end) {
      prefetch.Target(page + 1);  // fetched in 8 slices through this block
    } else {
      prefetch.Clear();
    }
    // --- logits, 16 tokens per vector ---
    for (int g0 = 0; g0 < n; g0 += 16) {
      const int cnt = std::min(16, n - g0);
      const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
      const __mmask64 bmask = cnt == 16 ? ~__mmask64{0} : ((__mmask64{1} << (4 * cnt)) - 1);
      const uint8_t* kc = kr.codes + int64_t{off + g0} * 4;
      prefetch.Slice(g0 / 16, 8);
      __m512i sum[G];
      const int64_t kstride = int64_t{ps} * 4;
      // The loop over byte groups unrolled for head_dim 64, 128, 256 (kN = head_dim / 16).
      DispatchHeadDim(
          d,
          [&](auto hd) {
            PlaneDots<G, 0, 4, decltype(hd)::value / 16, kMaxD / 4, true>(kc, kstride, groups4,
                                                                          bmask, qhi, qlo, sum);
          },
          [&] {
            PlaneDots<G, 0, 4, 0, kMaxD / 4, true>(kc, kstride, groups4, bmask, qhi, qlo, sum);
          });
      const __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, kr.scale + off + g0));
      const __m512 lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, kr.lo + off + g0));
      for (int i = 0; i < G; ++i) {
        const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_set1_ps(qunit[i]),
                                           _mm512_set1_ps(qbias[i]));
        _mm512_mask_storeu_ps(sp[i] + g0, mask,
                              _mm512_fmadd_ps(dot, sc, _mm512_mul_ps(lo, _mm512_set1_ps(qsum[i]))));
      }
    }
    // --- softmax and weights w = p * scale_v in two digits per 4-token quad, one pass ---
    // The block's slots are taken quad-aligned: lane j of the pass is slot 4*quad0 + j,
    // valid where lead <= j < lead + n (slots outside weigh 0).
    const int quad0 = off / 4;
    const int quads = (off + n + 3) / 4 - quad0;
    const int lead = off - quad0 * 4;
    __mmask16 valid[kQuads / 4 + 1];
    __m512 vsc[kQuads / 4 + 1], vlo[kQuads / 4 + 1];
    __m512 scmax = _mm512_setzero_ps();
    for (int j = 0, u = 0; j < quads * 4; j += 16, ++u) {
      const int lo_lane = std::max(0, lead - j), hi_lane = std::min(16, lead + n - j);
      valid[u] = hi_lane > lo_lane
                     ? static_cast<__mmask16>(((1u << hi_lane) - 1u) & ~((1u << lo_lane) - 1u))
                     : 0;
      vsc[u] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid[u], vr.scale + quad0 * 4 + j));
      vlo[u] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid[u], vr.lo + quad0 * 4 + j));
      scmax = _mm512_max_ps(scmax, _mm512_abs_ps(vsc[u]));
    }
    const float scale_max = _mm512_reduce_max_ps(scmax);
    // The heads advance in lock step through short phases so that their dependency chains
    // (max, reductions, exp, digit step) overlap instead of queuing behind one another.
    float bmax[16], alpha[16], pmax[16];
    {
      __m512 vmx[G];
      for (int i = 0; i < G; ++i) vmx[i] = _mm512_set1_ps(kEmptyLse);
      for (int j = 0; j < n; j += 16) {
        const __mmask16 mk = static_cast<__mmask16>(n - j >= 16 ? 0xffffu : (1u << (n - j)) - 1u);
        for (int i = 0; i < G; ++i)
          vmx[i] = _mm512_mask_max_ps(vmx[i], mk, vmx[i], _mm512_maskz_loadu_ps(mk, sp[i] + j));
      }
      for (int i = 0; i < G; ++i) bmax[i] = _mm512_reduce_max_ps(vmx[i]);  // block's largest logit
      // Online softmax for all heads at once: m' = max(m, bmax), alpha = exp(m - m') (0 for
      // the empty state), and exp(bmax - m'), the block's largest probability.
      const __mmask16 gm = static_cast<__mmask16>((1u << G) - 1u);
      const __m512 mold = _mm512_maskz_loadu_ps(gm, m);
      const __m512 bm = _mm512_maskz_loadu_ps(gm, bmax);
      const __m512 mnew = _mm512_max_ps(mold, bm);
      const __mmask16 empty = _mm512_cmp_ps_mask(mold, _mm512_set1_ps(kEmptyLse), _CMP_EQ_OQ);
      _mm512_storeu_ps(alpha, _mm512_maskz_mov_ps(static_cast<__mmask16>(~empty),
                                                  Exp512(_mm512_sub_ps(mold, mnew))));
      _mm512_storeu_ps(pmax, Exp512(_mm512_sub_ps(bm, mnew)));
      _mm512_mask_storeu_ps(m, gm, mnew);
    }
    for (int i = 0; i < G; ++i) {
      if (alpha[i] != 1.0f) {
        l[i] *= alpha[i];
        lacc[i] *= alpha[i];
        Avx512Ops::Scale(alpha[i], o + i * d, d);
      }
    }
    // |w| <= exp(bmax - m) * max|scale_v| sets each head's digit step without a second pass
    // over the weights.
    __m512 inv[G], inv2[G], psum[G], lsum[G], wsum[G], vm[G];
    __m512i tsum[G];
    for (int i = 0; i < G; ++i) {
      const float wmax = pmax[i] * scale_max;
      const float step = wmax > 0.0f ? wmax / 127.0f : 1.0f;
      wunit[i] = step / 254.0f;
      inv[i] = _mm512_set1_ps(1.0f / step);
      inv2[i] = _mm512_set1_ps(254.0f / step);
      psum[i] = lsum[i] = wsum[i] = _mm512_setzero_ps();
      tsum[i] = _mm512_setzero_si512();
      vm[i] = _mm512_set1_ps(m[i]);
    }
    for (int j = 0, u = 0; j < quads * 4; j += 16, ++u) {
      for (int i = 0; i < G; ++i) {
        const __m512 x = _mm512_maskz_loadu_ps(valid[u], sp[i] + (j - lead));
        const __m512 p = _mm512_maskz_mov_ps(valid[u], Exp512(_mm512_sub_ps(x, vm[i])));
        psum[i] = _mm512_add_ps(psum[i], p);
        lsum[i] = _mm512_fmadd_ps(p, vlo[u], lsum[i]);
        const __m512 w = _mm512_mul_ps(p, vsc[u]);
        wsum[i] = _mm512_add_ps(wsum[i], w);
        // hi = round(w / step); 254 hi + lo = round(w / unit), so lo = that - 254 hi.
        const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(w, inv[i]));
        const __m512i whole = _mm512_cvtps_epi32(_mm512_mul_ps(w, inv2[i]));
        tsum[i] = _mm512_add_epi32(tsum[i], whole);
        const __m512i lo = _mm512_sub_epi32(
            whole, _mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)));
        // 16 weights -> 16 int8 digits = 4 quads of 4 tokens, one dword each.
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&whi[i][j / 4]), _mm512_cvtsepi32_epi8(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&wlo[i][j / 4]), _mm512_cvtsepi32_epi8(lo));
      }
    }
    for (int i = 0; i < G; ++i) {
      l[i] += _mm512_reduce_add_ps(psum[i]);
      // Σ (w - digits) = Σ w - unit Σ (254 hi + lo), added back at the mean code 1.5.
      const float resid = _mm512_reduce_add_ps(wsum[i]) -
                          wunit[i] * static_cast<float>(_mm512_reduce_add_epi32(tsum[i]));
      lacc[i] += _mm512_reduce_add_ps(lsum[i]) + 1.5f * resid;
    }
    const int64_t quad_stride = int64_t{4} * q4;
    const uint8_t* vc = vr.codes + int64_t{quad0} * quad_stride;
    for (int c0 = 0; c0 < q4; c0 += 16) {
      prefetch.Slice(4 + 4 * c0 / q4, 8);
      if (quads == kBlock / 4) {
        ValueColumn<G, kBlock / 4>(vc + c0 * 4, quad_stride, quads, whi, wlo, wunit, o + c0, d, q4);
      } else {
        ValueColumn<G, 0>(vc + c0 * 4, quad_stride, quads, whi, wlo, wunit, o + c0, d, q4);
      }
    }
    prefetch.Slice(7, 8);
    t0 += n;
  }
  FinishInt2States(G, d, m, l, lacc, o, lse);
}

}  // namespace

void AttendInt2PagesAvx512(const Int2PageTable& kv, int kv_head, const float* q, int group,
                           float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                           float* lse) {
  if (CpuHasAvx512Vnni() && kv.head_dim % 64 == 0) {
    // One instantiation per GQA group size in common use; other group sizes: the generic
    // AVX-512 path below.
    const bool done = DispatchGroupSize(
        group,
        [&](auto g) {
          AttendInt2Vnni<decltype(g)::value>(kv, kv_head, q, softmax_scale, token_begin, token_end,
                                             o, lse);
          return true;
        },
        [] { return false; });
    if (done) return;
  }
  AttendInt2PagesImpl<Avx512Ops>(kv, kv_head, q, group, softmax_scale, token_begin, token_end, o,
                                 lse);
}

}  // namespace kvcd::kernels::internal
