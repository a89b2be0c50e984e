#include <cstdint>

#include "kvcd/kernels/cuda_device_copy.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ bool Bf16Bad(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }

__device__ bool Fp16ParamBad(uint16_t h, uint64_t index, uint32_t block) {
  if ((h & 0x7c00u) == 0x7c00u) return true;  // Inf or NaN
  const bool is_scale = block == 0 || (index / block) % 2 == 0;
  return is_scale && (h & 0x8000u) != 0 && (h & 0x7fffu) != 0;
}

__device__ unsigned CheckWord(uint16_t h, uint64_t index, uint32_t check, uint32_t block) {
  if (check == kCheckBf16Finite) return Bf16Bad(h) ? 1u : 0u;
  if (check == kCheckFp16ScaleMin) return Fp16ParamBad(h, index, block) ? 1u : 0u;
  return 0u;
}

// One block per (span, chunk of the span): grid.y walks spans, grid.x strides inside.
__global__ void CopySpansKernel(const CopySpan* spans, unsigned long long* bad) {
  const CopySpan s = spans[blockIdx.y];
  const bool vec =
      ((reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) | s.bytes) & 15u) ==
      0;
  unsigned local_bad = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const uint4* src = static_cast<const uint4*>(s.src);
    uint4* dst = static_cast<uint4*>(s.dst);
    for (uint64_t i = first; i < s.bytes / 16; i += stride) {
      const uint4 v = src[i];
      if (dst != nullptr) dst[i] = v;
      if (s.check != kCheckNone) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint16_t h = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
          local_bad += CheckWord(h, i * 8 + k, s.check, s.check_block);
        }
      }
    }
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(s.src);
    uint8_t* dst = static_cast<uint8_t*>(s.dst);
    for (uint64_t i = first; i < s.bytes; i += stride) {
      if (dst != nullptr) dst[i] = src[i];
      if (s.check != kCheckNone && i % 2 == 0 && i + 1 < s.bytes) {
        const uint16_t h = static_cast<uint16_t>(src[i] | (src[i + 1] << 8));
        local_bad += CheckWord(h, i / 2, s.check, s.check_block);
      }
    }
  }
  if (local_bad != 0 && bad != nullptr) atomicAdd(bad, static_cast<unsigned long long>(local_bad));
}

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

cudaError_t LaunchCopySpans(const CopySpan* spans, int n, unsigned long long* bad,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  // 8 blocks per span keep every SM busy for a few hundred spans of tens of KB; a span
  // larger than 8 * 256 * 16 bytes is walked in strides. (Fewer blocks for thousands of
  // small spans were measured: no faster, the host's per-page work bounds pushes.)
  for (int first = 0; first < n; first += 65535) {
    const int count = n - first < 65535 ? n - first : 65535;
    CopySpansKernel<<<dim3(8, count), kThreads, 0, stream>>>(spans + first, bad);
  }
  return cudaGetLastError();
}

cudaError_t LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  ToFloatKernel<<<static_cast<unsigned>(blocks < 1024 ? blocks : 1024), kThreads, 0, stream>>>(
      src, bf16, n, dst);
  return cudaGetLastError();
}

}  // namespace kvcd::kernels::cuda
