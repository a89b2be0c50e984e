#include "kvcd/kernels/bf16_attention.h"

#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::kernels {
namespace internal {
#define KVCD_DECLARE_BF16_ATTEND(fn)                                                            \
  void fn(const Bf16PageTable& kv, int kv_head, const float* q, int group, float softmax_scale, \
          int64_t token_begin, int64_t token_end, float* o, float* lse);
KVCD_DECLARE_BF16_ATTEND(AttendBf16PagesScalar)
KVCD_DECLARE_BF16_ATTEND(AttendBf16PagesAvx2)
KVCD_DECLARE_BF16_ATTEND(AttendBf16PagesAvx512)
#undef KVCD_DECLARE_BF16_ATTEND
}  // namespace internal

void AttendBf16Pages(const Bf16PageTable& kv, int kv_head, const float* q, int group,
                     float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                     float* lse, CpuIsa isa) {
  // The vector primitives step 16 (AVX-512) or 8 (AVX2) floats at a time.
  ForIsa(UsableIsa(isa, kv.head_dim, 16, 8), internal::AttendBf16PagesScalar,
         internal::AttendBf16PagesAvx2, internal::AttendBf16PagesAvx512)(
      kv, kv_head, q, group, softmax_scale, token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels
