#include <cstdint>

#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_device_copy.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ToFloatKernel(const void* src, bool bf16, int64_t n, float* dst) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bf16) {
      const uint32_t h = static_cast<const uint16_t*>(src)[i];
      dst[i] = __uint_as_float(h << 16);
    } else {
      dst[i] = static_cast<const float*>(src)[i];
    }
  }
}

}  // namespace

cudaError_t LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  CountLaunch();
  ToFloatKernel<<<static_cast<unsigned>(blocks < 1024 ? blocks : 1024), kThreads, 0, stream>>>(
      src, bf16, n, dst);
  return cudaGetLastError();
}

}  // namespace kvcd::kernels::cuda
