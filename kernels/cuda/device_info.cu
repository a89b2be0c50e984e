#include <cuda_runtime.h>

#include <cstdio>

#include "kvcd/kernels/cuda_device.h"

namespace kvcd::kernels {

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky "no device" error
    return 0;
  }
  return n;
}

std::string CudaDeviceDescription(int ordinal) {
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, ordinal);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  char buf[96];
  std::snprintf(buf, sizeof(buf), " (sm_%d%d, %.0f GiB, %d SMs)", prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1ull << 30), prop.multiProcessorCount);
  return std::string(prop.name) + buf;
}

}  // namespace kvcd::kernels
