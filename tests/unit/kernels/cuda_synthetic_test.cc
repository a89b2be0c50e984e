// The decode worker's fused per-layer producer (testing/synthetic_device.h ProduceStep)
// against the four launches it replaces: the same bytes on random sizes and keys.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda_test_fixture.h"
#include "testing/synthetic_device.h"

namespace kvcd::kernels {
namespace {

using CudaSyntheticTest = CudaTestFixture;

TEST_F(CudaSyntheticTest, ProduceStepEqualsTheSeparateKernels) {
  std::uniform_int_distribution<int64_t> size(1, 70000);
  std::uniform_real_distribution<float> val(-4.0f, 4.0f);
  for (int trial = 0; trial < 6; ++trial) {
    const int64_t q_n = size(rng_), kv_n = size(rng_) / 4 + 1;
    const int64_t x_n = trial % 2 == 0 ? 0 : size(rng_);  // no x (BF16, INT2) or an FSQ x
    const uint64_t key = (static_cast<uint64_t>(rng_()) << 32) | rng_();
    std::vector<float> o(static_cast<size_t>(q_n));
    for (float& v : o) v = val(rng_);
    const float* d_o = Up(o);
    const std::vector<uint16_t> zeros_q(q_n, 0), zeros_kv(kv_n, 0), zeros_x(x_n, 0);
    uint16_t* q[2] = {Up(zeros_q), Up(zeros_q)};
    uint16_t* k[2] = {Up(zeros_kv), Up(zeros_kv)};
    uint16_t* v[2] = {Up(zeros_kv), Up(zeros_kv)};
    uint16_t* x[2] = {Up(zeros_x), Up(zeros_x)};
    ASSERT_EQ(workers::NextQueries(d_o, q[0], q_n, key, nullptr), cudaSuccess);
    ASSERT_EQ(workers::FillBf16(k[0], kv_n, key ^ 1, nullptr), cudaSuccess);
    ASSERT_EQ(workers::FillBf16(v[0], kv_n, key ^ 2, nullptr), cudaSuccess);
    if (x_n > 0) {
      ASSERT_EQ(workers::FillBf16(x[0], x_n, key ^ 3, nullptr), cudaSuccess);
    }
    ASSERT_EQ(workers::ProduceStep(d_o, q[1], q_n, k[1], v[1], kv_n, x[1], x_n, key, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(Down(q[0], q_n), Down(q[1], q_n)) << "q, trial " << trial;
    EXPECT_EQ(Down(k[0], kv_n), Down(k[1], kv_n)) << "k, trial " << trial;
    EXPECT_EQ(Down(v[0], kv_n), Down(v[1], kv_n)) << "v, trial " << trial;
    EXPECT_EQ(Down(x[0], x_n), Down(x[1], x_n)) << "x, trial " << trial;
    // Not all zero: the kernels wrote what they were given.
    const std::vector<uint16_t> got = Down(k[1], kv_n);
    EXPECT_NE(got, zeros_kv) << "trial " << trial;
  }
}

TEST_F(CudaSyntheticTest, ProduceStepRefusesARangeWithoutItsBuffer) {
  EXPECT_EQ(workers::ProduceStep(nullptr, nullptr, 0, nullptr, nullptr, 0, nullptr, 16, 1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(workers::ProduceStep(nullptr, nullptr, -1, nullptr, nullptr, 0, nullptr, 0, 1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(workers::ProduceStep(nullptr, nullptr, 8, nullptr, nullptr, 0, nullptr, 0, 1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(workers::ProduceStep(nullptr, nullptr, 0, nullptr, nullptr, 8, nullptr, 0, 1, nullptr),
            cudaErrorInvalidValue);
  // Nothing to make: no launch, no error.
  EXPECT_EQ(workers::ProduceStep(nullptr, nullptr, 0, nullptr, nullptr, 0, nullptr, 0, 1, nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace kvcd::kernels
