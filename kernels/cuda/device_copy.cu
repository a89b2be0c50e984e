#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "query_input.cuh"

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

// ToFloatKernel with the fused non-finite check: a NaN or ±Inf becomes 0 in dst and marks
// its sequence's fault words (one exponent test per value; the report runs only on a bad one).
__global__ void QueriesToFloatKernel(const void* src, bool bf16, int64_t n, int64_t row_elems,
                                     float* dst, const DeviceFault* faults,
                                     unsigned long long layer_bits) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = ReadQuery(src, bf16, i, faults, row_elems, layer_bits);
  }
}

unsigned Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
}

}  // namespace

Error LaunchQueriesToFloat(const void* src, bool bf16, int64_t batch, int64_t row_elems, float* dst,
                           const DeviceFault* faults, cudaStream_t stream, int64_t fault_layer) {
  KVCD_CUDA_BIND_THREAD();
  if (batch <= 0 || row_elems <= 0)
    return ToError(batch < 0 || row_elems < 0 ? cudaErrorInvalidValue : cudaSuccess);
  const int64_t n = batch * row_elems;
  CountLaunch();
  QueriesToFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(src, bf16, n, row_elems, dst, faults,
                                                           FaultTag(0, fault_layer));
  return ToError(cudaGetLastError());
}

Error LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  if (n <= 0) return Error();
  CountLaunch();
  ToFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(src, bf16, n, dst);
  return ToError(cudaGetLastError());
}

}  // namespace kvcd::kernels::cuda
