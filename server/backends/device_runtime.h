// DeviceRuntime: the device services of the data plane — CUDA IPC mappings and events,
// synchronous copies — offered by backends with device memory (Backend::device()).
// All device work of the daemon is ordered on one stream: work queued after other work
// runs after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#include "server/backends/device_fault_words.h"

namespace kvcd {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual absl::StatusOr<void*> OpenIpcBuffer(const std::string& handle) = 0;
  virtual void CloseIpcBuffer(void* ptr) = 0;
  virtual absl::StatusOr<void*> OpenIpcEvent(const std::string& handle) = 0;
  // An interprocess event of the daemon; *handle receives its IPC handle.
  virtual absl::StatusOr<void*> CreateIpcEvent(std::string* handle) = 0;
  virtual void DestroyEvent(void* event) = 0;
  // Later device work waits for `event`; `event` completes after the work queued so far.
  virtual absl::Status WaitEvent(void* event) = 0;
  virtual absl::Status RecordEvent(void* event) = 0;
  // The same two orderings through a 32-bit word of device memory (an IPC mapping of a
  // worker's buffer) instead of an event (stream memory operations, issue #36): later device
  // work waits until (int32_t)(*word - value) >= 0 / `value` is written into *word after the
  // work queued so far. FAILED_PRECONDITION where the driver lacks them.
  virtual absl::Status WaitValue(const uint32_t* word, uint32_t value) = 0;
  virtual absl::Status WriteValue(uint32_t* word, uint32_t value) = 0;
  // Writes `value` into *word now, beside the daemon's stream: releases a WaitValue whose
  // writer died (the stream would otherwise wait for ever). Best effort.
  virtual void ReleaseValue(uint32_t* word, uint32_t value) = 0;
  // Synchronous copies between host memory and device memory (IPC mappings included).
  virtual absl::Status CopyDeviceToHost(void* host, const void* device, size_t bytes) = 0;
  virtual absl::Status CopyHostToDevice(void* device, const void* host, size_t bytes) = 0;
  // Waits for all queued device work.
  virtual absl::Status Synchronize() = 0;
  // A clean pair of fault words for one sequence (device_fault_words.h), held until
  // ReleaseFaultWords; RESOURCE_EXHAUSTED / INTERNAL if the memory for more cannot be had.
  // A released pair goes to a later sequence under a new owner number, so writes of
  // kernels still queued for the earlier owner never count for the new one.
  virtual absl::StatusOr<DeviceFaultWords> AcquireFaultWords() = 0;
  virtual void ReleaseFaultWords(const DeviceFaultWords& words) = 0;
};

// The backend's device runtime, or FAILED_PRECONDITION saying that CUDA IPC and NCCL
// payloads need backend: cuda.
absl::StatusOr<DeviceRuntime*> RequireDevice(Backend& backend);

}  // namespace kvcd
