// INT2 paged decode attention, scalar instantiation.
#include "int2_attention_impl.h"
#include "simd_scalar.h"

namespace kvcd::kernels::internal {

void AttendInt2PagesScalar(const Int2PageTable& kv, int kv_head, const float* q, int group,
                           float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                           float* lse) {
  AttendInt2PagesImpl<ScalarOps>(kv, kv_head, q, group, softmax_scale, token_begin, token_end, o,
                                 lse);
}

}  // namespace kvcd::kernels::internal
