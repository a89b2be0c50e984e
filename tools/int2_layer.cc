#include "tools/int2_layer.h"

#include <algorithm>
#include <cmath>

#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/reference_attention.h"

namespace kvcd {

void Int2RoundTrip(const std::vector<float>& rows, int64_t n, int hkv, int d, const Int2Layer& c,
                   int which, int kv_head, std::vector<float>* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(d / 4));
  uint16_t params[2];
  const auto ref = kernels::Int2RowRef::RowMajor(codes.data(), d / 4, &params[0], &params[1], 2);
  const size_t dd = static_cast<size_t>(d) * d;
  for (int h = 0; h < hkv; ++h) {
    if (kv_head >= 0 && h != kv_head) continue;
    const int g = c.Group(h);
    const float* r = (which == 0 ? c.r_k : c.r_v).data() + g * dd;
    const float rho = (which == 0 ? c.rho_k : c.rho_v)[static_cast<size_t>(g)];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = t * hkv + h;
      kernels::DemoteRowsToInt2(rows.data() + row * d, 1, d, r, rho, ref);
      kernels::ExpandInt2Rows(ref, 1, d, r, out->data() + row * d);
    }
  }
}

double StoredAttentionError(const LayerActivations& a, int hq, int hkv, int d,
                            const std::vector<float>& k_bf16, const std::vector<float>& v_bf16,
                            const std::vector<float>& k_hat, const std::vector<float>& v_hat,
                            const StoredWindows& w, const std::vector<int64_t>& queries,
                            int kv_head) {
  const int g = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<float> ks, vs;
  std::vector<double> o(static_cast<size_t>(hq * d)), oh(o.size()), l(static_cast<size_t>(hq));
  double total = 0;
  int64_t count = 0;
  for (int64_t t : queries) {
    const int64_t rows = (t + 1) * hkv * d;
    ks.assign(k_bf16.begin(), k_bf16.begin() + rows);
    vs.assign(v_bf16.begin(), v_bf16.begin() + rows);
    const int64_t hist_end = std::max<int64_t>(w.sink, t + 1 - w.recent);
    if (hist_end > w.sink) {
      std::copy(k_hat.begin() + w.sink * hkv * d, k_hat.begin() + hist_end * hkv * d,
                ks.begin() + w.sink * hkv * d);
      std::copy(v_hat.begin() + w.sink * hkv * d, v_hat.begin() + hist_end * hkv * d,
                vs.begin() + w.sink * hkv * d);
    }
    const float* q = a.q.data() + t * hq * d;
    kernels::ReferenceAttention(q, a.k.data(), a.v.data(), t + 1, hq, hkv, d, scale, o.data(),
                                l.data());
    kernels::ReferenceAttention(q, ks.data(), vs.data(), t + 1, hq, hkv, d, scale, oh.data(),
                                l.data());
    for (int h = 0; h < hq; ++h) {
      if (kv_head >= 0 && h / g != kv_head) continue;
      double err = 0, norm = 0;
      for (int c = 0; c < d; ++c) {
        const double diff = oh[h * d + c] - o[h * d + c];
        err += diff * diff;
        norm += o[h * d + c] * o[h * d + c];
      }
      if (norm > 0) {
        total += std::sqrt(err / norm);
        ++count;
      }
    }
  }
  return count > 0 ? total / count : 0.0;
}

}  // namespace kvcd
