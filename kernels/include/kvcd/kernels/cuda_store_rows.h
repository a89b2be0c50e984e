// Paged row stores on the GPU (sm_90): the K/V rows of many tokens, all layers at once,
// written into their page slots in one launch — as BF16 (rotated or not) or quantized to
// OSCAR INT2 — from any device memory (a worker's CUDA IPC buffer, staged request bytes,
// or a BF16 window page being demoted). Framework-free; launchers never synchronize.
//
// Row (layer l, token t, head h) of a RowBlock starts at element
//   l * layer_stride + t * token_stride + h * head_stride
// and token t goes to slot slots[t] % page_size of page slots[t] / page_size of the pool,
// whose layer l page p starts at base + l * layer_stride + p * page_bytes (bytes).
// Rows are rotated exactly as RotateRows does and rounded as FloatToBf16 / quantized as
// DemoteRowsToInt2, so the device path stores the host path's bytes bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

struct RowBlock {
  const void* data = nullptr;  // device
  bool bf16 = true;            // else F32
  int64_t layer_stride = 0;    // elements
  int64_t token_stride = 0;    // elements
  int64_t head_stride = 0;     // elements
};

struct PagedRows {
  // Up to this many tokens' slots travel in the launch's parameters (decode steps: no
  // upload before the launch).
  static constexpr int kInlineSlots = 32;
  int32_t num_layers = 0;
  int64_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  uint8_t* base = nullptr;         // pool memory of layer 0 (device)
  int64_t layer_stride = 0;        // bytes between layers of the pool
  int64_t page_bytes = 0;          // bytes of one page of one layer
  const int64_t* slots = nullptr;  // [num_tokens] page * page_size + slot (device), or null:
  int64_t inline_slots[kInlineSlots] = {};  // the same, for num_tokens <= kInlineSlots
};

// Per-layer rotations and clip ratios: layer l uses r + l * r_layer_stride ([head_dim]^2
// FP32, device) and rho[l] (device); null rotations store rows as given. INT2 stores apply
// layer l's rotation as DemoteRowsToInt2 does: by butterflies where hadamard_k[l] /
// hadamard_v[l] (device, indexed like rho) is nonzero — it must be exactly where
// ClassifyRotation (int2_codec.h) of the host copy says kHadamard — else densely (null
// arrays: dense everywhere).
struct RowCodec {
  const float* r_k = nullptr;
  const float* r_v = nullptr;
  int64_t r_layer_stride = 0;  // elements
  const float* rho_k = nullptr;
  const float* rho_v = nullptr;
  const uint8_t* hadamard_k = nullptr;
  const uint8_t* hadamard_v = nullptr;
};

// The non-finite check fused into a store (a client's K/V must never reach a pool with a
// NaN or ±Inf in it). Every value the store reads is tested as it is loaded, so the check
// adds no memory traffic; a row (one token, KV head, K or V) holding a non-finite value is
// stored as zeros, and reported:
//   - count / first_row (synchronous callers: device words the caller sets to 0 and ~0
//     before the launch and reads after it): count += the non-finite values of the launch
//     (one atomicAdd per row that has any), first_row = min of the launch row indices
//     ((layer * num_tokens + token) * 2 + which) * num_kv_heads + head of the bad rows
//     (layer and token counted from the launch's first), which: 0 = K, 1 = V;
//   - faults (pipelined callers, device_fault.h): a bad row of token t stores
//     faults[t].tag | input << kFaultInputShift (input kFaultKNew / kFaultVNew) into both
//     words of faults[t]; a target whose tag is 0 is skipped.
// Either report may be absent (null pointers).
struct StoreCheck {
  unsigned long long* count = nullptr;                      // device
  unsigned long long* first_row = nullptr;                  // device
  const DeviceFault* faults = nullptr;                      // [num_tokens] (device), or null:
  DeviceFault inline_faults[PagedRows::kInlineSlots] = {};  // for num_tokens <= kInlineSlots
  bool use_inline_faults = false;
};

// BF16 pages: K [heads][page_size][head_dim] then V (bf16_attention.h). With `check` (not
// null) the checked kernel runs, without it the kernel with no check compiled in.
// REQUIRES: head_dim in {64, 128, 256}.
Error LaunchStoreBf16Rows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                          const RowCodec& codec, cudaStream_t stream,
                          const StoreCheck* check = nullptr);

// INT2 pages (int2_attention.h). REQUIRES: head_dim in {64, 128, 256}, rho_k and rho_v set,
// every rho in (0, 1].
Error LaunchStoreInt2Rows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                          const RowCodec& codec, cudaStream_t stream,
                          const StoreCheck* check = nullptr);

}  // namespace kvcd::kernels::cuda
