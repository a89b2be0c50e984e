// Transform-coded key attention, AVX2 instantiation.
//
// Integer path (F16C, head_dim 32/64/96/128, page_size % 8 == 0, group 1/2/3/4/8):
//  - keys: a row's bit stream is decoded 16 directions per vector into int16 lanes without
//    per-direction bit extraction: each 128-bit lane loads the 16 bytes from the byte of its
//    first direction's code, vpshufb puts each direction's two bytes (a code of <= 8 bits at
//    bit shift s <= 7 spans <= 2 bytes) into its lane, vpmullw by 2^(8 - s) moves it to
//    bits 8.., a mask keeps its b bits and vpmulhuw by 2^(16 - b) leaves c' = c 2^(8 - b),
//    every code widened to 8 bits. The projected query times 2^(b - 8), a', is rounded to
//    int16 per head (step = max|a'| / 32767: every direction to the same relative
//    precision) and vpmaddwd sums the products into int32; the 8 rows of a tile are
//    reduced by a vphaddd tree, and the centring is exact in integers:
//      logit = c_mean + g (step / 2) (2 Σ a'_q c' - Σ a'_q (2^b - 1) 2^(8 - b))
//    (mod 2^32 is exact: |result| <= 32767 * 255 * head_dim < 2^31 at head_dim <= 128).
//    Rounding a' leaves <= step / 2 per direction, times |c' - half'| <= 128.
//    The 16-byte loads may read up to 16 bytes past a row: the page's later key rows, its
//    key gains (>= 16 bytes at page_size >= 8) and values lie behind, inside the page.
//  - values: the int2-oscar integer path (int2_values_avx2.h) on the same value layout.
// Other geometries: the FP32 path, a row's codes unpacked 8 directions at a time (one 32-bit
// gather at each direction's byte, a variable shift and a mask) and the AVX2+FMA primitives
// of simd_avx2.h.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "int2_values_avx2.h"
#include "kvcd/kernels/dispatch.h"
#include "simd_avx2.h"
#include "transform_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

struct Avx2TransformOps : Avx2Ops {
  static void UnpackTransform(const uint8_t* padded, const TransformDirections& dirs, int d,
                              float* out) {
    for (int i = 0; i < d; i += 8) {
      const __m256i off = _mm256_load_si256(reinterpret_cast<const __m256i*>(dirs.off + i));
      const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(padded), off, 1);
      const __m256i c = _mm256_and_si256(
          _mm256_srlv_epi32(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(dirs.shift + i))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(dirs.mask + i)));
      _mm256_storeu_ps(out + i,
                       _mm256_sub_ps(_mm256_cvtepi32_ps(c), _mm256_load_ps(dirs.half + i)));
    }
  }
};

constexpr int kMaxIntD = 128, kMaxChunks = kMaxIntD / 16;

// Decode tables of one head's bit stream: chunk c holds directions 16c..16c+15, lane h of
// it directions 16c+8h.., loaded from byte base[2c + h].
struct TransformLanes {
  int32_t base[2 * kMaxChunks];
  alignas(32) uint8_t shuf[kMaxChunks][32];
  alignas(32) uint16_t mul[kMaxChunks][16];    // 2^(8 - s): the code to bits 8..8+b-1
  alignas(32) uint16_t mask[kMaxChunks][16];   // (2^b - 1) << 8
  alignas(32) uint16_t widen[kMaxChunks][16];  // 2^(16 - b): high half = c 2^(8 - b)
  explicit TransformLanes(const TransformKeyCode& key) {
    int pos[kMaxIntD + 1];
    pos[0] = 0;
    for (int i = 0; i < key.d; ++i) pos[i + 1] = pos[i] + key.bits[i];
    for (int i = 0; i < key.d; ++i) {
      const int c = i / 16, h = (i % 16) / 8, e = i % 8;
      if (e == 0) base[2 * c + h] = pos[i] >> 3;
      const int rel = (pos[i] >> 3) - base[2 * c + h];  // <= 7 + 1: inside the 16 bytes
      shuf[c][16 * h + 2 * e] = static_cast<uint8_t>(rel);
      shuf[c][16 * h + 2 * e + 1] = static_cast<uint8_t>(rel + 1);
      mul[c][8 * h + e] = static_cast<uint16_t>(1u << (8 - (pos[i] & 7)));
      mask[c][8 * h + e] = static_cast<uint16_t>(((1u << key.bits[i]) - 1) << 8);
      widen[c][8 * h + e] = static_cast<uint16_t>(key.bits[i] > 0 ? 1u << (16 - key.bits[i]) : 0);
    }
  }
};

#define KVCD_XFORM_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

// The codes of one row widened to 8 bits, c 2^(8 - b) (int16 lanes, directions in order,
// kC chunks of 16).
template <int kC>
KVCD_XFORM_AVX2_TARGET inline void DecodeRowInt16(const uint8_t* row, const TransformLanes& t,
                                                  __m256i* codes) {
#pragma GCC unroll 8
  for (int c = 0; c < kC; ++c) {
    const __m256i raw =
        _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row + t.base[2 * c + 1]),
                            reinterpret_cast<const __m128i*>(row + t.base[2 * c]));
    const __m256i x = _mm256_mullo_epi16(
        _mm256_shuffle_epi8(raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.shuf[c]))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mul[c])));
    codes[c] = _mm256_mulhi_epu16(
        _mm256_and_si256(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mask[c]))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(t.widen[c])));
  }
}

// Lane sums of 8 vectors: result lane r = Σ lanes of v[r] (int32, wrapping).
KVCD_XFORM_AVX2_TARGET inline __m256i ReduceRows8(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  // u0 = [r0..r3 of the low halves | r0..r3 of the high halves], u1 the same for r4..r7.
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

template <int kGroup, int kD>
KVCD_XFORM_AVX2_TARGET void AttendTransformMadd(const TransformPageTable& kv, int kv_head,
                                                const TransformKeyCode& key, const float* r_v,
                                                const float* q, float softmax_scale,
                                                int64_t token_begin, int64_t token_end, float* out,
                                                float* lse) {
  constexpr int G = kGroup, kC = kD / 16, kBlock = kInt2MaddBlock;
  const TransformPageLayout& layout = kv.layout;
  const int d = kD, ps = layout.page_size, cb = layout.code_bytes;
  const TransformLanes lanes(key);
  alignas(32) int16_t qw[G][kD];  // the rounded projected query, direction order
  alignas(32) float o[G * kD];
  alignas(32) float sb[G][kBlock];
  float cmean[G], half_step[G], m[G], l[G], lacc[G];
  int32_t koff[G];
  for (int i = 0; i < G; ++i) {
    alignas(32) float a[kD];
    cmean[i] = ProjectTransformQuery<Avx2Ops>(key, q + i * d, softmax_scale, a);
    // a' = a 2^(b - 8) multiplies the widened codes: every direction is rounded with the
    // same relative precision (the wide directions' a is ~2^b times smaller).
    float amax = 0.0f;
    for (int c = 0; c < d; ++c) {
      a[c] = std::ldexp(a[c], key.bits[c] - 8);
      amax = std::max(amax, std::fabs(a[c]));
    }
    const float step = amax > 0.0f ? amax / 32767.0f : 1.0f;
    half_step[i] = 0.5f * step;
    int64_t k = 0;
    for (int c = 0; c < d; ++c) {
      const int v = std::max(-32767, std::min(32767, _mm_cvtss_si32(_mm_set_ss(a[c] / step))));
      qw[i][c] = static_cast<int16_t>(v);
      k += int64_t{v} * (((1 << key.bits[c]) - 1) << (8 - key.bits[c]));
    }
    koff[i] = static_cast<int32_t>(k);
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    lacc[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const Int2MaddSpan blk(t0, token_end, ps);
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[blk.page] * kv.page_stride;
    const uint8_t* kc = pb + layout.KCodes(kv_head) + int64_t{blk.a0} * cb;
    const auto* kg = reinterpret_cast<const uint16_t*>(pb + layout.KGains(kv_head)) + blk.a0;
    for (int v = 0; v < blk.nv; ++v) {
      alignas(32) __m256i acc[G][8];
      for (int r = 0; r < 8; ++r) {
        __m256i codes[kC];
        DecodeRowInt16<kC>(kc + int64_t{8 * v + r} * cb, lanes, codes);
        for (int i = 0; i < G; ++i) {
          const __m256i* w = reinterpret_cast<const __m256i*>(qw[i]);
          __m256i s = _mm256_madd_epi16(codes[0], _mm256_load_si256(w));
#pragma GCC unroll 8
          for (int c = 1; c < kC; ++c) {
            s = _mm256_add_epi32(s, _mm256_madd_epi16(codes[c], _mm256_load_si256(w + c)));
          }
          acc[i][r] = s;
        }
      }
      const __m256 g =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kg + 8 * v)));
      for (int i = 0; i < G; ++i) {
        const __m256i centred =
            _mm256_sub_epi32(_mm256_slli_epi32(ReduceRows8(acc[i]), 1), _mm256_set1_epi32(koff[i]));
        _mm256_store_ps(sb[i] + 8 * v,
                        _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(centred), g),
                                        _mm256_set1_ps(half_step[i]), _mm256_set1_ps(cmean[i])));
      }
    }
    Int2MaddValues<G>(layout.V(pb, kv_head), blk.a0, blk.span, blk.lead, blk.tail, d, sb, m, l,
                      lacc, o);
    t0 += blk.n;
  }
  FinishInt2States(G, d, m, l, lacc, o, lse);
  UnrotateTransformOutput<Avx2Ops>(r_v, o, G, d, out);
}

// The integer kernel for the (group, head_dim) pair if it has one: group sizes in common use
// (3: SmolLM2-135M, 9 query / 3 KV heads) and the int2-transform format's head dims 32..128
// (the int32 logit sums need head_dim <= 128); false otherwise.
bool AttendTransformMaddAny(const TransformPageTable& kv, int kv_head, const TransformKeyCode& key,
                            const float* r_v, const float* q, int group, float softmax_scale,
                            int64_t token_begin, int64_t token_end, float* o, float* lse) {
  return DispatchValue<1, 2, 3, 4, 8>(
      group,
      [&](auto g) {
        return DispatchValue<32, 64, 96, 128>(
            kv.layout.head_dim,
            [&](auto d) {
              AttendTransformMadd<decltype(g)::value, decltype(d)::value>(
                  kv, kv_head, key, r_v, q, softmax_scale, token_begin, token_end, o, lse);
              return true;
            },
            [] { return false; });
      },
      [] { return false; });
}

#undef KVCD_XFORM_AVX2_TARGET

}  // namespace

void AttendTransformPagesAvx2(const TransformPageTable& kv, int kv_head,
                              const TransformKeyCode& key, const float* r_v, const float* q,
                              int group, float softmax_scale, int64_t token_begin,
                              int64_t token_end, float* o, float* lse) {
  if (CpuHasF16c() && kv.layout.page_size % 8 == 0 &&
      AttendTransformMaddAny(kv, kv_head, key, r_v, q, group, softmax_scale, token_begin, token_end,
                             o, lse)) {
    return;
  }
  AttendTransformPagesImpl<Avx2TransformOps>(kv, kv_head, key, r_v, q, group, softmax_scale,
                                             token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
