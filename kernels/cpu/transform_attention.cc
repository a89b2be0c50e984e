#include "kvcd/kernels/transform_attention.h"

#include <cstddef>
#include <vector>

#include "kvcd/kernels/isa_dispatch.h"
#include "kvcd/kernels/reference_attention.h"

namespace kvcd::kernels {
namespace internal {
#define KVCD_DECLARE_TRANSFORM_ATTEND(fn)                                                        \
  void fn(const TransformPageTable& kv, int kv_head, const TransformKeyCode& key,                \
          const float* r_v, const float* q, int group, float softmax_scale, int64_t token_begin, \
          int64_t token_end, float* o, float* lse);
KVCD_DECLARE_TRANSFORM_ATTEND(AttendTransformPagesScalar)
KVCD_DECLARE_TRANSFORM_ATTEND(AttendTransformPagesAvx2)
#undef KVCD_DECLARE_TRANSFORM_ATTEND
}  // namespace internal

void AttendTransformPages(const TransformPageTable& kv, int kv_head, const TransformKeyCode& key,
                          const float* r_v, const float* q, int group, float softmax_scale,
                          int64_t token_begin, int64_t token_end, float* o, float* lse,
                          CpuIsa isa) {
  // The AVX2 version serves AVX-512 CPUs too; its vectors step 8 floats.
  ForIsa(UsableIsa(isa, kv.layout.head_dim, 8, 8), internal::AttendTransformPagesScalar,
         internal::AttendTransformPagesAvx2, internal::AttendTransformPagesAvx2)(
      kv, kv_head, key, r_v, q, group, softmax_scale, token_begin, token_end, o, lse);
}

void AttendTransformPagesReference(const TransformPageTable& kv, int kv_head,
                                   const TransformKeyCode& key, const float* r_v, const float* q,
                                   int group, float softmax_scale, int64_t token_begin,
                                   int64_t token_end, float* o, float* lse) {
  const TransformPageLayout& layout = kv.layout;
  const int d = layout.head_dim, ps = layout.page_size;
  const int64_t n = token_end - token_begin;
  std::vector<float> k(static_cast<size_t>(n * d)), v(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = token_begin + t;
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[tok / ps] * kv.page_stride;
    const int slot = static_cast<int>(tok % ps);
    DecodeTransformKeys(key, pb + layout.KCodes(kv_head) + int64_t{slot} * layout.code_bytes, 0,
                        reinterpret_cast<const uint16_t*>(pb + layout.KGains(kv_head)) + slot, 0, 1,
                        k.data() + t * d);
    ExpandInt2Rows(layout.V(pb, kv_head), 1, d, r_v, v.data() + t * d, slot);
  }
  std::vector<double> od(static_cast<size_t>(group) * d), ld(static_cast<size_t>(group));
  ReferenceAttention(q, k.data(), v.data(), n, group, 1, d, softmax_scale, od.data(), ld.data());
  for (int i = 0; i < group * d; ++i) o[i] = static_cast<float>(od[i]);
  for (int g = 0; g < group; ++g) lse[g] = static_cast<float>(ld[g]);
}

}  // namespace kvcd::kernels
