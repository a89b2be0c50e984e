#include "synthetic_activations.h"

#include <cmath>
#include <random>

namespace kvcd {
namespace {

void ApplyRope(float* x, int d, int64_t pos, double theta) {
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const double freq = std::pow(theta, -2.0 * i / d);
    const double a = static_cast<double>(pos) * freq;
    const double c = std::cos(a), s = std::sin(a);
    const double x0 = x[i], x1 = x[i + half];
    x[i] = static_cast<float>(x0 * c - x1 * s);
    x[i + half] = static_cast<float>(x0 * s + x1 * c);
  }
}

}  // namespace

std::vector<LayerActivations> GenerateActivations(const ActivationSpec& s) {
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, s.head_dim / 2 - 1);
  const int d = s.head_dim, hq = s.num_q_heads, hkv = s.num_kv_heads, g = hq / hkv;
  const int64_t n = s.tokens;
  std::vector<LayerActivations> layers(static_cast<size_t>(s.num_layers));
  for (auto& L : layers) {
    L.q.resize(static_cast<size_t>(n * hq * d));
    L.k.resize(static_cast<size_t>(n * hkv * d));
    L.v.resize(static_cast<size_t>(n * hkv * d));
    for (int h = 0; h < hkv; ++h) {
      // Per-head channel structure.
      std::vector<float> k_scale(d, 1.0f), k_offset(d, 0.0f), v_scale(d, 1.0f);
      for (int c = 0; c < d; ++c) k_scale[c] = 0.5f + 0.5f * std::fabs(normal(rng));
      for (int o = 0; o < s.outlier_pairs; ++o) {
        const int c = pick(rng);
        for (int cc : {c, c + d / 2}) {
          k_scale[cc] = s.outlier_scale;
          k_offset[cc] = s.outlier_scale * (normal(rng) > 0 ? 1.5f : -1.5f);
        }
      }
      for (int o = 0; o < 2; ++o) v_scale[pick(rng) * 2] = 3.0f;
      std::vector<float> basis(static_cast<size_t>(g) * d * s.query_rank);  // A per query head
      for (auto& x : basis) x = normal(rng) / std::sqrt(static_cast<float>(s.query_rank));
      std::vector<float> mean_q(d, 0.0f);
      for (int j = 0; j < g; ++j)
        for (int c = 0; c < d; ++c)
          for (int r = 0; r < s.query_rank; ++r) mean_q[c] += basis[(j * d + c) * s.query_rank + r];
      for (int64_t t = 0; t < n; ++t) {
        float* k = L.k.data() + (t * hkv + h) * d;
        float* v = L.v.data() + (t * hkv + h) * d;
        const bool sink = t < s.sink_tokens;
        for (int c = 0; c < d; ++c) {
          k[c] = sink ? s.sink_strength * mean_q[c] + 0.1f * normal(rng)
                      : k_offset[c] + k_scale[c] * normal(rng);
          v[c] = (sink ? 0.2f : 1.0f) * v_scale[c] * normal(rng);
        }
        ApplyRope(k, d, t, s.rope_theta);
        float z[64];
        for (int j = 0; j < g; ++j) {
          for (int r = 0; r < s.query_rank; ++r) z[r] = normal(rng);
          float* q = L.q.data() + (t * hq + h * g + j) * d;
          for (int c = 0; c < d; ++c) {
            float acc = 0.1f * normal(rng);
            for (int r = 0; r < s.query_rank; ++r)
              acc += basis[(j * d + c) * s.query_rank + r] * z[r];
            q[c] = s.query_scale * acc;
          }
          ApplyRope(q, d, t, s.rope_theta);
        }
      }
    }
  }
  return layers;
}

}  // namespace kvcd
