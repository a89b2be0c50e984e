// What the CUDA benchmarks share: CHECK (a failed CUDA call prints where and exits 1), the
// read-ceiling kernel (a read-only reduction, ReadReduce; ReadCeilingTbps), event timing
// (MedianUsPerCall), uploads (Upload), page filling (FillPages) and the arguments of a
// Put-size paged row store (PutRows).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/error.h"

// The cudaError_t of a CUDA runtime call, or of a kernels launcher's Error.
inline cudaError_t CheckedCode(cudaError_t e) { return e; }
inline cudaError_t CheckedCode(const kvcd::kernels::Error& e) {
  if (e.ok()) return cudaSuccess;
  return e.device_code() != 0 ? static_cast<cudaError_t>(e.device_code()) : cudaErrorUnknown;
}

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = CheckedCode(x);                                                          \
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

// A device copy of v (never a zero-byte allocation).
template <class T>
T* Upload(const std::vector<T>& v) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))));
  CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
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

// Pages of random codes with valid FP16 parameters from byte params_at of each page to its
// end, in blocks of ps values alternating scales 0.5..0.6 (0x3800..) and minimums -0.75..
// (0xBA00..), as INT2 pages (int2_attention.h: params_at = the K and V codes' bytes) and
// int2-transform pages (transform_attention.h: params_at = VParams(0)) hold them; and FP16
// gains 0.5..0.6 in [gains_at, gains_at + gains_bytes) (int2-transform key gains).
__global__ void FillPages(uint8_t* pages, int64_t n_pages, int64_t page_bytes, int ps,
                          int64_t params_at, uint32_t seed, int64_t gains_at = 0,
                          int64_t gains_bytes = 0) {
  const int64_t total = n_pages * page_bytes;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t off = i % page_bytes;
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    const bool gain = off >= gains_at && off < gains_at + gains_bytes;
    if (off < params_at && !gain) {
      pages[i] = static_cast<uint8_t>(x >> 7);
    } else {
      const bool lo = !gain && ((off - params_at) / 2 / ps) % 2 == 1;
      const uint16_t h = lo ? static_cast<uint16_t>(0xBA00 + (x & 0x3f))
                            : static_cast<uint16_t>(0x3800 + (x & 0x3f));
      pages[i] = (off % 2 == 0) ? static_cast<uint8_t>(h & 0xff) : static_cast<uint8_t>(h >> 8);
    }
  }
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
