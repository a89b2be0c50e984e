// What the CUDA benchmarks share: CHECK (a failed CUDA call prints where and exits 1), the
// read-ceiling kernel (a read-only reduction, ReadReduce), event timing (MedianUsPerCall),
// INT2 page filling (FillInt2Pages) and the arguments of a Put-size paged row store (PutRows).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvcd/kernels/cuda_store_rows.h"

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

// Reads n 16-byte words once; *out changes only on an impossible checksum.
__global__ void ReadReduce(const uint4* p, int64_t n, unsigned* out) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(out, acc);
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per call of `launch(c)`: `repeats` rounds of `calls` calls back to back
// on `stream` between two events, the first `skip` rounds left out (warm-up).
template <class F>
double MedianUsPerCall(cudaStream_t stream, int repeats, int skip, int calls, F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(a, stream));
    for (int c = 0; c < calls; ++c) launch(c);
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (r >= skip) ms.push_back(t / calls);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return Median(ms) * 1e3;
}

// INT2 pages (int2_attention.h) of random codes with valid FP16 parameters: scales
// 0.5..0.6, minimums -0.75.. (code_bytes: K codes of a page, V codes as many).
__global__ void FillInt2Pages(uint8_t* pages, int64_t n_pages, int64_t page_bytes,
                              int64_t code_bytes, int hkv, int ps, uint32_t seed) {
  const int64_t total = n_pages * page_bytes;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t off = i % page_bytes;
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    if (off < 2 * code_bytes) {
      pages[i] = static_cast<uint8_t>(x >> 7);
    } else {  // FP16 params: scales 0.5..0.6 (0x3800..), minimums -0.75.. (0xBA00..)
      const int64_t k = (off - 2 * code_bytes) / 2;  // param index in the page
      const bool lo = (k / ps) % 2 == 1;
      const uint16_t h = lo ? static_cast<uint16_t>(0xBA00 + (x & 0x3f))
                            : static_cast<uint16_t>(0x3800 + (x & 0x3f));
      pages[i] = (off % 2 == 0) ? static_cast<uint8_t>(h & 0xff) : static_cast<uint8_t>(h >> 8);
    }
  }
}

// A request of `tokens` tokens, [layers][tokens][heads][d] BF16 K at `src` and V right after
// it, stored at slots[t] (device) of a pool of `page_bytes` pages per layer and page,
// `pages` pages per layer, at `pool`.
struct PutRows {
  kvcd::kernels::cuda::RowBlock k, v;
  kvcd::kernels::cuda::PagedRows dst;
  PutRows(const uint16_t* src, int layers, int64_t tokens, int heads, int d, int page_size,
          const int64_t* slots, uint8_t* pool, int64_t pages, int64_t page_bytes) {
    const int64_t elems = int64_t{layers} * tokens * heads * d;
    k.data = src;
    v.data = src + elems;
    k.layer_stride = v.layer_stride = tokens * heads * d;
    k.token_stride = v.token_stride = int64_t{heads} * d;
    k.head_stride = v.head_stride = d;
    dst.num_layers = layers;
    dst.num_tokens = tokens;
    dst.num_kv_heads = heads;
    dst.head_dim = d;
    dst.page_size = page_size;
    dst.base = pool;
    dst.layer_stride = pages * page_bytes;
    dst.page_bytes = page_bytes;
    dst.slots = slots;
  }
};

}  // namespace
