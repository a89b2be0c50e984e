#include "bench/replay/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvcd::replay {

ReferenceAttention AttendReference(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, int64_t tokens, int num_q_heads,
                                   int num_kv_heads, int head_dim, double scale) {
  ReferenceAttention r;
  r.o.assign(static_cast<size_t>(num_q_heads) * head_dim, 0.0);
  r.lse.assign(static_cast<size_t>(num_q_heads), -std::numeric_limits<double>::infinity());
  const int group = std::max(1, num_q_heads / std::max(1, num_kv_heads));
  std::vector<double> s(static_cast<size_t>(tokens));
  for (int h = 0; h < num_q_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q.data() + static_cast<size_t>(h) * head_dim;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < tokens; ++t) {
      const float* kt = k.data() + (static_cast<size_t>(t) * num_kv_heads + kvh) * head_dim;
      double dot = 0;
      for (int e = 0; e < head_dim; ++e) dot += static_cast<double>(qh[e]) * kt[e];
      s[static_cast<size_t>(t)] = dot * scale;
      m = std::max(m, s[static_cast<size_t>(t)]);
    }
    if (tokens == 0) continue;
    double sum = 0;
    double* oh = r.o.data() + static_cast<size_t>(h) * head_dim;
    for (int64_t t = 0; t < tokens; ++t) {
      const double w = std::exp(s[static_cast<size_t>(t)] - m);
      sum += w;
      const float* vt = v.data() + (static_cast<size_t>(t) * num_kv_heads + kvh) * head_dim;
      for (int e = 0; e < head_dim; ++e) oh[e] += w * vt[e];
    }
    for (int e = 0; e < head_dim; ++e) oh[e] /= sum;
    r.lse[static_cast<size_t>(h)] = m + std::log(sum);
  }
  return r;
}

}  // namespace kvcd::replay
