// Post-RoPE attention activations of one layer (the layout of activation dumps: q
// [n][Hq][d], k [n][Hkv][d], v [n][Hkv][d], float) and the OSCAR calibration statistics
// computed from them.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcd {

struct LayerActivations {
  std::vector<float> q, k, v;
};

// OSCAR calibration statistics (docs/formats.md "int2-oscar"), FP64, d x d row-major, 1 layer:
//   C_q = mean_h (Q_gh^T Q_gh / n_h)  (Q_gh: the g query heads of KV head h stacked)
//   C_v = mean_h (sum_t w_t v_t^T v_t / n),  w_t = k_t (Q_gh^T Q_gh / n_h) k_t^T,
//         normalized so that sum_t w_t = n.
std::vector<double> KeyCovariance(const LayerActivations& a, int64_t n, int num_q_heads,
                                  int num_kv_heads, int d);
std::vector<double> ValueCovariance(const LayerActivations& a, int64_t n, int num_q_heads,
                                    int num_kv_heads, int d);

}  // namespace kvcd
