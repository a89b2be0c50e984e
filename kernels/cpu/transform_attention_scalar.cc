// Transform-coded key attention, scalar instantiation.
#include "simd_scalar.h"
#include "transform_attention_impl.h"

namespace kvcd::kernels::internal {
namespace {

struct ScalarTransformOps : ScalarOps {
  static void UnpackTransform(const uint8_t* padded, const TransformDirections& dirs, int d,
                              float* out) {
    UnpackTransformScalar(padded, dirs, d, out);
  }
};

}  // namespace

void AttendTransformPagesScalar(const TransformPageTable& kv, int kv_head,
                                const TransformKeyCode& key, const float* r_v, const float* q,
                                int group, float softmax_scale, int64_t token_begin,
                                int64_t token_end, float* o, float* lse) {
  AttendTransformPagesImpl<ScalarTransformOps>(kv, kv_head, key, r_v, q, group, softmax_scale,
                                               token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
