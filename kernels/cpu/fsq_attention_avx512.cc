// FSQ paged decode attention, AVX-512 instantiation: the key rebuild keeps kTokens x 2
// vectors of 16 head dims in registers (16 of the 32 zmm), 2 loads of W_k^T, kTokens
// broadcasts and 2*kTokens FMAs per latent coordinate.
#include <immintrin.h>

#include "fsq_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

struct FsqAvx512Ops {
  static constexpr int kTokens = 8;

  // 32 coordinates per 16 code bytes: low and high nibbles interleaved, widened, minus 8.
  static void Unpack(const uint8_t* code, int G, float* z) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 eight = _mm512_set1_ps(8.0f);
    int g = 0;
    for (; g + 32 <= G; g += 32) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + g / 2));
      const __m128i lo = _mm_and_si128(x, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
      const __m128i n0 = _mm_unpacklo_epi8(lo, hi), n1 = _mm_unpackhi_epi8(lo, hi);
      _mm512_storeu_ps(z + g, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n0)), eight));
      _mm512_storeu_ps(z + g + 16,
                       _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n1)), eight));
    }
    if (g < G) FsqUnpackToFloat<FsqAvx512Ops>(code + g / 2, G - g, z + g);
  }

  // out[h * stride] = q_h . k: four heads per pass, the rest with two chains each. d is a
  // multiple of 32.
  static void Logits(const float* qs, int group, const float* k, int d, float* out, int stride) {
    int h = 0;
    for (; h + 4 <= group; h += 4) {
      const float* q = qs + int64_t{h} * d;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < d; i += 16) {
        const __m512 kv = _mm512_loadu_ps(k + i);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + i), kv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 2 * d + i), kv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 3 * d + i), kv, a3);
      }
      out[h * stride] = _mm512_reduce_add_ps(a0);
      out[(h + 1) * stride] = _mm512_reduce_add_ps(a1);
      out[(h + 2) * stride] = _mm512_reduce_add_ps(a2);
      out[(h + 3) * stride] = _mm512_reduce_add_ps(a3);
    }
    for (; h < group; ++h) {
      const float* q = qs + int64_t{h} * d;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
      for (int i = 0; i < d; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), a1);
      }
      out[h * stride] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  }
  // d is a multiple of 32 (the dispatcher falls back to AVX2 otherwise).
  static void RebuildKeys(const float* wt, const float* bias, const float* zf, int G, int d,
                          float* kb) {
    for (int c = 0; c < d; c += 32) {
      __m512 acc[kTokens][2];
      const __m512 b0 = _mm512_loadu_ps(bias + c), b1 = _mm512_loadu_ps(bias + c + 16);
      for (int j = 0; j < kTokens; ++j) {
        acc[j][0] = b0;
        acc[j][1] = b1;
      }
      const float* w = wt + c;
      for (int g = 0; g < G; ++g, w += d) {
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        for (int j = 0; j < kTokens; ++j) {
          const __m512 z = _mm512_set1_ps(zf[j * G + g]);
          acc[j][0] = _mm512_fmadd_ps(w0, z, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(w1, z, acc[j][1]);
        }
      }
      for (int j = 0; j < kTokens; ++j) {
        _mm512_storeu_ps(kb + j * d + c, acc[j][0]);
        _mm512_storeu_ps(kb + j * d + c + 16, acc[j][1]);
      }
    }
  }
};

}  // namespace

void AttendFsqPagesAvx512(const FsqPageTable& pages, const FsqLayerCodec& codec,
                          const RopeSpec& rope, int kv_head, const float* q, int group,
                          float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                          float* lse) {
  AttendFsqPagesImpl<FsqAvx512Ops>(pages, codec, rope, kv_head, q, group, softmax_scale,
                                   token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
