#include "kvcd/kernels/transform_attention.h"

#include <cmath>
#include <limits>
#include <vector>

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
  // The AVX2 path serves AVX-512 CPUs too; its vectors step 8 floats.
  if (isa != CpuIsa::kScalar && kv.layout.head_dim % 8 == 0) {
    internal::AttendTransformPagesAvx2(kv, kv_head, key, r_v, q, group, softmax_scale, token_begin,
                                       token_end, o, lse);
    return;
  }
  internal::AttendTransformPagesScalar(kv, kv_head, key, r_v, q, group, softmax_scale, token_begin,
                                       token_end, o, lse);
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
  std::vector<double> logit(static_cast<size_t>(n));
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    float* og = o + g * d;
    if (n == 0) {
      for (int i = 0; i < d; ++i) og[i] = 0.0f;
      lse[g] = -std::numeric_limits<float>::infinity();
      continue;
    }
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += static_cast<double>(qg[i]) * k[t * d + i];
      logit[t] = dot * softmax_scale;
      mx = std::max(mx, logit[t]);
    }
    double sum = 0;
    std::vector<double> acc(static_cast<size_t>(d), 0.0);
    for (int64_t t = 0; t < n; ++t) {
      const double p = std::exp(logit[t] - mx);
      sum += p;
      for (int i = 0; i < d; ++i) acc[i] += p * v[t * d + i];
    }
    for (int i = 0; i < d; ++i) og[i] = static_cast<float>(acc[i] / sum);
    lse[g] = static_cast<float>(mx + std::log(sum));
  }
}

}  // namespace kvcd::kernels
