// Partial attention states and their exact merge (docs/formats.md "Attention on the codes").
//
// A state of one query head over a set of keys is (o[d], lse): o = softmax-weighted
// mean of the values, lse = natural-log sum of exp(scaled logits). The empty state
// has lse = -inf and o = 0; merging it with anything is the identity, and merging
// empty states yields the empty state (zeros, never NaN).
#pragma once

#include <cstdint>
#include <limits>

namespace kvcd::kernels {

inline constexpr float kEmptyLse = -std::numeric_limits<float>::infinity();

// Sets num_heads states to empty.
void ResetStates(int num_heads, int head_dim, float* o, float* lse);

// Merges state (o_b, lse_b) into (o_a, lse_a) for num_heads heads:
// M = max(s_a, s_b), w = exp(s - M), o = (w_a o_a + w_b o_b)/(w_a + w_b),
// s = M + log(w_a + w_b).
void MergeStates(int num_heads, int head_dim, float* o_a, float* lse_a, const float* o_b,
                 const float* lse_b);

// Merges n states laid out [n][num_heads][head_dim] / [n][num_heads] into out.
void MergeStatesN(int n, int num_heads, int head_dim, const float* o_parts, const float* lse_parts,
                  float* o_out, float* lse_out);

}  // namespace kvcd::kernels
