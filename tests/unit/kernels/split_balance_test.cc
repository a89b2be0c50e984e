// The split rule of ragged decode batches (kvcd/kernels/cuda_split_balance.h): host
// arithmetic, so it is checked here without a GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "kvcd/kernels/cuda_split_balance.h"

namespace kvcd::kernels::cuda {
namespace split_balance_test {

// An H200 (132 SMs) running a kernel of 4 resident CTAs per SM; Qwen3-8B's 8 KV heads.
constexpr int64_t kWave = 132 * 4;
constexpr int kHkv = 8;

TEST(BalancedSplitsTest, EqualLengthsKeepTheKernelsOwnCount) {
  for (int batch : {1, 2, 3, 7, 8, 10, 16, 64, 194}) {
    for (int64_t len : {1, 300, 32768, 99968}) {
      for (int uniform : {1, 4, 66}) {
        EXPECT_EQ(BalancedSplits(uniform, batch, kHkv, len, len * batch, kWave), uniform)
            << "batch " << batch << " length " << len << " uniform " << uniform;
      }
    }
  }
}

TEST(BalancedSplitsTest, OneSequenceOrNoTotalKeepsTheKernelsOwnCount) {
  EXPECT_EQ(BalancedSplits(66, 1, kHkv, 99968, 99968, kWave), 66);
  // total_tokens 0: what the daemon passes with KVCD_SPLITS=kernel (no total).
  EXPECT_EQ(BalancedSplits(1, 194, kHkv, 84559, 0, kWave), 1);
}

TEST(BalancedSplitsTest, TheJobBenchsTraceBatchGetsFourSplits) {
  // bench/results/2026-12-05-h200-s21.md, section 2: 194 INT2 sequences of the Mooncake
  // trace, 2,896,335 tokens, the longest 84,559; the kernel's own rule gives 1 split, the
  // bench's balanced rule gave 4 (39.6 -> 25.1 ms per step); so does this one.
  EXPECT_EQ(BalancedSplits(1, 194, kHkv, 84559, 2896335, kWave), 4);
}

TEST(BalancedSplitsTest, RaggedBatchSplitsTheLongestSequenceMore) {
  // One 100k sequence beside seven of 1k: the kernel's own count (one wave for equal
  // lengths) is 8; the longest sequence's 8 CTAs per head would each walk 12.5k tokens.
  const int64_t total = 99968 + 7 * 1024;
  const int s = BalancedSplits(8, 8, kHkv, 99968, total, kWave);
  EXPECT_GT(s, 8);
  // Each of its CTAs holds at most an even share of one wave's work (halved: skewed batch).
  EXPECT_LE(99968.0 / s, 1.05 * total * kHkv / static_cast<double>(kWave) / 2);
}

TEST(BalancedSplitsTest, BoundedByTheMinimumShareAndTheMaximumCount) {
  // Short lists: no split below kBalancedMinTokensPerSplit tokens.
  EXPECT_EQ(BalancedSplits(1, 2, 1, 1024, 1030, 1 << 20), 1024 / kBalancedMinTokensPerSplit);
  // Never more than kBalancedMaxSplits, never fewer than the kernel's own count.
  EXPECT_EQ(BalancedSplits(1, 2, 1, int64_t{1} << 30, (int64_t{1} << 30) + 1, 1 << 30),
            kBalancedMaxSplits);
  EXPECT_EQ(BalancedSplits(600, 2, 1, int64_t{1} << 30, (int64_t{1} << 30) + 1, 1 << 30), 600);
  EXPECT_EQ(BalancedSplits(40, 4, kHkv, 5000, 5003, kWave), 40);
}

TEST(BalancedSplitsTest, NeverFewerSplitsForALongerLongestList) {
  int prev = 0;
  for (int64_t longest = 1024; longest <= 131072; longest += 1024) {
    const int s = BalancedSplits(1, 16, kHkv, longest, longest + 15 * 1024, kWave);
    EXPECT_GE(s, prev) << "longest " << longest;
    prev = s;
  }
}

}  // namespace split_balance_test
}  // namespace kvcd::kernels::cuda
