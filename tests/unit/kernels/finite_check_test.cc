// FirstNonFinite, AllFinite and CopyBf16AllFinite against the scalar reference (std::isfinite per
// value) on random inputs with planted NaN/Inf, odd sizes and unaligned starts, BF16 and F32.
#include "kvcd/kernels/finite_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvcd/kernels/bf16.h"

namespace kvcd::kernels {
namespace finite_check_test {

TEST(FiniteCheckTest, MatchesTheReferenceOnRandomInputs) {
  std::mt19937_64 rng(21);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  const float specials[] = {
      std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::signaling_NaN()};
  int found = 0;
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    const int elem = bf16 ? 2 : 4;
    for (int64_t n : {0, 1, 7, 255, 256, 257, 1000, 4099}) {
      for (int offset : {0, 1, 3}) {  // unaligned starts
        for (int trial = 0; trial < 6; ++trial) {
          std::vector<uint8_t> buf(static_cast<size_t>(n * elem + offset + 8));
          auto put = [&](int64_t i, float x) {
            if (bf16) {
              const uint16_t h = FloatToBf16(x);
              std::memcpy(buf.data() + offset + 2 * i, &h, 2);
            } else {
              std::memcpy(buf.data() + offset + 4 * i, &x, 4);
            }
          };
          for (int64_t i = 0; i < n; ++i) put(i, normal(rng));
          // trial 0: all finite (plus a huge finite value; FLT_MAX itself would round to a
          // BF16 infinity); else plant 1..3 specials.
          if (n > 0) put(n - 1, bf16 ? 3.0e38f : std::numeric_limits<float>::max());
          if (trial > 0 && n > 0) {
            for (int k = 0; k < trial % 3 + 1; ++k) {
              const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
              put(at, specials[rng() % 4]);
            }
          }
          const void* data = buf.data() + offset;
          const int64_t want = FirstNonFiniteReference(data, n, bf16 != 0);
          EXPECT_EQ(FirstNonFinite(data, n, bf16 != 0), want)
              << "bf16 " << bf16 << " n " << n << " offset " << offset << " trial " << trial;
          EXPECT_EQ(AllFinite(data, n, bf16 != 0), want < 0) << "bf16 " << bf16 << " n " << n;
          if (bf16 != 0 && offset == 0) {  // the fused copy: same answer, exact copy
            std::vector<uint16_t> src(static_cast<size_t>(n)), dst(src.size(), 0x1234);
            if (n > 0) std::memcpy(src.data(), data, src.size() * 2);
            EXPECT_EQ(CopyBf16AllFinite(src.data(), dst.data(), n), want < 0) << "n " << n;
            EXPECT_EQ(src, dst) << "n " << n;
          }
          if (trial == 0) {
            EXPECT_EQ(want, -1);
          }
          found += want >= 0 ? 1 : 0;
        }
      }
    }
  }
  EXPECT_GT(found, 50);  // the planted values were seen
}

}  // namespace finite_check_test
}  // namespace kvcd::kernels
