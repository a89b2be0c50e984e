// The fixture the CUDA kernel tests share: skips without a device, uploads host vectors into
// device buffers it frees after the test (Up), reads device memory back (Down), and a
// randomly seeded generator.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kvcd/kernels/cuda_device.h"

namespace kvcd::kernels {

class CudaTestFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  template <class T>
  T* Up(const std::vector<T>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> Down(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void TearDown() override {
    for (void* p : owned_) cudaFree(p);
  }
  std::vector<void*> owned_;
  std::mt19937 rng_{std::random_device{}()};
};

}  // namespace kvcd::kernels
