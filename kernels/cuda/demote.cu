// Quantize-on-demote on the GPU, one warp per row (see cuda_demote.h and int2_codec.h).
// Lane l holds elements l + 32k. Every step uses the CPU code's FP32 operations in the same
// order without contraction (rotation: x[i] * R[i][j] summed over i in order; quantizer:
// ((x / scale) + zero) + 0.5), so codes and FP16 parameters are bit-identical to
// DemoteRowsToInt2. The clip threshold sort(|x|)[floor(rho*d)] comes from a radix select
// over the bit patterns of |x|.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvcd/kernels/cuda_demote.h"

namespace kvcd::kernels::cuda {
namespace {

__device__ __forceinline__ int64_t Offset(const Int2RowRef& r, int64_t t, int64_t j) {
  return (t / r.rows_per_group) * r.row_group_stride + (t % r.rows_per_group) * r.row_stride +
         (j / r.bytes_per_group) * r.byte_group_stride + (j % r.bytes_per_group) * r.byte_stride;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpMin(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int D>
__global__ void DemoteKernel(const __nv_bfloat16* rows, int64_t n, const float* rot, float rho,
                             Int2RowRef out, int64_t first_row) {
  constexpr int E = D / 32, Q = D / 4;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= n) return;  // whole warps exit together
  float x[E];
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = __bfloat162float(rows[row * D + lane + 32 * k]);
  if (rot != nullptr) {
    float y[E];
#pragma unroll
    for (int k = 0; k < E; ++k) y[k] = 0.0f;
#pragma unroll
    for (int k = 0; k < E; ++k) {
#pragma unroll 8
      for (int src = 0; src < 32; ++src) {
        const float xi = __shfl_sync(0xffffffffu, x[k], src);
        const float* ri = rot + static_cast<int64_t>(k * 32 + src) * D + lane;
#pragma unroll
        for (int m = 0; m < E; ++m) y[m] = __fadd_rn(y[m], __fmul_rn(xi, __ldg(ri + 32 * m)));
      }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = y[k];
  }
  // Clip threshold: the element of rank kk = floor(rho * d) of the sorted |x|, by a radix
  // select on the bits of |x| (non-negative floats order as their bit patterns): the
  // largest v with #{|x| < v} <= kk is sort(|x|)[kk]. 31 steps of E compares and ballots
  // instead of d * E all-pairs comparisons.
  const int kk = min(static_cast<int>(floorf(rho * static_cast<float>(D))), D - 1);
  uint32_t bits[E];
#pragma unroll
  for (int k = 0; k < E; ++k) bits[k] = __float_as_uint(fabsf(x[k]));
  uint32_t v = 0;
#pragma unroll 1
  for (int b = 30; b >= 0; --b) {
    const uint32_t cand = v | (1u << b);
    int below = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) below += __popc(__ballot_sync(0xffffffffu, bits[k] < cand));
    if (below <= kk) v = cand;
  }
  const float tau = __uint_as_float(v);
  float lo = tau, hi = -tau;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    x[k] = fminf(fmaxf(x[k], -tau), tau);
    lo = fminf(lo, x[k]);
    hi = fmaxf(hi, x[k]);
  }
  lo = WarpMin(lo);
  hi = WarpMax(hi);
  const float scale = __fdiv_rn(fmaxf(__fsub_rn(hi, lo), 1e-8f), 3.0f);
  const float zero = __fdiv_rn(-lo, scale);
  int q[E];
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const float qf = floorf(__fadd_rn(__fadd_rn(__fdiv_rn(x[k], scale), zero), 0.5f));
    q[k] = static_cast<int>(fminf(fmaxf(qf, 0.0f), 3.0f));
  }
  const int64_t t = first_row + row;
  // Byte j holds elements j, j+Q, j+2Q, j+3Q.
  if constexpr (Q >= 32) {
#pragma unroll
    for (int r = 0; r < Q / 32; ++r) {
      int byte = 0;
#pragma unroll
      for (int m = 0; m < 4; ++m) byte |= q[r + m * (Q / 32)] << (2 * m);
      out.codes[Offset(out, t, lane + 32 * r)] = static_cast<uint8_t>(byte);
    }
  } else {  // Q = 16: element j + 16m lives in lane (j + 16m) % 32, slot m / 2
    const int j = lane % Q;
    int byte = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m)
      byte |= __shfl_sync(0xffffffffu, q[m / 2], j + 16 * (m % 2)) << (2 * m);
    if (lane < Q) out.codes[Offset(out, t, j)] = static_cast<uint8_t>(byte);
  }
  if (lane == 0) {
    out.scale[t * out.param_stride] = __half_as_ushort(__float2half_rn(scale));
    out.lo[t * out.param_stride] = __half_as_ushort(__float2half_rn(lo));
  }
}

}  // namespace

cudaError_t LaunchDemoteInt2(const uint16_t* rows, int64_t n, int head_dim, const float* rotation,
                             float rho, const Int2RowRef& out, int64_t first_row,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!(rho > 0.0f && rho <= 1.0f)) return cudaErrorInvalidValue;
  constexpr int kWarpsPerBlock = 8;
  const dim3 grid(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(rows);
  switch (head_dim) {  // one instantiation per head_dim
    case 64:
      DemoteKernel<64>
          <<<grid, 32 * kWarpsPerBlock, 0, stream>>>(in, n, rotation, rho, out, first_row);
      break;
    case 128:
      DemoteKernel<128>
          <<<grid, 32 * kWarpsPerBlock, 0, stream>>>(in, n, rotation, rho, out, first_row);
      break;
    case 256:
      DemoteKernel<256>
          <<<grid, 32 * kWarpsPerBlock, 0, stream>>>(in, n, rotation, rho, out, first_row);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvcd::kernels::cuda
