// CudaFaultBoard: the CUDA backend's store of per-sequence fault words
// (device_fault_words.h): host words in mapped pinned memory and device words in device
// memory, carved from chunks that are allocated as sequences need them and kept until the
// backend goes (kernels may still hold their addresses). A released pair is reused under a
// new owner number. CUDA builds only.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "server/backends/device_fault_words.h"

namespace kvcd {

class CudaFaultBoard {
 public:
  CudaFaultBoard() = default;
  CudaFaultBoard(const CudaFaultBoard&) = delete;
  CudaFaultBoard& operator=(const CudaFaultBoard&) = delete;
  // REQUIRES: no kernel that can still write a word is queued (the backend synchronizes
  // before it goes).
  ~CudaFaultBoard();

  absl::StatusOr<DeviceFaultWords> Acquire();
  void Release(const DeviceFaultWords& words);

 private:
  static constexpr int64_t kChunkWords = 1024;
  struct Chunk {
    uint64_t* host = nullptr;                 // [kChunkWords] mapped pinned memory
    unsigned long long* host_view = nullptr;  // the same, as kernels address it
    unsigned long long* device = nullptr;     // [kChunkWords] device memory
  };
  absl::Status GrowLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::mutex mu_;
  std::vector<Chunk> chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> free_ ABSL_GUARDED_BY(mu_);
  uint64_t next_owner_ ABSL_GUARDED_BY(mu_) = 1;  // 48 bits: never wraps in practice
};

}  // namespace kvcd
