// How many splits a decode launch cuts each sequence's page list into when the batch's
// lengths differ (issue #36). Host-only arithmetic: no CUDA header, tested on the CPU.
//
// Every decode kernel gives all sequences of a launch the same split count, and its own
// rule (Int2DecodeSplits, Bf16DecodeSplits, TransformTcDecodeSplits, ...) sizes that count
// for a batch of equal lengths: one wave of resident CTAs. With ragged lengths (a serving
// batch: prompts from a few hundred to 100k+ tokens) that count is small, and the CTAs of the
// longest sequence each walk a long share alone after the others are done. This rule sizes
// the splits by the longest sequence instead: each CTA holds at most an even share of one
// wave's work, halved when the longest sequence is 2x the mean or more (the CTAs of short
// sequences past their length exit at once). For a batch whose longest list is 2x the mean
// or more this is the rule cuda_job_bench's "balanced" rows measured: INT2 history at 60 GB
// 39.6 -> 25.1 ms per step (bench/results/2026-12-05-h200-s21.md, section 2).
// The daemon applies it unless KVCD_SPLITS=kernel (run through the daemon on an H100:
// bench/results/2026-12-05-h200-gpu-step.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvcd::kernels::cuda {

// The fewest tokens one split of a balanced launch holds, and the most splits it makes.
inline constexpr int64_t kBalancedMinTokensPerSplit = 256;
inline constexpr int kBalancedMaxSplits = 512;

// `uniform`: the kernel's own split count for this batch (>= 1). `max_tokens` and
// `total_tokens`: the longest list's and the batch's tokens. `wave_ctas`: CTAs of the kernel
// resident at once on the GPU (SMs x CTAs per SM). Returns `uniform` when every list has the
// same length, the batch is one sequence or total_tokens is 0, else at least `uniform`, at
// most max(uniform, kBalancedMaxSplits).
inline int BalancedSplits(int uniform, int batch, int num_kv_heads, int64_t max_tokens,
                          int64_t total_tokens, int64_t wave_ctas) {
  if (batch <= 1 || num_kv_heads <= 0 || max_tokens <= 0 || wave_ctas <= 0 || total_tokens <= 0 ||
      max_tokens * batch <= total_tokens) {
    return uniform;
  }
  const double mean = static_cast<double>(total_tokens) / batch;
  const double skew = std::min(2.0, static_cast<double>(max_tokens) / mean);
  const double share =
      static_cast<double>(total_tokens) * num_kv_heads / static_cast<double>(wave_ctas) / skew;
  const double per_split = std::max(static_cast<double>(kBalancedMinTokensPerSplit), share);
  const auto splits = static_cast<int64_t>(std::ceil(static_cast<double>(max_tokens) / per_split));
  return static_cast<int>(
      std::max<int64_t>(uniform, std::min<int64_t>(splits, kBalancedMaxSplits)));
}

}  // namespace kvcd::kernels::cuda
