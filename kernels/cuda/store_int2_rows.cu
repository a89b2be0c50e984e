// Paged INT2 row stores (cuda_store_rows.h): one warp per row, the shared rotations and
// quantizer (int2_row_quantizer.cuh), codes and FP16 parameters placed as Int2PageLayout says.
// kCheck compiles the fused non-finite check in (StoreCheck).
#include <cuda_fp16.h>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "int2_row_quantizer.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/int2_attention.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

template <int D, bool kCheck>
__global__ void StoreInt2RowsKernel(RowBlock k, RowBlock v, PagedRows p, RowCodec codec,
                                    StoreCheck check) {
  constexpr int kQ = D / 4, kG = kQ < 4 ? kQ : 4;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kStoreWarpsPerBlock + (threadIdx.x >> 5);
  if (r >= int64_t{p.num_layers} * p.num_tokens * 2 * p.num_kv_heads) return;
  const StoreRow s = DecodeStoreRow(r, p);
  float x[D / 32];
  LoadStoreRow<D>(s.which == 0 ? k : v, s, lane, x);
  const float* rot = s.which == 0 ? codec.r_k : codec.r_v;
  if (rot != nullptr) rot += s.layer * codec.r_layer_stride;
  if constexpr (kCheck) {
    if (const int n = RowNonFiniteCount<D>(x); n > 0) {  // stored as zeros, not rotated
      if (lane == 0) ReportBadRow(check, s, r, n);
#pragma unroll
      for (int e = 0; e < D / 32; ++e) x[e] = 0.0f;
      rot = nullptr;
    }
  }
  const float rho = (s.which == 0 ? codec.rho_k : codec.rho_v)[s.layer];
  if (rot != nullptr) {
    const uint8_t* had = s.which == 0 ? codec.hadamard_k : codec.hadamard_v;
    if (had != nullptr && had[s.layer] != 0) {
      HadamardRowGroup<D, 32, 1>(x, GroupOf<32>(lane), __ldg(rot));
    } else {
      RotateRowWarp<D>(x, rot, lane);
    }
  }
  int q[D / 32];
  float scale, lo;
  QuantizeRowInt2<D, 32>(x, rho, GroupOf<32>(lane), q, &scale, &lo);
  const Int2PageLayout layout{p.num_kv_heads, p.page_size, D};
  uint8_t* page = StorePage(p, s);
  const int64_t ps = p.page_size;
  if (s.which == 0) {  // K: [heads][Q/G][page_size][G]
    uint8_t* codes = page + layout.KHead(s.head) + int64_t{s.slot} * kG;
    PackRowInt2<D>(q, lane, [&](int j, uint8_t b) { codes[(j / kG) * ps * kG + j % kG] = b; });
  } else {  // V: [heads][P4][Q][4]
    uint8_t* codes = page + layout.VHead(s.head) + (s.slot / 4) * 4 * kQ + s.slot % 4;
    PackRowInt2<D>(q, lane, [&](int j, uint8_t b) { codes[4 * j] = b; });
  }
  if (lane == 0) {
    auto* params = reinterpret_cast<uint16_t*>(page) +
                   (s.which == 0 ? layout.KScale(s.head) : layout.VScale(s.head)) + s.slot;
    params[0] = __half_as_ushort(__float2half_rn(scale));
    params[ps] = __half_as_ushort(__float2half_rn(lo));
  }
}

}  // namespace

Error LaunchStoreInt2Rows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                          const RowCodec& codec, cudaStream_t stream, const StoreCheck* check) {
  KVCD_CUDA_BIND_THREAD();
  if (!ValidStore(k, v, dst, check) || codec.rho_k == nullptr || codec.rho_v == nullptr) {
    return ToError(cudaErrorInvalidValue);
  }
  if (dst.num_tokens == 0) return Error();
  const StoreCheck c = check != nullptr ? *check : StoreCheck{};
  CountLaunch();
  return ToError(DispatchHeadDim(dst.head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    if (check != nullptr) {
      StoreInt2RowsKernel<kD, true>
          <<<StoreGrid(dst), 32 * kStoreWarpsPerBlock, 0, stream>>>(k, v, dst, codec, c);
    } else {
      StoreInt2RowsKernel<kD, false>
          <<<StoreGrid(dst), 32 * kStoreWarpsPerBlock, 0, stream>>>(k, v, dst, codec, c);
    }
    return cudaGetLastError();
  }));
}

}  // namespace kvcd::kernels::cuda
