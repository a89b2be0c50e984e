// What the CUDA benchmarks share: CHECK (a failed CUDA call prints where and exits 1), the
// read-ceiling kernel (a read-only reduction, ReadReduce; ReadCeilingTbps), event timing
// (MedianUsPerCall) and the arguments of a Put-size paged row store (PutRows).
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

// The read ceiling in TB/s: ReadReduce over `bytes` of device memory on `stream`, median of
// 10 runs after 2 warm-up runs.
inline double ReadCeilingTbps(cudaStream_t stream, int sms, int64_t bytes) {
  void* buf = nullptr;
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&buf, bytes));
  CHECK(cudaMalloc(&out, 4));
  CHECK(cudaMemset(buf, 1, bytes));
  const double us = MedianUsPerCall(stream, 12, 2, 1, [&](int) {
    ReadReduce<<<sms * 8, 512, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16, out);
  });
  CHECK(cudaFree(buf));
  CHECK(cudaFree(out));
  return static_cast<double>(bytes) / us / 1e6;
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
