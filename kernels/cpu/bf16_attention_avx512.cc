// BF16 paged decode attention, avx512 instantiation.
#include "bf16_attention_impl.h"
#include "simd_avx512.h"

namespace kvcd::kernels::internal {

void AttendBf16PagesAvx512(const Bf16PageTable& kv, int kv_head, const float* q, int group,
                           float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                           float* lse) {
  AttendBf16PagesImpl<Avx512Ops>(kv, kv_head, q, group, softmax_scale, token_begin, token_end, o,
                                 lse);
}

}  // namespace kvcd::kernels::internal
