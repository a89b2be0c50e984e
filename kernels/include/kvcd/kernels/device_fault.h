// Non-finite inputs met by device kernels of pipelined calls (framework-free, no CUDA
// headers: the daemon's host code and the kernels share it).
//
// A fused AttentionDecode over CUDA IPC is answered before its kernels run, so a NaN or
// ±Inf in the worker's k_new, v_new or q cannot fail that call. Instead each sequence owns
// two 64-bit words, 0 while clean: one in mapped pinned host memory, which the daemon reads
// before every later call on the sequence, and one in device memory, which the merge
// kernel reads to NaN-poison the outputs of a faulted sequence. A kernel that meets a
// non-finite input of sequence s stores
//     word = tag | input << kFaultInputShift
// into both of s's words, where tag = owner << kFaultOwnerShift | layer (owner: a nonzero
// number naming the word's current owner, layer: the call's layer) and input a FaultInput.
// Words are reused by later sequences: a reader counts a word as set only when its owner
// bits are its own, so a late write of an earlier owner never matches.
#pragma once

#include <cstdint>

#include "kvcd/kernels/host_device.h"

namespace kvcd::kernels {

// Which input was not finite.
enum FaultInput : uint32_t {
  kFaultNone = 0,
  kFaultKNew = 1,
  kFaultVNew = 2,
  kFaultQuery = 3,
};

constexpr int kFaultInputShift = 14;
constexpr int kFaultOwnerShift = 16;
constexpr uint64_t kFaultLayerMask = (uint64_t{1} << kFaultInputShift) - 1;

// Where a kernel reports a non-finite input of one sequence (see above).
struct DeviceFault {
  unsigned long long* host_word = nullptr;    // device address of mapped pinned host memory
  unsigned long long* device_word = nullptr;  // device memory
  unsigned long long tag = 0;                 // owner << kFaultOwnerShift | layer; 0 = none
};

// The tag of owner `owner` (nonzero, < 2^48) at `layer` (clamped to the 14 bits it has).
KVCD_HOST_DEVICE inline uint64_t FaultTag(uint64_t owner, int64_t layer) {
  const uint64_t l = layer < 0 ? 0 : static_cast<uint64_t>(layer);
  return (owner << kFaultOwnerShift) | (l > kFaultLayerMask ? kFaultLayerMask : l);
}
// True when `word` was set by a kernel working for the owner of `tag`.
KVCD_HOST_DEVICE inline bool FaultMatches(uint64_t word, uint64_t tag) {
  return word != 0 && (word >> kFaultOwnerShift) == (tag >> kFaultOwnerShift);
}
KVCD_HOST_DEVICE inline FaultInput FaultInputOf(uint64_t word) {
  return static_cast<FaultInput>((word >> kFaultInputShift) & 3u);
}
KVCD_HOST_DEVICE inline int64_t FaultLayerOf(uint64_t word) {
  return static_cast<int64_t>(word & kFaultLayerMask);
}
inline const char* FaultInputName(FaultInput f) {
  switch (f) {
    case kFaultKNew:
      return "k_new";
    case kFaultVNew:
      return "v_new";
    case kFaultQuery:
      return "q";
    default:
      return "input";
  }
}

}  // namespace kvcd::kernels
