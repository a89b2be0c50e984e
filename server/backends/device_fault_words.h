// DeviceFaultWords: one sequence's pair of fault words (kernels/device_fault.h) on a backend
// with a device: kernels of pipelined calls set them when they meet a NaN or ±Inf in the
// sequence's device inputs (fused k_new / v_new, queries); the daemon reads the host word
// before every later call on the sequence, the merge kernel reads the device word.
//
// Thread safety: Read() may be called from any thread (the word is written by the device).
#pragma once

#include <cstdint>

#include "kvcd/kernels/device_fault.h"

namespace kvcd {

struct DeviceFaultWords {
  // What kernels get; target.tag is FaultTag(owner, 0) (callers put the call's layer in).
  kernels::DeviceFault target;
  uint64_t* host = nullptr;  // the daemon's view of target.host_word; null: none held
  int64_t slot = -1;         // the backend's index of the pair

  bool held() const { return host != nullptr; }
  // The word a kernel set for this owner, or 0 while clean.
  uint64_t Read() const {
    if (host == nullptr) return 0;
    // Written by the device through the mapping: an atomic load, never a cached value.
    const uint64_t w = __atomic_load_n(host, __ATOMIC_ACQUIRE);
    return kernels::FaultMatches(w, target.tag) ? w : 0;
  }
  // The target of a call at `layer`.
  kernels::DeviceFault AtLayer(int64_t layer) const {
    kernels::DeviceFault f = target;
    if (f.tag != 0) f.tag = kernels::FaultTag(f.tag >> kernels::kFaultOwnerShift, layer);
    return f;
  }
};

}  // namespace kvcd
