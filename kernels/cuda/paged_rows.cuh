// Device helpers of the paged row stores (cuda_store_rows.h): which row a warp handles,
// where its source elements are, and where its page slot is.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kvcd/kernels/cuda_store_rows.h"

namespace kvcd::kernels::cuda {

constexpr int kStoreWarpsPerBlock = 8;

// Row r of a launch, ordered ((layer * tokens + token) * 2 + which) * heads + head so that
// neighbouring warps read neighbouring heads of one token (contiguous in a request).
struct StoreRow {
  int32_t layer;
  int64_t token;
  int32_t which;  // 0 = K, 1 = V
  int32_t head;
  int64_t page;
  int32_t slot;
};

__device__ __forceinline__ StoreRow DecodeStoreRow(int64_t r, const PagedRows& p) {
  StoreRow s;
  s.head = static_cast<int32_t>(r % p.num_kv_heads);
  r /= p.num_kv_heads;
  s.which = static_cast<int32_t>(r & 1);
  r >>= 1;
  s.token = r % p.num_tokens;
  s.layer = static_cast<int32_t>(r / p.num_tokens);
  const int64_t at = p.slots != nullptr ? p.slots[s.token] : p.inline_slots[s.token];
  s.page = at / p.page_size;
  s.slot = static_cast<int32_t>(at - s.page * p.page_size);
  return s;
}

// Lane l's elements l + 32k of the row, as float.
template <int D>
__device__ __forceinline__ void LoadStoreRow(const RowBlock& b, const StoreRow& s, int lane,
                                             float (&x)[D / 32]) {
  const int64_t off = s.layer * b.layer_stride + s.token * b.token_stride + s.head * b.head_stride;
  if (b.bf16) {
    const auto* src = static_cast<const __nv_bfloat16*>(b.data) + off;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) x[k] = __bfloat162float(src[lane + 32 * k]);
  } else {
    const float* src = static_cast<const float*>(b.data) + off;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) x[k] = src[lane + 32 * k];
  }
}

// The fused non-finite check (StoreCheck): how many of the warp's row values (lane l holds
// l + 32k) are NaN or ±Inf, the same on every lane. The clean path costs one exponent test
// per value and one vote per row; counting runs only for a row that has a bad value.
template <int D>
__device__ __forceinline__ int RowNonFiniteCount(const float (&x)[D / 32]) {
  bool any = false;
#pragma unroll
  for (int k = 0; k < D / 32; ++k) any |= (__float_as_uint(x[k]) & 0x7f800000u) == 0x7f800000u;
  if (!__any_sync(0xffffffffu, any)) return 0;
  int n = 0;
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    n += __popc(__ballot_sync(0xffffffffu, (__float_as_uint(x[k]) & 0x7f800000u) == 0x7f800000u));
  }
  return n;
}

// Reports row r (bad values `bad` > 0) of a launch as StoreCheck says; one lane calls it.
__device__ __forceinline__ void ReportBadRow(const StoreCheck& c, const StoreRow& s, int64_t r,
                                             int bad) {
  if (c.count != nullptr) atomicAdd(c.count, static_cast<unsigned long long>(bad));
  if (c.first_row != nullptr) atomicMin(c.first_row, static_cast<unsigned long long>(r));
  // By value: taking the address of the launch's parameters would copy them to local memory.
  const DeviceFault f = c.use_inline_faults   ? c.inline_faults[s.token]
                        : c.faults != nullptr ? c.faults[s.token]
                                              : DeviceFault{};
  if (f.tag != 0) {
    const unsigned long long word =
        f.tag | (static_cast<unsigned long long>(s.which == 0 ? kFaultKNew : kFaultVNew)
                 << kFaultInputShift);
    *reinterpret_cast<volatile unsigned long long*>(f.device_word) = word;
    *reinterpret_cast<volatile unsigned long long*>(f.host_word) = word;
    __threadfence_system();
  }
}

// The first byte of (layer, page) of the pool.
__device__ __forceinline__ uint8_t* StorePage(const PagedRows& p, const StoreRow& s) {
  return p.base + s.layer * p.layer_stride + s.page * p.page_bytes;
}

inline bool ValidStore(const RowBlock& k, const RowBlock& v, const PagedRows& p,
                       const StoreCheck* check) {
  return k.data != nullptr && v.data != nullptr && p.base != nullptr &&
         (p.slots != nullptr || p.num_tokens <= PagedRows::kInlineSlots) && p.num_layers > 0 &&
         p.num_kv_heads > 0 && p.page_size > 0 && p.num_tokens >= 0 &&
         (check == nullptr || !check->use_inline_faults || p.num_tokens <= PagedRows::kInlineSlots);
}

// Blocks of kStoreWarpsPerBlock warps for warps_per_row warps on every row.
inline dim3 StoreGrid(const PagedRows& p, int warps_per_row = 1) {
  const int64_t warps = int64_t{p.num_layers} * p.num_tokens * 2 * p.num_kv_heads * warps_per_row;
  return dim3(static_cast<unsigned>((warps + kStoreWarpsPerBlock - 1) / kStoreWarpsPerBlock));
}

}  // namespace kvcd::kernels::cuda
