// Scalar float64 oracle for decode attention over contiguous K/V.
#pragma once

#include <cstdint>

namespace kvcd::kernels {

// q: [num_q_heads][d]; k, v: [n][num_kv_heads][d] (float); GQA: query head h uses
// KV head h / (num_q_heads / num_kv_heads). Writes o [num_q_heads][d] and natural-log
// lse [num_q_heads] in double. n == 0 gives o = 0, lse = -inf.
void ReferenceAttention(const float* q, const float* k, const float* v, int64_t n, int num_q_heads,
                        int num_kv_heads, int head_dim, double softmax_scale, double* o,
                        double* lse);

}  // namespace kvcd::kernels
