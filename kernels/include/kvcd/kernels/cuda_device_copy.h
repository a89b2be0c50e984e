// Batched device copies for the data plane (sm_90): many (src, dst, bytes) spans in one
// launch — pages of a pool are one span per (page, layer), so moving N pages of an L-layer
// model would otherwise take N*L cudaMemcpy calls — with an optional validity check of the
// bytes copied (pushed pages must hold finite values), and the BF16/F32 -> F32 conversion
// of worker queries. (Rows of new tokens go into pages through cuda_store_rows.h.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcd::kernels::cuda {

enum CopyCheck : uint32_t {
  kCheckNone = 0,
  // Every 16-bit word is a finite BF16 value.
  kCheckBf16Finite = 1,
  // 16-bit FP16 parameters in blocks of `check_block` values alternating scale, minimum,
  // scale, ...: all finite, scales not negative (-0 allowed).
  kCheckFp16ScaleMin = 2,
};

struct CopySpan {
  const void* src = nullptr;  // device
  void* dst = nullptr;        // device; null = check only
  uint64_t bytes = 0;         // a multiple of 16 when src and dst are 16-byte aligned, else any
  uint32_t check = kCheckNone;
  uint32_t check_block = 0;
};

// Copies and checks `n` spans (`spans` in device memory); atomically adds the number of
// values failing their span's check to *bad (device, may be null when no span checks).
cudaError_t LaunchCopySpans(const CopySpan* spans, int n, unsigned long long* bad,
                            cudaStream_t stream);

// dst[i] = float(src[i]) for i < n; src is BF16 (bf16 = true) or F32.
cudaError_t LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream);

}  // namespace kvcd::kernels::cuda
