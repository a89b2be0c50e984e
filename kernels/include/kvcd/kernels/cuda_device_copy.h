// The BF16/F32 -> F32 conversion of worker queries on the device (sm_90). Pages move with
// cuda_page_copy.h, rows of new tokens with cuda_store_rows.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

// dst[i] = float(src[i]) for i < n; src is BF16 (bf16 = true) or F32.
Error LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream);

// The worker's queries of `batch` sequences ([batch][row_elems]) to F32, with the non-finite
// check fused into the conversion (the one kernel that reads device queries, for every page
// format): dst[i] = float(src[i]) where that is finite, else 0, and sequence b's fault words
// (device_fault.h, input kFaultQuery) are set when faults (null: no report) has a target
// with a nonzero tag for it. The zeros keep NaN/Inf out of the attention kernels; the merge
// NaN-poisons the outputs of a faulted sequence (MergeTarget::faults). The word set is the
// target's tag with the layer bits of FaultTag(0, fault_layer) put in: a caller may keep
// targets of tag FaultTag(owner, 0), the same for every layer of a token (the daemon keeps
// them beside its page tables, which are then sent once per token, not once per layer), and
// name the call's layer here.
Error LaunchQueriesToFloat(const void* src, bool bf16, int64_t batch, int64_t row_elems, float* dst,
                           const DeviceFault* faults, cudaStream_t stream, int64_t fault_layer = 0);

}  // namespace kvcd::kernels::cuda
