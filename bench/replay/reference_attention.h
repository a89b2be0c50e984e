// The replay's check of what a daemon answers: attention of one query over a sequence's K/V
// rows, computed in float64 (scalar, no kernel code) from the rows the replay itself made.
// A page that came back with another page's rows (a wrong match, a bad pull, a stale index
// entry believed) moves the output far beyond float rounding.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcd::replay {

struct ReferenceAttention {
  std::vector<double> o;    // [num_q_heads, head_dim]
  std::vector<double> lse;  // [num_q_heads], natural log
};

// q: [num_q_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim] (query head h reads KV
// head h / (num_q_heads / num_kv_heads)); scale multiplies q.k.
ReferenceAttention AttendReference(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, int64_t tokens, int num_q_heads,
                                   int num_kv_heads, int head_dim, double scale);

}  // namespace kvcd::replay
