// Whole pages between a pool ([layer][page][layer_bytes], page ids) and a run of pages
// stored back to back ([page][layer][layer_bytes]) — the form in which pages travel
// (PushPages, FetchPages, NCCL staging) — in one launch, with an optional validity check
// of the bytes read (CopyCheck). sm_90, framework-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

enum CopyCheck : uint32_t {
  kCheckNone = 0,
  // Every 16-bit word is a finite BF16 value.
  kCheckBf16Finite = 1,
  // 16-bit FP16 parameters in blocks of `check_block` values alternating scale, minimum,
  // scale, ...: all finite, scales not negative (-0 allowed).
  kCheckFp16ScaleMin = 2,
  // Every 32-bit word (two 16-bit values, little-endian) is a finite F32 value: the check
  // reads the high half of each, which holds the F32 exponent where a BF16 holds its own.
  // REQUIRES: check_offset a multiple of 4.
  kCheckF32Finite = 3,
};

enum class PageCopy : int {
  kScatter = 0,  // run -> pool (pages page_ids[i] of every layer)
  kGather = 1,   // pool -> run
  kCheck = 2,    // run only: count the values that fail the check
};

struct PagedCopyArgs {
  uint8_t* pool = nullptr;        // layer 0, page 0 of the pool (device)
  int64_t pool_layer_stride = 0;  // bytes between layers of the pool
  int64_t layer_bytes = 0;        // bytes of one page of one layer
  int32_t num_layers = 0;
  const int32_t* page_ids = nullptr;  // [num_pages] (device); unused by kCheck
  int64_t num_pages = 0;
  uint8_t* run = nullptr;  // num_pages * num_layers * layer_bytes bytes (device)
  // The check: values in bytes [check_offset, check_offset + check_bytes) of every layer
  // page (16-bit words), CopyCheck semantics with check_block.
  uint32_t check = 0;
  uint32_t check_block = 0;
  int64_t check_offset = 0;
  int64_t check_bytes = 0;
};

// With a check, atomically adds the number of failing values to *bad (device).
// REQUIRES: layer_bytes, check_offset and check_bytes even; 16-byte alignment of pool, run
// and layer_bytes takes the vector path, anything else the byte path.
Error LaunchPagedCopy(PageCopy kind, const PagedCopyArgs& a, unsigned long long* bad,
                      cudaStream_t stream);

}  // namespace kvcd::kernels::cuda
