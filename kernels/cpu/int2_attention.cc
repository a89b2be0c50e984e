#include "kvcd/kernels/int2_attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::kernels {
namespace internal {
#define KVCD_DECLARE_INT2_ATTEND(fn)                                                            \
  void fn(const Int2PageTable& kv, int kv_head, const float* q, int group, float softmax_scale, \
          int64_t token_begin, int64_t token_end, float* o, float* lse);
KVCD_DECLARE_INT2_ATTEND(AttendInt2PagesScalar)
KVCD_DECLARE_INT2_ATTEND(AttendInt2PagesAvx2)
KVCD_DECLARE_INT2_ATTEND(AttendInt2PagesAvx512)
#undef KVCD_DECLARE_INT2_ATTEND
}  // namespace internal

void AttendInt2Pages(const Int2PageTable& kv, int kv_head, const float* q_rot, int group,
                     float softmax_scale, int64_t token_begin, int64_t token_end, float* o_rot,
                     float* lse, CpuIsa isa) {
  // Dot/Axpy/Scale step 16 (AVX-512) or 8 (AVX2) floats.
  ForIsa(UsableIsa(isa, kv.head_dim, 16, 8), internal::AttendInt2PagesScalar,
         internal::AttendInt2PagesAvx2, internal::AttendInt2PagesAvx512)(
      kv, kv_head, q_rot, group, softmax_scale, token_begin, token_end, o_rot, lse);
}

void AttendInt2PagesReference(const Int2PageTable& kv, int kv_head, const float* q_rot, int group,
                              float softmax_scale, int64_t token_begin, int64_t token_end,
                              float* o_rot, float* lse) {
  const int d = kv.head_dim, ps = kv.page_size;
  const Int2PageLayout layout{kv.num_kv_heads, ps, d};
  const int64_t n = token_end - token_begin;
  std::vector<double> k(static_cast<size_t>(n * d)), v(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = token_begin + t;
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[tok / ps] * kv.page_stride;
    const int slot = static_cast<int>(tok % ps);
    float row[256];
    for (int which = 0; which < 2; ++which) {
      const Int2RowRef ref = which == 0 ? layout.K(pb, kv_head) : layout.V(pb, kv_head);
      ExpandInt2Rows(ref, 1, d, nullptr, row, slot);  // x_hat = q*scale + lo
      double* dst = (which == 0 ? k.data() : v.data()) + t * d;
      for (int i = 0; i < d; ++i) dst[i] = row[i];
    }
  }
  std::vector<double> logit(static_cast<size_t>(n));
  for (int g = 0; g < group; ++g) {
    const float* qg = q_rot + g * d;
    float* og = o_rot + g * d;
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
