// FSQ paged decode attention, AVX-512 instantiation: the key rebuild keeps kTokens x 2
// vectors of 16 head dims in registers (16 of the 32 zmm), 2 loads of W_k^T, kTokens
// broadcasts and 2*kTokens FMAs per latent coordinate.
#include <immintrin.h>

#include "fsq_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

struct FsqAvx512Ops {
  static constexpr int kTokens = 8;
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
