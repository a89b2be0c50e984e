// Quantize-on-demote of contiguous BF16 rows on the GPU, one warp per row (cuda_demote.h);
// the quantizer is int2_row_quantizer.cuh, shared with the paged row stores.
#include <algorithm>

#include "dispatch.cuh"
#include "int2_row_quantizer.cuh"
#include "kvcd/kernels/call_counts.h"
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

template <int D>
__global__ void DemoteKernel(const __nv_bfloat16* rows, int64_t n, const float* rot, float rho,
                             CodeAddr out, uint16_t* out_scale, uint16_t* out_lo,
                             int64_t param_stride, int64_t first_row) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= n) return;  // whole warps exit together
  float x[E];
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = __bfloat162float(rows[row * D + lane + 32 * k]);
  int q[E];
  float scale, lo;
  QuantizeRowInt2<D>(x, rot, rho, lane, q, &scale, &lo);
  const uint32_t t = static_cast<uint32_t>(first_row + row);
  uint8_t* codes = out.codes + out.RowBase(t);
  PackRowInt2<D>(q, lane, [&](int j, uint8_t byte) { codes[out.ByteOffset(j)] = byte; });
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
  CountLaunch();
  return DispatchHeadDim(head_dim, [&](auto hd) {
    DemoteKernel<decltype(hd)::value><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
        in, n, rotation, rho, addr, out.scale, out.lo, out.param_stride, first_row);
    return cudaGetLastError();
  });
}

}  // namespace kvcd::kernels::cuda
