// FSQ paged decode attention, AVX2+FMA instantiation. The key rebuild keeps kTokens x 2
// vectors of 8 head dims in registers and streams W_k^T rows: per latent g, 2 loads of W,
// kTokens broadcasts of z_j[g] and 2*kTokens FMAs.
#include <immintrin.h>

#include "fsq_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

struct FsqAvx2Ops {
  static constexpr int kTokens = 6;  // 12 accumulators + 2 weights + 1 broadcast <= 16 ymm
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
