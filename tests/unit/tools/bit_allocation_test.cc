#include "tools/bit_allocation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace kvcd {
namespace bit_allocation_test {

constexpr double kPi = 3.14159265358979323846;

TEST(BitAllocation, OneBitQuantizerOfAGaussianIsTheConditionalMean) {
  // Levels +-E|x| = +-sqrt(2/pi): step 2 sqrt(2/pi), MSE 1 - 2/pi.
  EXPECT_NEAR(GaussianUniformStep(1), 2 * std::sqrt(2 / kPi), 1e-6);
  EXPECT_NEAR(GaussianUniformMseTable()[1], 1 - 2 / kPi, 1e-9);
  EXPECT_DOUBLE_EQ(GaussianUniformMseTable()[0], 1.0);
}

TEST(BitAllocation, UniformQuantizerStepsMatchMaxsTable) {
  // Optimal uniform quantizers of a unit Gaussian (Max 1960): step and MSE at 2, 3, 4 bits.
  EXPECT_NEAR(GaussianUniformStep(2), 0.9957, 2e-4);
  EXPECT_NEAR(GaussianUniformMseTable()[2], 0.1188, 2e-4);
  EXPECT_NEAR(GaussianUniformStep(3), 0.5860, 2e-4);
  EXPECT_NEAR(GaussianUniformMseTable()[3], 0.03744, 1e-4);
  EXPECT_NEAR(GaussianUniformStep(4), 0.3352, 2e-4);
  EXPECT_NEAR(GaussianUniformMseTable()[4], 0.01154, 5e-5);
  for (int b = 1; b <= kMaxDirectionBits; ++b)
    EXPECT_LT(GaussianUniformMseTable()[b], GaussianUniformMseTable()[b - 1]);
}

TEST(BitAllocation, MseMatchesMonteCarlo) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> g;
  const double step = 0.8;
  double se = 0;
  const int n = 400000;
  for (int i = 0; i < n; ++i) {
    const double x = g(rng);
    const double k = std::clamp(std::floor(x / step + 2.0), 0.0, 3.0);
    const double r = (k - 1.5) * step;
    se += (x - r) * (x - r);
  }
  EXPECT_NEAR(se / n, GaussianUniformMse(2, step), 2e-3);
}

double Objective(const std::vector<double>& w, const std::vector<int>& b) {
  double s = 0;
  for (size_t i = 0; i < w.size(); ++i) s += w[i] * GaussianUniformMseTable()[b[i]];
  return s;
}

TEST(BitAllocation, GreedyMatchesExhaustiveSearch) {
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> lw(0.0, 2.0);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> w(5);
    for (double& x : w) x = lw(rng);
    const int budget = 3 + trial % 12, max_bits = 4;
    const auto bits = AllocateBits(w, budget, max_bits, GaussianUniformMseTable());
    int sum = 0;
    for (int b : bits) {
      sum += b;
      EXPECT_LE(b, max_bits);
    }
    EXPECT_EQ(sum, budget);
    double best = 1e300;
    std::vector<int> c(5);
    for (int code = 0; code < 5 * 5 * 5 * 5 * 5; ++code) {
      int s = 0;
      for (int i = 0, x = code; i < 5; ++i, x /= 5) s += (c[i] = x % 5);
      if (s == budget) best = std::min(best, Objective(w, c));
    }
    EXPECT_NEAR(Objective(w, bits), best, 1e-12 * best);
  }
}

TEST(BitAllocation, LargerVarianceNeverGetsFewerBits) {
  const std::vector<double> w = {100, 30, 10, 3, 1, 0.3, 0.1, 0.01};
  const auto bits = AllocateBits(w, 12, 8, GaussianUniformMseTable());
  for (size_t i = 1; i < w.size(); ++i) EXPECT_GE(bits[i - 1], bits[i]);
  EXPECT_EQ(bits.back(), 0);
}

TEST(BitAllocation, ReverseWaterFillingKnownAnswers) {
  // Equal variances: D = d s 2^(-2R/d).
  const std::vector<double> eq(8, 3.0);
  EXPECT_NEAR(ReverseWaterFilling(eq, 16), 8 * 3.0 * std::pow(2.0, -4.0), 1e-9);
  // One component below the water level is not coded: theta = 16 * 2^-4 = 1.
  double theta = 0;
  EXPECT_NEAR(ReverseWaterFilling({16.0, 0.25}, 2, &theta), 1.25, 1e-9);
  EXPECT_NEAR(theta, 1.0, 1e-9);
}

}  // namespace bit_allocation_test
}  // namespace kvcd
