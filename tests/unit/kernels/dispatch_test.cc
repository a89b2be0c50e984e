#include "kvcd/kernels/dispatch.h"

#include <gtest/gtest.h>

namespace kvcd::kernels {
namespace dispatch_test {

TEST(DispatchTest, HeadDimReachesItsInstantiationAndNothingElse) {
  for (int d : {64, 128, 256}) {
    const int got = DispatchHeadDim(
        d, [](auto hd) { return decltype(hd)::value; }, [] { return -1; });
    EXPECT_EQ(got, d);
  }
  for (int d : {0, 32, 96, 100, 192, 512, -64}) {
    EXPECT_EQ(DispatchHeadDim(
                  d, [](auto hd) { return decltype(hd)::value; }, [] { return -1; }),
              -1)
        << d;
  }
}

TEST(DispatchTest, GroupSizeReachesItsInstantiationAndNothingElse) {
  for (int g : {1, 2, 4, 8}) {
    EXPECT_EQ(DispatchGroupSize(
                  g, [](auto gs) { return decltype(gs)::value; }, [] { return 0; }),
              g);
  }
  for (int g : {0, 3, 5, 6, 7, 16, -1}) {
    EXPECT_EQ(DispatchGroupSize(
                  g, [](auto gs) { return decltype(gs)::value; }, [] { return 0; }),
              0)
        << g;
  }
}

TEST(DispatchTest, ValueSetsOfTheirOwn) {
  auto transform_dims = [](int d) {
    return DispatchValue<32, 64, 96, 128>(
        d, [](auto v) { return decltype(v)::value; }, [] { return 0; });
  };
  for (int d : {32, 64, 96, 128}) EXPECT_EQ(transform_dims(d), d);
  for (int d : {16, 48, 256}) EXPECT_EQ(transform_dims(d), 0) << d;
}

}  // namespace dispatch_test
}  // namespace kvcd::kernels
