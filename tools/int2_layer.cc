#include "tools/int2_layer.h"

#include <algorithm>
#include <cmath>

#include "kvcd/kernels/int2_codec.h"

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
    const kernels::Rotation kind = kernels::ClassifyRotation(r, d);  // once, not per row
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = t * hkv + h;
      kernels::DemoteRowsToInt2(rows.data() + row * d, 1, d, r, kind, rho, ref);
      kernels::ExpandInt2Rows(ref, 1, d, r, out->data() + row * d);
    }
  }
}

namespace {

// Softmax attention output of query head h (double) over rows [0, n) of kv head kvh.
void AttendHead(const float* q, const float* k, const float* v, int64_t n, int hkv, int kvh, int d,
                double scale, std::vector<double>* logits, double* o) {
  logits->resize(static_cast<size_t>(n));
  double mx = -1e300;
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = k + (t * hkv + kvh) * d;
    double s = 0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(q[c]) * kt[c];
    (*logits)[t] = s * scale;
    mx = std::max(mx, (*logits)[t]);
  }
  double sum = 0;
  std::fill(o, o + d, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const double p = std::exp((*logits)[t] - mx);
    sum += p;
    const float* vt = v + (t * hkv + kvh) * d;
    for (int c = 0; c < d; ++c) o[c] += p * vt[c];
  }
  for (int c = 0; c < d; ++c) o[c] /= sum;
}

}  // namespace

std::vector<double> ExactOutputs(const LayerActivations& a, int hq, int hkv, int d,
                                 const std::vector<int64_t>& queries) {
  const int g = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> o(queries.size() * hq * d), logits;
  for (size_t i = 0; i < queries.size(); ++i) {
    const int64_t t = queries[i];
    for (int h = 0; h < hq; ++h) {
      AttendHead(a.q.data() + (t * hq + h) * d, a.k.data(), a.v.data(), t + 1, hkv, h / g, d, scale,
                 &logits, o.data() + (i * hq + h) * d);
    }
  }
  return o;
}

double StoredAttentionError(const LayerActivations& a, int hq, int hkv, int d,
                            const std::vector<float>& k_bf16, const std::vector<float>& v_bf16,
                            const std::vector<float>& k_hat, const std::vector<float>& v_hat,
                            const StoredWindows& w, const std::vector<int64_t>& queries,
                            int kv_head, const std::vector<double>* exact) {
  const int g = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<double> own =
      exact != nullptr ? std::vector<double>() : ExactOutputs(a, hq, hkv, d, queries);
  const std::vector<double>& ref = exact != nullptr ? *exact : own;
  std::vector<float> ks, vs;
  std::vector<double> oh(static_cast<size_t>(d)), logits;
  double total = 0;
  int64_t count = 0;
  for (size_t i = 0; i < queries.size(); ++i) {
    const int64_t t = queries[i];
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
    for (int h = 0; h < hq; ++h) {
      if (kv_head >= 0 && h / g != kv_head) continue;
      AttendHead(a.q.data() + (t * hq + h) * d, ks.data(), vs.data(), t + 1, hkv, h / g, d, scale,
                 &logits, oh.data());
      const double* o = ref.data() + (i * hq + h) * d;
      double err = 0, norm = 0;
      for (int c = 0; c < d; ++c) {
        const double diff = oh[c] - o[c];
        err += diff * diff;
        norm += o[c] * o[c];
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
