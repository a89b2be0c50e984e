// Quantize-on-demote on the GPU, one warp per row (see cuda_demote.h and int2_codec.h).
// Lane l holds elements l + 32k. Every step uses the CPU code's FP32 operations in the same
// order without contraction (rotation: x[i] * R[i][j] summed over i in order; quantizer:
// ((x / scale) + zero) + 0.5), so codes and FP16 parameters are bit-identical to
// DemoteRowsToInt2. The clip threshold sort(|x|)[floor(rho*d)] comes from repeated warp
// maxima (few elements above it) or a radix select over the bit patterns of |x|.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kvcd/kernels/cuda_demote.h"

namespace kvcd::kernels::cuda {
namespace {

// Where codes go: Int2RowRef's offset rule with 32-bit quotients (row indices and byte
// indices are < 2^31, checked at launch; a group size >= 2^31 means "one group").
struct CodeAddr {
  uint8_t* codes;
  int64_t row_stride, row_group_stride, byte_group_stride, byte_stride;
  uint32_t rows_per_group, bytes_per_group;
  __device__ __forceinline__ int64_t RowBase(uint32_t t) const {
    const uint32_t q = t / rows_per_group;
    return q * row_group_stride + (t - q * rows_per_group) * row_stride;
  }
  __device__ __forceinline__ int64_t ByteOffset(uint32_t j) const {
    const uint32_t q = j / bytes_per_group;
    return q * byte_group_stride + (j - q * bytes_per_group) * byte_stride;
  }
};

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
                             CodeAddr out, uint16_t* out_scale, uint16_t* out_lo,
                             int64_t param_stride, int64_t first_row) {
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
  // Clip threshold: the element of rank kk = floor(rho * d) of the sorted |x|, compared as
  // bit patterns (non-negative floats order as their bits). Clipping keeps the top d - kk
  // - 1 elements out, so for a small count the threshold is found by taking the warp's
  // largest element out that many times (one warp max and one ballot per round); otherwise
  // by a radix select: the largest v with #{|x| < v} <= kk (31 rounds of E ballots).
  const int kk = min(static_cast<int>(floorf(rho * static_cast<float>(D))), D - 1);
  const int above = D - 1 - kk;  // elements ranked above the threshold
  uint32_t bits[E];
#pragma unroll
  for (int k = 0; k < E; ++k) bits[k] = __float_as_uint(fabsf(x[k]));
  uint32_t v = 0;
  if (above <= 16) {
#pragma unroll 1
    for (int r = 0; r < above; ++r) {
      uint32_t mine = bits[0];
#pragma unroll
      for (int k = 1; k < E; ++k) mine = max(mine, bits[k]);
      const uint32_t top = __reduce_max_sync(0xffffffffu, mine);
      const uint32_t holders = __ballot_sync(0xffffffffu, mine == top);
      if (lane == __ffs(holders) - 1) {  // one instance leaves: the first lane's first slot
        bool done = false;
#pragma unroll
        for (int k = 0; k < E; ++k) {
          const bool hit = !done && bits[k] == top;
          bits[k] = hit ? 0u : bits[k];
          done = done || hit;
        }
      }
    }
    uint32_t mine = bits[0];
#pragma unroll
    for (int k = 1; k < E; ++k) mine = max(mine, bits[k]);
    v = __reduce_max_sync(0xffffffffu, mine);
  } else {
#pragma unroll 1
    for (int b = 30; b >= 0; --b) {
      const uint32_t cand = v | (1u << b);
      int below = 0;
#pragma unroll
      for (int k = 0; k < E; ++k) below += __popc(__ballot_sync(0xffffffffu, bits[k] < cand));
      if (below <= kk) v = cand;
    }
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
  const uint32_t t = static_cast<uint32_t>(first_row + row);
  uint8_t* codes = out.codes + out.RowBase(t);
  // Byte j holds elements j, j+Q, j+2Q, j+3Q.
  if constexpr (Q >= 32) {
#pragma unroll
    for (int r = 0; r < Q / 32; ++r) {
      int byte = 0;
#pragma unroll
      for (int m = 0; m < 4; ++m) byte |= q[r + m * (Q / 32)] << (2 * m);
      codes[out.ByteOffset(lane + 32 * r)] = static_cast<uint8_t>(byte);
    }
  } else {  // Q = 16: element j + 16m lives in lane (j + 16m) % 32, slot m / 2
    const int j = lane % Q;
    int byte = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m)
      byte |= __shfl_sync(0xffffffffu, q[m / 2], j + 16 * (m % 2)) << (2 * m);
    if (lane < Q) codes[out.ByteOffset(j)] = static_cast<uint8_t>(byte);
  }
  if (lane == 0) {
    out_scale[t * param_stride] = __half_as_ushort(__float2half_rn(scale));
    out_lo[t * param_stride] = __half_as_ushort(__float2half_rn(lo));
  }
}

}  // namespace

cudaError_t LaunchDemoteInt2(const uint16_t* rows, int64_t n, int head_dim, const float* rotation,
                             float rho, const Int2RowRef& out, int64_t first_row,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int64_t kMax32 = (int64_t{1} << 31) - 1;
  if (!(rho > 0.0f && rho <= 1.0f) || first_row < 0 || first_row + n > kMax32 ||
      out.rows_per_group <= 0 || out.bytes_per_group <= 0) {
    return cudaErrorInvalidValue;
  }
  const CodeAddr addr{out.codes,
                      out.row_stride,
                      out.row_group_stride,
                      out.byte_group_stride,
                      out.byte_stride,
                      static_cast<uint32_t>(std::min(out.rows_per_group, kMax32)),
                      static_cast<uint32_t>(std::min(out.bytes_per_group, kMax32))};
  constexpr int kWarpsPerBlock = 8;
  const dim3 grid(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(rows);
  switch (head_dim) {  // one instantiation per head_dim
    case 64:
      DemoteKernel<64><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
          in, n, rotation, rho, addr, out.scale, out.lo, out.param_stride, first_row);
      break;
    case 128:
      DemoteKernel<128><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
          in, n, rotation, rho, addr, out.scale, out.lo, out.param_stride, first_row);
      break;
    case 256:
      DemoteKernel<256><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
          in, n, rotation, rho, addr, out.scale, out.lo, out.param_stride, first_row);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvcd::kernels::cuda
