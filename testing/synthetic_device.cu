#include <cuda_fp16.h>

#include "testing/synthetic_device.h"

namespace kvcd::workers {
namespace {

__device__ uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ float Uniform(uint64_t seed, uint64_t i) {  // [0, 1)
  return static_cast<float>(Mix(seed * 0x100000001b3ull + i) >> 40) * (1.0f / 16777216.0f);
}
__device__ uint16_t ToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element i of FillBf16(seed) and of NextQueries(o, seed): the one definition of each value
// (ProduceStep makes the same ones).
__device__ uint16_t FillValue(uint64_t seed, int64_t i) {
  return ToBf16(2.0f * Uniform(seed, i) - 1.0f);
}
__device__ uint16_t NextQueryValue(const float* o, uint64_t seed, int64_t i) {
  return ToBf16(0.5f * o[i] + Uniform(seed, i) - 0.5f);
}

__global__ void FillBf16Kernel(uint16_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = FillValue(seed, i);
}

__global__ void FillInt2Kernel(uint8_t* p, int64_t chunks, int64_t bytes, int64_t params_offset,
                               int64_t params, int block, uint64_t seed) {
  const int64_t total = chunks * bytes;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = j % bytes;
    uint8_t out = 0;
    if (r < params_offset) {
      out = static_cast<uint8_t>(Mix(seed + j) & 0xff);
    } else if (r < params_offset + 2 * params) {
      const int64_t v = (r - params_offset) / 2;
      const float u = Uniform(seed ^ 0x5bd1e995ull, (j / bytes) * params + v);
      const __half h = __float2half((v / block) % 2 == 0 ? 0.01f + 0.04f * u : -0.1f * u);
      const uint16_t bits = __half_as_ushort(h);
      out = static_cast<uint8_t>((r - params_offset) % 2 == 0 ? bits & 0xff : bits >> 8);
    }
    p[j] = out;
  }
}

__global__ void NextQueriesKernel(const float* o, uint16_t* q, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q[i] = NextQueryValue(o, seed, i);
}

// NextQueries(key) into q, then FillBf16 with key ^ 1, key ^ 2 and key ^ 3 into k, v and x, as
// one grid over the four ranges: the same values as the four launches.
__global__ void ProduceStepKernel(const float* o, uint16_t* q, int64_t q_n, uint16_t* k,
                                  uint16_t* v, int64_t kv_n, uint16_t* x, int64_t x_n,
                                  uint64_t key) {
  const int64_t total = q_n + 2 * kv_n + x_n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < q_n) {
      q[i] = NextQueryValue(o, key, i);
    } else if (i < q_n + kv_n) {
      k[i - q_n] = FillValue(key ^ 1, i - q_n);
    } else if (i < q_n + 2 * kv_n) {
      v[i - q_n - kv_n] = FillValue(key ^ 2, i - q_n - kv_n);
    } else {
      x[i - q_n - 2 * kv_n] = FillValue(key ^ 3, i - q_n - 2 * kv_n);
    }
  }
}

unsigned Blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 4096 ? (b < 1 ? 1 : b) : 4096);
}

}  // namespace

cudaError_t FillBf16(uint16_t* p, int64_t n, uint64_t seed, cudaStream_t stream) {
  FillBf16Kernel<<<Blocks(n), 256, 0, stream>>>(p, n, seed);
  return cudaGetLastError();
}

cudaError_t FillInt2PageLayers(uint8_t* p, int64_t chunks, int64_t bytes, int64_t params_offset,
                               int64_t params, int block, uint64_t seed, cudaStream_t stream) {
  FillInt2Kernel<<<Blocks(chunks * bytes), 256, 0, stream>>>(p, chunks, bytes, params_offset,
                                                             params, block, seed);
  return cudaGetLastError();
}

cudaError_t NextQueries(const float* o, uint16_t* q, int64_t n, uint64_t seed,
                        cudaStream_t stream) {
  NextQueriesKernel<<<Blocks(n), 256, 0, stream>>>(o, q, n, seed);
  return cudaGetLastError();
}

cudaError_t ProduceStep(const float* o, uint16_t* q, int64_t q_n, uint16_t* k, uint16_t* v,
                        int64_t kv_n, uint16_t* x, int64_t x_n, uint64_t key, cudaStream_t stream) {
  if (q_n < 0 || kv_n < 0 || x_n < 0 || (q_n > 0 && (o == nullptr || q == nullptr)) ||
      (kv_n > 0 && (k == nullptr || v == nullptr)) || (x_n > 0 && x == nullptr)) {
    return cudaErrorInvalidValue;  // a range without its buffer
  }
  if (q_n + 2 * kv_n + x_n == 0) return cudaSuccess;
  ProduceStepKernel<<<Blocks(q_n + 2 * kv_n + x_n), 256, 0, stream>>>(o, q, q_n, k, v, kv_n, x, x_n,
                                                                      key);
  return cudaGetLastError();
}

}  // namespace kvcd::workers
