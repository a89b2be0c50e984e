#include "common/layer_activations.h"

#include <cstddef>

namespace kvcd {
namespace {

// Q_gh^T Q_gh / n_h for KV head h, d x d.
std::vector<double> GroupQueryGram(const LayerActivations& a, int64_t n, int hq, int hkv, int d,
                                   int h) {
  const int g = hq / hkv;
  std::vector<double> c(static_cast<size_t>(d) * d, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int j = 0; j < g; ++j) {
      const float* q = a.q.data() + (t * hq + h * g + j) * d;
      for (int x = 0; x < d; ++x)
        for (int y = 0; y < d; ++y) c[x * d + y] += static_cast<double>(q[x]) * q[y];
    }
  }
  const double nh = static_cast<double>(n) * g;
  for (auto& v : c) v /= nh;
  return c;
}

}  // namespace

std::vector<double> KeyCovariance(const LayerActivations& a, int64_t n, int hq, int hkv, int d) {
  std::vector<double> c(static_cast<size_t>(d) * d, 0.0);
  for (int h = 0; h < hkv; ++h) {
    const auto gram = GroupQueryGram(a, n, hq, hkv, d, h);
    for (size_t i = 0; i < c.size(); ++i) c[i] += gram[i] / hkv;
  }
  return c;
}

std::vector<double> ValueCovariance(const LayerActivations& a, int64_t n, int hq, int hkv, int d) {
  std::vector<double> c(static_cast<size_t>(d) * d, 0.0);
  for (int h = 0; h < hkv; ++h) {
    const auto gram = GroupQueryGram(a, n, hq, hkv, d, h);
    std::vector<double> w(static_cast<size_t>(n));
    double total = 0;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = a.k.data() + (t * hkv + h) * d;
      double acc = 0;
      for (int x = 0; x < d; ++x) {
        double row = 0;
        for (int y = 0; y < d; ++y) row += gram[x * d + y] * k[y];
        acc += k[x] * row;
      }
      w[t] = acc;
      total += acc;
    }
    for (int64_t t = 0; t < n; ++t) {
      const double wt = w[t] * static_cast<double>(n) / total;  // sum_t w_t = n
      const float* v = a.v.data() + (t * hkv + h) * d;
      for (int x = 0; x < d; ++x)
        for (int y = 0; y < d; ++y) c[x * d + y] += wt * v[x] * v[y] / static_cast<double>(n) / hkv;
    }
  }
  return c;
}

}  // namespace kvcd
