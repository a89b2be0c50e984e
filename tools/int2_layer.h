// One layer of an OSCAR INT2 codec as the tools simulate it: rotations and clip quantiles
// shared by the layer's KV heads (groups = 1, codec file version 1) or one per KV head
// (groups = num_kv_heads, version 2); the INT2 round trip of a layer's K/V rows through the
// daemon's kernels; and the attention-output error of queries over K/V stored the way kvcd
// stores them (BF16 sink and recent windows, INT2 history between).
#pragma once

#include <cstdint>
#include <vector>

#include "common/activation_dump.h"

namespace kvcd {

struct Int2Layer {
  int groups = 1;                   // 1: shared by all KV heads; num_kv_heads: one per head
  std::vector<float> r_k, r_v;      // [groups][d][d]
  std::vector<float> rho_k, rho_v;  // [groups]
  // KV head h uses group Group(h).
  int Group(int kv_head) const { return groups == 1 ? 0 : kv_head; }
};

// The INT2 round trip (DemoteRowsToInt2, ExpandInt2Rows) of the rows of tokens [0, n) of
// KV head `kv_head` (-1: every head) of K (which = 0) or V (which = 1), written into
// `out` ([n][hkv][d], other heads untouched).
void Int2RoundTrip(const std::vector<float>& rows, int64_t n, int hkv, int d, const Int2Layer& c,
                   int which, int kv_head, std::vector<float>* out);

// The stored copy of K/V at query position t as kvcd keeps it: rows [sink, t + 1 - recent)
// from the codec's round trip (k_hat, v_hat), every other row rounded to BF16.
struct StoredWindows {
  int64_t sink = 64, recent = 256;
};

// Mean relative error ||o_hat - o|| / ||o|| over the query heads of KV head `kv_head`
// (-1: all) and the query positions `queries`, against exact attention over a.k / a.v.
// k_bf16 / v_bf16 are a.k / a.v rounded to BF16. Queries with no INT2 history count too
// (their error is the BF16 rounding error).
double StoredAttentionError(const LayerActivations& a, int hq, int hkv, int d,
                            const std::vector<float>& k_bf16, const std::vector<float>& v_bf16,
                            const std::vector<float>& k_hat, const std::vector<float>& v_hat,
                            const StoredWindows& windows, const std::vector<int64_t>& queries,
                            int kv_head, const std::vector<double>* exact = nullptr);

// The exact attention outputs [queries][hq][d] (FP64 over a.k / a.v) that
// StoredAttentionError compares against; pass them as `exact` to score many codecs.
std::vector<double> ExactOutputs(const LayerActivations& a, int hq, int hkv, int d,
                                 const std::vector<int64_t>& queries);

}  // namespace kvcd
