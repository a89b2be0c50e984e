// IpcBuffer: a worker's device allocation shared with the daemon through CUDA IPC.
//
// Register once (cudaIpcGetMemHandle + an interprocess "ready" event, exchanged through
// RegisterBuffer); then requests carry only cuda_ipc regions (Region()). Ordering without
// host sleeps: after writing inputs on its stream the worker calls MarkReady(stream) (the
// daemon's stream waits on that event before reading), and before reading outputs it
// calls WaitDone(stream) (the worker's stream waits on the daemon's done event).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace kvcd::workers {

// CUDA error -> absl::Status (INTERNAL with the call and the error text).
absl::Status CudaCheck(cudaError_t e, const char* what);

class IpcBuffer {
 public:
  // Allocates `bytes` on the current device and registers it with the daemon.
  static absl::StatusOr<std::unique_ptr<IpcBuffer>> Create(Client* client, uint64_t bytes,
                                                           const std::string& name,
                                                           int64_t lease_ms = 0);
  ~IpcBuffer();  // unregisters (best effort) and frees

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t id() const { return id_; }
  // A region of the buffer for a tensor of dtype/shape at byte `offset`.
  void Region(v1::TensorRef* t, v1::DType dtype, std::vector<int64_t> shape, uint64_t offset) const;
  absl::Status MarkReady(cudaStream_t stream);
  absl::Status WaitDone(cudaStream_t stream);
  // Host-side waits, for a worker that keeps no cross-process wait pending on the GPU
  // (without MPS the GPU time-slices between the worker's and the daemon's contexts, and a
  // stream blocked on the other process's event keeps its context scheduled).
  absl::Status WaitReadyOnHost();
  absl::Status WaitDoneOnHost();
  // Stream memory operations in place of the events (issue #36): the 8 bytes at `offset`
  // (a multiple of 8, kept free by the caller) become the buffer's device signal words, the
  // ready word then the done word (zeroed here); DecodeChannel::SetDeviceSignal hands them
  // to the daemon. SignalReady writes `value` into the ready word once the work queued on
  // `stream` is done; WaitSignalDone makes `stream` wait until the daemon's done word has
  // reached `value` (cyclically).
  absl::Status UseSignalWords(uint64_t offset);
  uint64_t signal_offset() const { return signal_offset_; }
  absl::Status SignalReady(cudaStream_t stream, uint32_t value);
  absl::Status WaitSignalDone(cudaStream_t stream, uint32_t value);
  // Unregisters now (the daemon drops its mapping); the allocation stays.
  absl::Status Unregister();

 private:
  IpcBuffer() = default;
  Client* client_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t id_ = 0;
  bool registered_ = false;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  uint64_t signal_offset_ = 0;
  bool signals_ = false;
};

}  // namespace kvcd::workers
