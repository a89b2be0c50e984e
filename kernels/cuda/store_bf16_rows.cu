// Paged BF16 row stores (cuda_store_rows.h): D/32 warps per row, warp w producing outputs
// [32w, 32w + 32) (one per lane) so that the rotation's reads of R spread over as many warps
// as there are columns to make; each output summed in input order as RotateRows does, and
// rounded as FloatToBf16. kCheck compiles the fused non-finite check in (StoreCheck).
#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

__device__ __forceinline__ uint16_t FloatToBf16Bits(float f) {  // FloatToBf16 of bf16.h
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <int D, bool kCheck>
__global__ void StoreBf16RowsKernel(RowBlock k, RowBlock v, PagedRows p, RowCodec codec,
                                    StoreCheck check) {
  constexpr int kWarpsPerRow = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kStoreWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t r = warp / kWarpsPerRow;
  const int slice = static_cast<int>(warp - r * kWarpsPerRow);
  if (r >= int64_t{p.num_layers} * p.num_tokens * 2 * p.num_kv_heads) return;
  const StoreRow s = DecodeStoreRow(r, p);
  float x[D / 32];
  LoadStoreRow<D>(s.which == 0 ? k : v, s, lane, x);
  bool bad = false;
  if constexpr (kCheck) {  // every warp of the row holds all of it; the first one reports
    const int n = RowNonFiniteCount<D>(x);
    bad = n > 0;
    if (bad && slice == 0 && lane == 0) ReportBadRow(check, s, r, n);
  }
  const int j = 32 * slice + lane;  // this lane's output
  float y = x[slice];
  const float* rot = s.which == 0 ? codec.r_k : codec.r_v;
  if (rot != nullptr) {
    rot += s.layer * codec.r_layer_stride + j;
    y = 0.0f;
    // The 32 weights of a slice are loaded before its sums start, so that their loads are
    // in flight together (one L2 latency per slice, not one per 8 weights: the decode
    // loop's per-token row store is latency-bound); the sums keep their order.
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      float w[32];
#pragma unroll
      for (int src = 0; src < 32; ++src)
        w[src] = __ldg(rot + static_cast<int64_t>(32 * e + src) * D);
#pragma unroll
      for (int src = 0; src < 32; ++src) {
        const float xi = __shfl_sync(0xffffffffu, x[e], src);
        y = __fadd_rn(y, __fmul_rn(xi, w[src]));
      }
    }
  }
  auto* dst = reinterpret_cast<uint16_t*>(StorePage(p, s)) +
              ((int64_t{s.which} * p.num_kv_heads + s.head) * p.page_size + s.slot) * D;
  dst[j] = bad ? uint16_t{0} : FloatToBf16Bits(y);
}

}  // namespace

Error LaunchStoreBf16Rows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                          const RowCodec& codec, cudaStream_t stream, const StoreCheck* check) {
  KVCD_CUDA_BIND_THREAD();
  if (!ValidStore(k, v, dst, check)) return ToError(cudaErrorInvalidValue);
  if (dst.num_tokens == 0) return Error();
  const StoreCheck c = check != nullptr ? *check : StoreCheck{};
  CountLaunch();
  return ToError(DispatchHeadDim(dst.head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    const dim3 grid = StoreGrid(dst, kD / 32);
    if (check != nullptr) {
      StoreBf16RowsKernel<kD, true>
          <<<grid, 32 * kStoreWarpsPerBlock, 0, stream>>>(k, v, dst, codec, c);
    } else {
      StoreBf16RowsKernel<kD, false>
          <<<grid, 32 * kStoreWarpsPerBlock, 0, stream>>>(k, v, dst, codec, c);
    }
    return cudaGetLastError();
  }));
}

}  // namespace kvcd::kernels::cuda
