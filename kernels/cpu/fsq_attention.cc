// FSQ decode attention: ISA dispatch, and the float64 oracle every version is tested against.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fsq_math.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::kernels {
namespace internal {
#define KVCD_DECLARE_FSQ_ATTEND(fn)                                                         \
  void fn(const FsqPageTable& pages, const FsqLayerCodec& codec, const RopeSpec& rope,      \
          int kv_head, const float* q, int group, float softmax_scale, int64_t token_begin, \
          int64_t token_end, float* o, float* lse);
KVCD_DECLARE_FSQ_ATTEND(AttendFsqPagesScalar)
KVCD_DECLARE_FSQ_ATTEND(AttendFsqPagesAvx2)
KVCD_DECLARE_FSQ_ATTEND(AttendFsqPagesAvx512)
#undef KVCD_DECLARE_FSQ_ATTEND
}  // namespace internal

void AttendFsqPages(const FsqPageTable& pages, const FsqLayerCodec& codec, const RopeSpec& rope,
                    int kv_head, const float* q, int group, float softmax_scale,
                    int64_t token_begin, int64_t token_end, float* o, float* lse, CpuIsa isa) {
  // The key rebuild works on 2 vectors of head dims at a time: 32 (AVX-512) or 16 (AVX2).
  ForIsa(UsableIsa(isa, codec.head_dim, 32, 16), internal::AttendFsqPagesScalar,
         internal::AttendFsqPagesAvx2, internal::AttendFsqPagesAvx512)(
      pages, codec, rope, kv_head, q, group, softmax_scale, token_begin, token_end, o, lse);
}

void AttendFsqPagesReference(const FsqPageTable& pages, const FsqLayerCodec& codec,
                             const RopeSpec& rope, int kv_head, const float* q, int group,
                             float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                             float* lse) {
  const int d = codec.head_dim, G = codec.latent_width, ps = pages.page_size;
  const int64_t n = std::max<int64_t>(0, token_end - token_begin);
  const int64_t cb = FsqCodeBytes(G);
  std::vector<double> k(static_cast<size_t>(n * d)), v(static_cast<size_t>(n * d));
  std::vector<int8_t> z(static_cast<size_t>(G));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = token_begin + j;
    const uint8_t* code = pages.base + pages.page_ids[t / ps] * pages.page_stride + (t % ps) * cb;
    FsqUnpackCode(code, G, z.data());
    internal::FsqRebuildKeyDouble(codec, rope, kv_head, z.data(), pages.first_position + t,
                                  k.data() + j * d);
    internal::FsqDecodeHeadDouble(codec.decoder_v, codec.bias_v, kv_head, d, G, z.data(),
                                  v.data() + j * d);
  }
  std::vector<double> logit(static_cast<size_t>(n)), acc(static_cast<size_t>(d));
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    float* og = o + g * d;
    if (n == 0) {
      std::fill(og, og + d, 0.0f);
      lse[g] = -std::numeric_limits<float>::infinity();
      continue;
    }
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += static_cast<double>(qg[i]) * k[j * d + i];
      logit[j] = dot * softmax_scale;
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      const double p = std::exp(logit[j] - mx);
      sum += p;
      for (int i = 0; i < d; ++i) acc[i] += p * v[j * d + i];
    }
    for (int i = 0; i < d; ++i) og[i] = static_cast<float>(acc[i] / sum);
    lse[g] = static_cast<float>(mx + std::log(sum));
  }
}

}  // namespace kvcd::kernels
