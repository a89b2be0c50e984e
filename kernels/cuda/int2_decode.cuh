// What the two OSCAR INT2 decode kernels (int2_decode_v1.cu, int2_decode_v2.cu) share: the
// int8 digits, the code planes, where a KV head's rows of a page-layer live, and their
// launchers (int2_decode_attention.cu picks one).
//
// mma.sync.m16n8k32 fragments (g = lane / 4, t = lane % 4):
//   A (16 x 32, row): a0 = (row g, k 4t..4t+3), a1 = (row g+8, same k), a2 = (row g,
//                     k 4t+16..), a3 = (row g+8, k 4t+16..)
//   B (32 x 8, col):  b0 = (k 4t..4t+3, col g), b1 = (k 4t+16.., col g)
//   C (16 x 8):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols)
// Rows are (head, digit): head h < 8 with its high digit in row h and its low digit in
// row h + 8, so one lane holds both digits of one head for the same columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "decode_parts.cuh"
#include "kvcd/kernels/cuda_decode_attention.h"

namespace kvcd::kernels::cuda {

constexpr uint32_t kPlane = 0x03030303u;

__device__ __forceinline__ int Digit(float x) { return max(-127, min(127, __float2int_rn(x))); }

// Byte offsets of those rows from the start of a page-layer (q_bytes = head_dim / 4).
struct Int2HeadOffsets {
  uint32_t k, v, kp, vp;
};

__device__ __forceinline__ Int2HeadOffsets HeadOffsets(const DecodeGeometry& geo, uint32_t ps,
                                                       int kvh, int q_bytes) {
  const uint32_t hkv = geo.num_kv_heads;
  const uint32_t code_bytes = hkv * ps * q_bytes, head = kvh * ps * q_bytes;
  const uint32_t kp = 2 * code_bytes + kvh * 4 * ps;
  return {head, code_bytes + head, kp, kp + hkv * 4 * ps};
}

// The first kernel (every head_dim, per-tile FP32 accumulation) over the grid (splits,
// kv_heads, batch).
cudaError_t LaunchInt2V1(dim3 grid, const PartArgs& a, cudaStream_t stream);

// The int32-accumulating kernel (head_dim 64/128; GQA groups up to 4 or 8): QueryFragments,
// then the decode kernel (as its programmatic dependent if `dependent`). a.state must be set.
cudaError_t LaunchInt2V2(dim3 grid, const PartArgs& a, cudaStream_t stream, bool dependent);

}  // namespace kvcd::kernels::cuda
