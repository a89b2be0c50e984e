// PhaseTimes: bucket bounds (exact below 16, within 1/16 above), nearest-rank quantiles
// against a sorted reference on random samples, the report's lines, and a disabled lap
// recording nothing.
#include "common/phase_times.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace kvcd {
namespace phase_times_test {

TEST(PhaseTimesTest, BucketsAreExactBelowSixteenAndWithinASixteenthAbove) {
  for (uint64_t v = 0; v < 16; ++v) {
    EXPECT_EQ(PhaseTimes::BucketValue(PhaseTimes::Bucket(v)), static_cast<double>(v));
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const uint64_t v = rng() >> (rng() % 64);
    const int b = PhaseTimes::Bucket(v);
    ASSERT_GE(b, 0);
    ASSERT_LT(b, PhaseTimes::kBuckets);
    const double mid = PhaseTimes::BucketValue(b);
    EXPECT_LE(std::fabs(mid - static_cast<double>(v)), static_cast<double>(v) / 16.0 + 0.5) << v;
    if (v > 0) {
      EXPECT_GE(b, PhaseTimes::Bucket(v - 1));  // monotone
    }
  }
}

TEST(PhaseTimesTest, QuantilesMatchTheSortedSamples) {
  const int id = PhaseTimes::Phase("test.quantiles");
  const int counter = PhaseTimes::Phase("#test.counter");
  ASSERT_GE(id, 0);
  EXPECT_EQ(PhaseTimes::Phase("test.quantiles"), id);  // same name, same phase
  PhaseTimes::Reset();
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> dist(10.0, 1.0);  // ~22 us median, in ns
  std::vector<int64_t> xs(20001);
  for (auto& x : xs) {
    x = static_cast<int64_t>(dist(rng));
    PhaseTimes::Add(id, x);
  }
  for (int64_t n : {3, 3, 4, 3, 9}) PhaseTimes::Add(counter, n);
  std::sort(xs.begin(), xs.end());
  EXPECT_EQ(PhaseTimes::Count(id), xs.size());
  for (double q : {0.1, 0.5, 0.9, 0.99}) {
    const double want = static_cast<double>(xs[static_cast<size_t>(std::ceil(q * xs.size())) - 1]);
    EXPECT_NEAR(PhaseTimes::Quantile(id, q), want, want / 16.0 + 1) << q;
  }
  EXPECT_EQ(PhaseTimes::Quantile(counter, 0.5), 3.0);
  EXPECT_EQ(PhaseTimes::Quantile(counter, 0.9), 9.0);
  const std::string report = PhaseTimes::Report("unit test");
  EXPECT_NE(report.find("phase times: unit test"), std::string::npos) << report;
  EXPECT_NE(report.find("test.quantiles"), std::string::npos) << report;
  // The counter's line: 5 samples, mean 4.40, p50 3.00, p90 9.00 (plain numbers).
  EXPECT_NE(report.find("#test.counter"), std::string::npos) << report;
  EXPECT_NE(report.find("4.40"), std::string::npos) << report;
  PhaseTimes::Reset();
  EXPECT_EQ(PhaseTimes::Count(id), 0u);
  EXPECT_EQ(PhaseTimes::Report("empty").find("test.quantiles"), std::string::npos);
}

TEST(PhaseTimesTest, LapsRecordOnlyWhenEnabled) {
  const int id = PhaseTimes::Phase("test.laps");
  const bool was = PhaseTimes::Enabled();
  PhaseTimes::Reset();
  PhaseTimes::SetEnabled(false);
  {
    PhaseLap lap;
    EXPECT_FALSE(lap.on());
    lap.Mark(id);
  }
  EXPECT_EQ(PhaseTimes::Count(id), 0u);
  PhaseTimes::SetEnabled(true);
  {
    PhaseLap lap;
    lap.Mark(id);
    lap.Mark(id);
  }
  EXPECT_EQ(PhaseTimes::Count(id), 2u);
  PhaseTimes::SetEnabled(was);
  PhaseTimes::Reset();
}

}  // namespace phase_times_test
}  // namespace kvcd
