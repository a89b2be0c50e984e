// INT2 paged decode attention, AVX2 instantiation.
//
// Without VNNI the products still run on the 2-bit codes as integers: vpmaddubsw multiplies
// 32 unsigned code bytes by 32 signed int8 digits and sums adjacent pairs into int16, which
// are accumulated with vpaddw and widened once per vector of results by vpmaddwd.
//  - logits: a 32-byte K load is 8 tokens x the 4 code bytes of one byte group (page layout
//    [Q/4][page][4]); plane k, (x >> 2k) & 3, is 4 consecutive elements of quarter k of
//    each token, multiplied by the 4 matching query digits. The scaled rotated query is
//    split into two int8 digits, q ~= step*hi + (step/254)*lo (step = max|q|/127), and both
//    digit sums are kept in int16 over up to 8 byte groups x 4 planes (|sum| <= 32*762), so
//      logit_t = scale_t (step/254) Σ c_t (254 hi + lo) + lo_t Σq.
//  - values: a 32-byte V load is bytes j..j+7 of 4 consecutive tokens (layout [page/4][Q]
//    [4]); plane k gives elements kQ + j.. of those 4 tokens, multiplied by the 4 tokens'
//    weight digits (w = p * scale_v split the same way per block of <= 64 tokens, i.e. <= 16
//    quads: |sum| <= 16*762), and each block's sums are added to the FP32 output once
//    (int2_values_avx2.h, shared with the transform-coded key kernel).
// Digit rounding leaves <= step/508 per query element and <= max(w)/64516 per weight, the
// same as the AVX-512 VNNI path; the exactly known residuals Σ(q - digits) and Σ(w -
// digits) are added back at the mean code 1.5 (into each logit and into the value-minimum
// term). FP16 scales are widened with F16C (checked at run time). Blocks work on 8-aligned
// slots; slots outside [begin, end) get logit -inf, weight 0 and value scale/minimum 0.
// Used where head_dim % 32 == 0 and page_size % 8 == 0, so every 8-token K load and every
// quad of V stays inside its page; other geometries take the FP32 path.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "int2_attention_impl.h"
#include "int2_page_prefetch.h"
#include "int2_values_avx2.h"
#include "kvcd/kernels/dispatch.h"
#include "simd_avx2.h"

namespace kvcd::kernels::internal {
namespace {

constexpr int kMaxD = 256, kBlock = kInt2MaddBlock;

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

// Logits of kH query heads (digits qd[h][4 * grp + k][hi/lo]) for 8 tokens whose K code
// bytes of group grp start at kc + grp * group_stride; returns the integer sums.
template <int kH>
KVCD_INT2_AVX2_TARGET inline void LogitSums(const uint8_t* kc, int64_t group_stride, int groups4,
                                            const __m256i (*const* qd)[2], __m256i* out) {
  const __m256i three = _mm256_set1_epi8(3);
  for (int h = 0; h < kH; ++h) out[h] = _mm256_setzero_si256();
  for (int g0 = 0; g0 < groups4; g0 += 8) {
    __m256i ahi[kH], alo[kH];
    for (int h = 0; h < kH; ++h) ahi[h] = alo[h] = _mm256_setzero_si256();
    const int g1 = std::min(groups4, g0 + 8);
    if constexpr (kH == 4) {
      __m256i h0 = ahi[0], l0 = alo[0], h1 = ahi[1], l1 = alo[1];
      __m256i h2 = ahi[2], l2 = alo[2], h3 = ahi[3], l3 = alo[3];
#pragma GCC unroll 8
      for (int grp = g0; grp < g1; ++grp) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kc + grp * group_stride));
        MaddAcc4x2(Plane<0>(raw, three), qd, 4 * grp + 0, h0, l0, h1, l1, h2, l2, h3, l3);
        MaddAcc4x2(Plane<1>(raw, three), qd, 4 * grp + 1, h0, l0, h1, l1, h2, l2, h3, l3);
        MaddAcc4x2(Plane<2>(raw, three), qd, 4 * grp + 2, h0, l0, h1, l1, h2, l2, h3, l3);
        MaddAcc4x2(Plane<3>(raw, three), qd, 4 * grp + 3, h0, l0, h1, l1, h2, l2, h3, l3);
      }
      ahi[0] = h0, alo[0] = l0, ahi[1] = h1, alo[1] = l1;
      ahi[2] = h2, alo[2] = l2, ahi[3] = h3, alo[3] = l3;
    } else {
      for (int grp = g0; grp < g1; ++grp) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kc + grp * group_stride));
        const __m256i x[4] = {Plane<0>(raw, three), Plane<1>(raw, three), Plane<2>(raw, three),
                              Plane<3>(raw, three)};
        for (int k = 0; k < 4; ++k) {
          for (int h = 0; h < kH; ++h) {
            ahi[h] = MaddAcc(ahi[h], x[k], qd[h][4 * grp + k][0]);
            alo[h] = MaddAcc(alo[h], x[k], qd[h][4 * grp + k][1]);
          }
        }
      }
    }
    for (int h = 0; h < kH; ++h) out[h] = _mm256_add_epi32(out[h], CombineDigits(ahi[h], alo[h]));
  }
}

// kGroup is a compile-time constant so the per-head accumulators live in registers; heads
// are processed kH = min(kGroup, 4) at a time (8 int16 accumulators + codes fit in 16 ymm).
// kD > 0 fixes head_dim at compile time (loop bounds and strides become constants).
template <int kGroup, int kD>
KVCD_INT2_AVX2_TARGET void AttendInt2Madd(const Int2PageTable& kv, int kv_head, const float* q,
                                          float softmax_scale, int64_t token_begin,
                                          int64_t token_end, float* o, float* lse) {
  constexpr int G = kGroup, kH = G < 4 ? G : 4;
  const int d = kD > 0 ? kD : kv.head_dim, ps = kv.page_size, q4 = d / 4, groups4 = q4 / 4;
  const Int2PageLayout layout{kv.num_kv_heads, ps, d};
  // Query digits broadcast to full vectors (vpmaddubsw takes them as memory operands):
  // qd[i][4*grp + k][0 hi / 1 lo] = the digits of elements k*Q + 4*grp + 0..3.
  alignas(32) __m256i qd[G][kMaxD / 4][2];
  alignas(32) float sb[G][kBlock];  // logits, then probabilities, then weights
  float qsum[G], qunit[G], qbias[G], m[G], l[G], lacc[G];
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
    double resid = 0.0;  // Σ (q - digits): times the mean code 1.5, added back to each logit
    for (int k = 0; k < 4; ++k) {
      for (int grp = 0; grp < groups4; ++grp) {
        int hi[4], lo[4];
        for (int b = 0; b < 4; ++b) {
          const float x = qs[k * q4 + 4 * grp + b];
          SplitDigits(x, step, &hi[b], &lo[b]);
          resid += static_cast<double>(x) -
                   (static_cast<double>(hi[b]) * step + static_cast<double>(lo[b]) * qunit[i]);
        }
        qd[i][4 * grp + k][0] = _mm256_set1_epi32(Pack4(hi));
        qd[i][4 * grp + k][1] = _mm256_set1_epi32(Pack4(lo));
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
    // Work on 8-aligned slots [a0, a0 + span) of the page (<= 64), masking the slots outside.
    const Int2MaddSpan blk(t0, token_end, ps);
    const int64_t page = blk.page;
    const int off = blk.off, n = blk.n, a0 = blk.a0, nv = blk.nv;
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[page] * kv.page_stride;
    const Int2RowRef kr = layout.K(pb, kv_head);
    const Int2RowRef vr = layout.V(pb, kv_head);
    if (off + n == ps && t0 + n < token_end) {
      prefetch.Target(page + 1);  // fetched in slices through this block's logits
    } else {
      prefetch.Clear();
    }
    // --- logits, 8 tokens per vector ---
    const uint8_t* kc = kr.codes + int64_t{a0} * 4;
    const int64_t kgroup_stride = int64_t{ps} * 4;
    for (int v = 0; v < nv; ++v) {
      prefetch.Slice(v, nv);
      const __m256 sc =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr.scale + a0 + 8 * v)));
      const __m256 lo =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr.lo + a0 + 8 * v)));
      for (int h0 = 0; h0 < G; h0 += kH) {
        const __m256i(*qh[kH])[2];
        for (int h = 0; h < kH; ++h) qh[h] = qd[h0 + h];
        __m256i sums[kH];
        LogitSums<kH>(kc + 32 * v, kgroup_stride, groups4, qh, sums);
        for (int h = 0; h < kH; ++h) {
          const int i = h0 + h;
          const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h]), _mm256_set1_ps(qunit[i]),
                                             _mm256_set1_ps(qbias[i]));
          _mm256_store_ps(sb[i] + 8 * v,
                          _mm256_fmadd_ps(dot, sc, _mm256_mul_ps(lo, _mm256_set1_ps(qsum[i]))));
        }
      }
    }
    Int2MaddValues<G>(vr, a0, blk.span, blk.lead, blk.tail, d, sb, m, l, lacc, o);
    t0 += n;
  }
  FinishInt2States(G, d, m, l, lacc, o, lse);
}

}  // namespace

void AttendInt2PagesAvx2(const Int2PageTable& kv, int kv_head, const float* q, int group,
                         float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                         float* lse) {
  if (CpuHasF16c() && kv.head_dim % 32 == 0 && kv.head_dim <= kMaxD && kv.page_size % 8 == 0) {
    // One instantiation per GQA group size in common use; head_dim 128 fixed at compile time,
    // the others read at run time (kD = 0). Other group sizes: the FP32 path below.
    const bool done = DispatchGroupSize(
        group,
        [&](auto g) {
          auto madd = [&](auto hd) {
            AttendInt2Madd<decltype(g)::value, decltype(hd)::value>(kv, kv_head, q, softmax_scale,
                                                                    token_begin, token_end, o, lse);
          };
          DispatchHeadDim(
              kv.head_dim,
              [&](auto hd) { madd(HeadDim < decltype(hd)::value == 128 ? 128 : 0 > {}); },
              [&] { madd(HeadDim<0>{}); });
          return true;
        },
        [] { return false; });
    if (done) return;
  }
  AttendInt2PagesImpl<Avx2Ops>(kv, kv_head, q, group, softmax_scale, token_begin, token_end, o,
                               lse);
}

}  // namespace kvcd::kernels::internal
