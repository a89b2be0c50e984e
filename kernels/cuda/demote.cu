// Quantize-on-demote of contiguous BF16 rows on the GPU (cuda_demote.h): the grouped kernel
// (a row on D/32 lanes, 32 values per lane loaded as 16-byte runs, Hadamard rotation by
// butterflies) and the warp-per-row kernel (dense rotations; kept for comparison). The
// quantizer is int2_row_quantizer.cuh, shared with the paged row stores.
#include <algorithm>

#include "cuda_error.cuh"
#include "device_binding.cuh"
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

__device__ __forceinline__ void StoreParams(uint16_t* out_scale, uint16_t* out_lo,
                                            int64_t param_stride, uint32_t t, float scale,
                                            float lo) {
  out_scale[t * param_stride] = __half_as_ushort(__float2half_rn(scale));
  out_lo[t * param_stride] = __half_as_ushort(__float2half_rn(lo));
}

// One warp per row; rot: a dense [D][D] rotation (hadamard = false) or c·H (c = rot[0]).
template <int D>
__global__ void DemoteWarpKernel(const __nv_bfloat16* rows, int64_t n, const float* rot,
                                 bool hadamard, float rho, CodeAddr out, uint16_t* out_scale,
                                 uint16_t* out_lo, int64_t param_stride, int64_t first_row) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= n) return;  // whole warps exit together
  const GroupOf<32> grp(lane);
  float x[E];
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = __bfloat162float(rows[row * D + lane + 32 * k]);
  if (rot != nullptr) {
    if (hadamard) {
      HadamardRowGroup<D, 32, 1>(x, grp, __ldg(rot));
    } else {
      RotateRowWarp<D>(x, rot, lane);
    }
  }
  int q[E];
  float scale, lo;
  QuantizeRowInt2<D, 32>(x, rho, grp, q, &scale, &lo);
  const uint32_t t = static_cast<uint32_t>(first_row + row);
  uint8_t* codes = out.codes + out.RowBase(t);
  PackRowInt2<D>(q, lane, [&](int j, uint8_t byte) { codes[out.ByteOffset(j)] = byte; });
  if (lane == 0) StoreParams(out_scale, out_lo, param_stride, t, scale, lo);
}

// A row on L = D/32 lanes: lane g holds the 16-byte runs g + L*i (i < 4) of its row, i.e.
// element j + 8g + (D/4)i in slot j + 8i (HadamardRowGroup's layout, J = 8), so it owns code bytes
// 8g .. 8g + 7 whole. vec: the codes of a row are D/4 contiguous bytes at 8-byte aligned row bases.
template <int D>
__global__ void __launch_bounds__(256)
    DemoteGroupedKernel(const __nv_bfloat16* rows, int64_t n, const float* hadamard, float rho,
                        CodeAddr out, bool vec, uint16_t* out_scale, uint16_t* out_lo,
                        int64_t param_stride, int64_t first_row) {
  constexpr int L = D / 32, E = 32, kRuns = E / 8;
  const int lane = threadIdx.x & 31;
  const GroupOf<L> grp(lane);
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / L;
  const bool live = row < n;  // dead groups redo the last row and store nothing
  const int64_t r = live ? row : n - 1;
  const uint4* src = reinterpret_cast<const uint4*>(rows + r * D);
  float x[E];
#pragma unroll
  for (int i = 0; i < kRuns; ++i) {
    const uint4 w = __ldg(src + grp.g + L * i);
    const uint32_t h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      x[8 * i + 2 * p] = __uint_as_float(h[p] << 16);
      x[8 * i + 2 * p + 1] = __uint_as_float(h[p] & 0xffff0000u);
    }
  }
  if (hadamard != nullptr) HadamardRowGroup<D, L, 8>(x, grp, __ldg(hadamard));
  int q[E];
  float scale, lo;
  QuantizeRowInt2<D, L>(x, rho, grp, q, &scale, &lo);
  if (!live) return;
  uint32_t word[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    word[w] = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int j = 4 * w + b;
      uint32_t byte = 0;
#pragma unroll
      for (int i = 0; i < kRuns; ++i) byte |= static_cast<uint32_t>(q[j + 8 * i]) << (2 * i);
      word[w] |= byte << (8 * b);
    }
  }
  const uint32_t t = static_cast<uint32_t>(first_row + r);
  uint8_t* codes = out.codes + out.RowBase(t);
  if (vec) {
    *reinterpret_cast<uint2*>(codes + 8 * grp.g) = make_uint2(word[0], word[1]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      codes[out.ByteOffset(8 * grp.g + j)] = static_cast<uint8_t>(word[j / 4] >> (8 * (j % 4)));
    }
  }
  if (grp.g == 0) StoreParams(out_scale, out_lo, param_stride, t, scale, lo);
}

}  // namespace

Error LaunchDemoteInt2(const uint16_t* rows, int64_t n, int head_dim, const float* rotation,
                       Rotation kind, float rho, const Int2RowRef& out, int64_t first_row,
                       cudaStream_t stream, DemoteKernel kernel) {
  KVCD_CUDA_BIND_THREAD();
  if (n <= 0) return Error();
  constexpr int64_t kMax32 = (int64_t{1} << 31) - 1;
  if (!(rho > 0.0f && rho <= 1.0f) || first_row < 0 || first_row + n > kMax32 ||
      out.rows_per_group <= 0 || out.bytes_per_group <= 0 ||
      (kind != Rotation::kNone && rotation == nullptr)) {
    return ToError(cudaErrorInvalidValue);
  }
  const CodeAddr addr{out.codes,
                      out.row_stride,
                      out.row_group_stride,
                      out.byte_group_stride,
                      out.byte_stride,
                      static_cast<uint32_t>(std::min(out.rows_per_group, kMax32)),
                      static_cast<uint32_t>(std::min(out.bytes_per_group, kMax32))};
  const float* rot = kind == Rotation::kNone ? nullptr : rotation;
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(rows);
  // The grouped kernel reads 16-byte runs and applies no dense rotation.
  const bool grouped = kernel == DemoteKernel::kGrouped && kind != Rotation::kDense &&
                       reinterpret_cast<uintptr_t>(rows) % 16 == 0;
  CountLaunch();
  return ToError(DispatchHeadDim(head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    if (grouped) {
      const int64_t q = kD / 4;
      const bool vec = out.byte_stride == 1 && out.bytes_per_group >= q &&
                       reinterpret_cast<uintptr_t>(out.codes) % 8 == 0 && out.row_stride % 8 == 0 &&
                       (out.rows_per_group > kMax32 || out.row_group_stride % 8 == 0);
      constexpr int kThreads = 256, kRowsPerBlock = kThreads / (kD / 32);
      const dim3 grid(static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock));
      DemoteGroupedKernel<kD><<<grid, kThreads, 0, stream>>>(in, n, rot, rho, addr, vec, out.scale,
                                                             out.lo, out.param_stride, first_row);
    } else {
      constexpr int kWarpsPerBlock = 8;
      const dim3 grid(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
      DemoteWarpKernel<kD><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
          in, n, rot, kind == Rotation::kHadamard, rho, addr, out.scale, out.lo, out.param_stride,
          first_row);
    }
    return cudaGetLastError();
  }));
}

}  // namespace kvcd::kernels::cuda
