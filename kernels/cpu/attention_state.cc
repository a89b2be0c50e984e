#include "kvcd/kernels/attention_state.h"

#include <algorithm>
#include <cmath>

namespace kvcd::kernels {

void ResetStates(int num_heads, int head_dim, float* o, float* lse) {
  std::fill(o, o + static_cast<int64_t>(num_heads) * head_dim, 0.0f);
  std::fill(lse, lse + num_heads, kEmptyLse);
}

void MergeStates(int num_heads, int head_dim, float* o_a, float* lse_a, const float* o_b,
                 const float* lse_b) {
  for (int h = 0; h < num_heads; ++h) {
    const float sa = lse_a[h];
    const float sb = lse_b[h];
    if (sb == kEmptyLse) continue;  // b empty: a unchanged
    float* oa = o_a + static_cast<int64_t>(h) * head_dim;
    const float* ob = o_b + static_cast<int64_t>(h) * head_dim;
    if (sa == kEmptyLse) {
      std::copy(ob, ob + head_dim, oa);
      lse_a[h] = sb;
      continue;
    }
    const float m = std::max(sa, sb);
    const float wa = std::exp(sa - m);
    const float wb = std::exp(sb - m);
    const float inv = 1.0f / (wa + wb);
    for (int i = 0; i < head_dim; ++i) oa[i] = (wa * oa[i] + wb * ob[i]) * inv;
    lse_a[h] = m + std::log(wa + wb);
  }
}

void MergeStatesN(int n, int num_heads, int head_dim, const float* o_parts, const float* lse_parts,
                  float* o_out, float* lse_out) {
  ResetStates(num_heads, head_dim, o_out, lse_out);
  const int64_t o_stride = static_cast<int64_t>(num_heads) * head_dim;
  for (int i = 0; i < n; ++i) {
    MergeStates(num_heads, head_dim, o_out, lse_out, o_parts + i * o_stride,
                lse_parts + static_cast<int64_t>(i) * num_heads);
  }
}

}  // namespace kvcd::kernels
