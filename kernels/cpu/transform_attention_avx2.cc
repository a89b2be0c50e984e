// Transform-coded key attention, AVX2 instantiation: a row's codes are unpacked 8
// directions at a time (one 32-bit gather at each direction's byte, a variable shift and
// a mask), centred and converted to float; dots, exponentials and the INT2 value rows use
// the AVX2+FMA primitives of simd_avx2.h. Used where head_dim % 8 == 0.
#include <immintrin.h>

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

}  // namespace

void AttendTransformPagesAvx2(const TransformPageTable& kv, int kv_head,
                              const TransformKeyCode& key, const float* r_v, const float* q,
                              int group, float softmax_scale, int64_t token_begin,
                              int64_t token_end, float* o, float* lse) {
  AttendTransformPagesImpl<Avx2TransformOps>(kv, kv_head, key, r_v, q, group, softmax_scale,
                                             token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
