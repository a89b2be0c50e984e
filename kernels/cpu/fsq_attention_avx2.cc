// FSQ paged decode attention, AVX2+FMA instantiation. The key rebuild keeps kTokens x 2
// vectors of 8 head dims in registers and streams W_k^T rows: per latent g, 2 loads of W,
// kTokens broadcasts of z_j[g] and 2*kTokens FMAs.
#include <immintrin.h>

#include "fsq_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

float HorizontalSum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 0x55));
  return _mm_cvtss_f32(x);
}

struct FsqAvx2Ops {
  static constexpr int kTokens = 6;  // 12 accumulators + 2 weights + 1 broadcast <= 16 ymm

  // 16 coordinates per 8 code bytes: low and high nibbles interleaved, widened, minus 8.
  static void Unpack(const uint8_t* code, int G, float* z) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256 eight = _mm256_set1_ps(8.0f);
    int g = 0;
    for (; g + 16 <= G; g += 16) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + g / 2));
      const __m128i lo = _mm_and_si128(x, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
      const __m128i nib = _mm_unpacklo_epi8(lo, hi);
      _mm256_storeu_ps(z + g, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), eight));
      _mm256_storeu_ps(
          z + g + 8,
          _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8))), eight));
    }
    if (g < G) FsqUnpackToFloat<FsqAvx2Ops>(code + g / 2, G - g, z + g);
  }

  // out[h * stride] = q_h . k: four heads per pass (four independent FMA chains), the rest
  // with two chains each. d is a multiple of 16.
  static void Logits(const float* qs, int group, const float* k, int d, float* out, int stride) {
    int h = 0;
    for (; h + 4 <= group; h += 4) {
      const float* q = qs + int64_t{h} * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < d; i += 8) {
        const __m256 kv = _mm256_loadu_ps(k + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + i), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * d + i), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * d + i), kv, a3);
      }
      out[h * stride] = HorizontalSum(a0);
      out[(h + 1) * stride] = HorizontalSum(a1);
      out[(h + 2) * stride] = HorizontalSum(a2);
      out[(h + 3) * stride] = HorizontalSum(a3);
    }
    for (; h < group; ++h) {
      const float* q = qs + int64_t{h} * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;
      for (int i = 0; i < d; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
      }
      out[h * stride] = HorizontalSum(_mm256_add_ps(a0, a1));
    }
  }

  // d is a multiple of 16 (the dispatcher falls back to scalar otherwise).
  static void RebuildKeys(const float* wt, const float* bias, const float* zf, int G, int d,
                          float* kb) {
    for (int c = 0; c < d; c += 16) {
      __m256 acc[kTokens][2];
      const __m256 b0 = _mm256_loadu_ps(bias + c), b1 = _mm256_loadu_ps(bias + c + 8);
      for (int j = 0; j < kTokens; ++j) {
        acc[j][0] = b0;
        acc[j][1] = b1;
      }
      const float* w = wt + c;
      for (int g = 0; g < G; ++g, w += d) {
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        for (int j = 0; j < kTokens; ++j) {
          const __m256 z = _mm256_broadcast_ss(zf + j * G + g);
          acc[j][0] = _mm256_fmadd_ps(w0, z, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(w1, z, acc[j][1]);
        }
      }
      for (int j = 0; j < kTokens; ++j) {
        _mm256_storeu_ps(kb + j * d + c, acc[j][0]);
        _mm256_storeu_ps(kb + j * d + c + 8, acc[j][1]);
      }
    }
  }
};

}  // namespace

void AttendFsqPagesAvx2(const FsqPageTable& pages, const FsqLayerCodec& codec, const RopeSpec& rope,
                        int kv_head, const float* q, int group, float softmax_scale,
                        int64_t token_begin, int64_t token_end, float* o, float* lse) {
  AttendFsqPagesImpl<FsqAvx2Ops>(pages, codec, rope, kv_head, q, group, softmax_scale, token_begin,
                                 token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
