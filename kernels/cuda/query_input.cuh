// Device helper: one element of the worker's queries as they arrive (BF16 or F32), read with
// the fused non-finite check (device_fault.h) — the query conversion and the decode kernels
// that read raw queries (RawQueries in cuda_decode_attention.h) share it, so both give the
// same values and set the same fault words.
#pragma once

#include <cstdint>

#include "kvcd/kernels/device_fault.h"

namespace kvcd::kernels::cuda {

// float(src[i]) of queries [batch][row_elems] where finite, else 0; a non-finite value sets
// the words of its sequence's target faults[i / row_elems] (faults null: none; a target of
// tag 0: none) to tag | layer_bits | kFaultQuery. Writers of one sequence store the same word.
__device__ __forceinline__ float ReadQuery(const void* src, bool bf16, int64_t i,
                                           const DeviceFault* faults, int64_t row_elems,
                                           unsigned long long layer_bits) {
  const float x =
      bf16 ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(src)[i]) << 16)
           : static_cast<const float*>(src)[i];
  if ((__float_as_uint(x) & 0x7f800000u) != 0x7f800000u) return x;
  if (faults == nullptr) return 0.0f;
  const DeviceFault f = faults[i / row_elems];
  if (f.tag != 0) {
    const unsigned long long word =
        f.tag | layer_bits | (static_cast<unsigned long long>(kFaultQuery) << kFaultInputShift);
    *reinterpret_cast<volatile unsigned long long*>(f.device_word) = word;
    *reinterpret_cast<volatile unsigned long long*>(f.host_word) = word;
    __threadfence_system();
  }
  return 0.0f;
}

}  // namespace kvcd::kernels::cuda
