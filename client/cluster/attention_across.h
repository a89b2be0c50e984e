// Attention across daemons (docs/cluster.md "Attention across daemons"): a long shared
// history stays on the member that holds it and a session's own turns on another; each
// computes attention where its keys live and the two (output, LSE) pairs are merged
// exactly with the kernels' own merge (kernels::MergeStates). No history moves.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace kvcd::cluster {

struct MergedAttention {
  std::vector<float> o;        // [B, num_q_heads, head_dim]
  std::vector<float> lse;      // [B, num_q_heads], natural log
  std::vector<int64_t> shape;  // o's shape
};

// Merges two answers of AttentionDecode over disjoint parts of the same sequences (same
// batch and heads). INVALID_ARGUMENT when they are not inline F32 of matching shapes, or
// an LSE is NaN / +inf.
absl::StatusOr<MergedAttention> MergeAttention(const v1::AttentionDecodeResponse& a,
                                               const v1::AttentionDecodeResponse& b);

// Calls AttentionDecode with `req_a` on `a` and `req_b` on `b` concurrently and merges the
// answers. The first error of either call is returned as it came.
absl::StatusOr<MergedAttention> AttendAcross(Client& a, const v1::AttentionDecodeRequest& req_a,
                                             Client& b, const v1::AttentionDecodeRequest& req_b);

}  // namespace kvcd::cluster
