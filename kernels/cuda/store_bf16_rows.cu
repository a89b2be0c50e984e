// Paged BF16 row stores (cuda_store_rows.h): one warp per row, rotation as RotateRows,
// rounding as FloatToBf16.
#include "dispatch.cuh"
#include "int2_row_quantizer.cuh"
#include "kvcd/kernels/cuda_store_rows.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

__device__ __forceinline__ uint16_t FloatToBf16Bits(float f) {  // FloatToBf16 of bf16.h
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <int D>
__global__ void StoreBf16RowsKernel(RowBlock k, RowBlock v, PagedRows p, RowCodec codec) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kStoreWarpsPerBlock + (threadIdx.x >> 5);
  if (r >= int64_t{p.num_layers} * p.num_tokens * 2 * p.num_kv_heads) return;
  const StoreRow s = DecodeStoreRow(r, p);
  float x[D / 32];
  LoadStoreRow<D>(s.which == 0 ? k : v, s, lane, x);
  const float* rot = s.which == 0 ? codec.r_k : codec.r_v;
  if (rot != nullptr) RotateRowWarp<D>(x, rot + s.layer * codec.r_layer_stride, lane);
  auto* dst = reinterpret_cast<uint16_t*>(StorePage(p, s)) +
              ((int64_t{s.which} * p.num_kv_heads + s.head) * p.page_size + s.slot) * D;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = FloatToBf16Bits(x[e]);
}

}  // namespace

cudaError_t LaunchStoreBf16Rows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                                const RowCodec& codec, cudaStream_t stream) {
  if (!ValidStore(k, v, dst)) return cudaErrorInvalidValue;
  if (dst.num_tokens == 0) return cudaSuccess;
  return DispatchHeadDim(dst.head_dim, [&](auto hd) {
    StoreBf16RowsKernel<decltype(hd)::value>
        <<<StoreGrid(dst), 32 * kStoreWarpsPerBlock, 0, stream>>>(k, v, dst, codec);
    return cudaGetLastError();
  });
}

}  // namespace kvcd::kernels::cuda
