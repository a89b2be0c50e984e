#include "kvcd/kernels/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvcd::kernels {

void ReferenceAttention(const float* q, const float* k, const float* v, int64_t n, int num_q_heads,
                        int num_kv_heads, int head_dim, double softmax_scale, double* o,
                        double* lse) {
  const int group = num_q_heads / num_kv_heads;
  std::vector<double> logits(static_cast<size_t>(n));
  for (int h = 0; h < num_q_heads; ++h) {
    const int kvh = h / group;
    double* oh = o + static_cast<int64_t>(h) * head_dim;
    std::fill(oh, oh + head_dim, 0.0);
    if (n == 0) {
      lse[h] = -std::numeric_limits<double>::infinity();
      continue;
    }
    const float* qh = q + static_cast<int64_t>(h) * head_dim;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = k + (t * num_kv_heads + kvh) * head_dim;
      double dot = 0;
      for (int i = 0; i < head_dim; ++i) dot += static_cast<double>(qh[i]) * kt[i];
      logits[t] = dot * softmax_scale;
      m = std::max(m, logits[t]);
    }
    double sum = 0;
    for (int64_t t = 0; t < n; ++t) {
      const double p = std::exp(logits[t] - m);
      sum += p;
      const float* vt = v + (t * num_kv_heads + kvh) * head_dim;
      for (int i = 0; i < head_dim; ++i) oh[i] += p * vt[i];
    }
    for (int i = 0; i < head_dim; ++i) oh[i] /= sum;
    lse[h] = m + std::log(sum);
  }
}

}  // namespace kvcd::kernels
