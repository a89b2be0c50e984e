// BufferRegistry: the worker device buffers registered for CUDA IPC (RegisterBuffer).
//
// Each entry owns the daemon's mapping of the worker's allocation (opened once), the
// worker's ready event (opened once; device work waits on it before reading the buffer)
// and the daemon's done event (recorded after every write into the buffer). Entries go
// away on Unregister, on lease expiry (a dead worker stops renewing) and with the daemon;
// a region in use keeps its entry alive until the call finishes, and the mapping is closed
// only after the device has drained the work queued on it.
//
// Buffer ids are random 64-bit values (common/random_id.h): unguessable, and an id handed
// out by an earlier daemon process is NOT_FOUND rather than someone else's buffer.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/backends/backend.h"
#include "server/backends/device_runtime.h"

namespace kvcd {

class BufferRegistry {
 public:
  struct Buffer {
    explicit Buffer(DeviceRuntime* d) : device(d) {}
    ~Buffer();
    DeviceRuntime* const device;
    uint64_t id = 0;
    std::string name;
    uint8_t* base = nullptr;  // daemon-side mapping of the worker's allocation
    uint64_t size = 0;
    void* ready_event = nullptr;  // worker's, may be null
    void* done_event = nullptr;   // daemon's
    // The last device signal wait queued on this buffer (WaitSignal): its ready word and
    // value, released when the entry goes away so that a worker that died before writing it
    // cannot leave the daemon's stream waiting for ever.
    std::atomic<uint32_t*> signal_word{nullptr};
    std::atomic<uint32_t> signal_value{0};
    std::atomic<int64_t> lease_ms{0};
    std::atomic<int64_t> deadline_ns{0};
  };
  // A resolved region: bytes [ptr, ptr + size) of a live buffer.
  struct Region {
    std::shared_ptr<Buffer> buffer;
    uint8_t* ptr = nullptr;
    uint64_t size = 0;
  };

  explicit BufferRegistry(Backend* backend);

  // Opens the handles; INVALID_ARGUMENT for malformed handles or sizes, FAILED_PRECONDITION
  // on a backend without device memory, RESOURCE_EXHAUSTED past max_buffers.
  // *done_handle receives the IPC handle of the buffer's done event.
  absl::StatusOr<std::shared_ptr<Buffer>> Register(const v1::RegisterBufferRequest& req,
                                                   int64_t lease_ms, int max_buffers,
                                                   std::string* done_handle);
  absl::Status Unregister(uint64_t id);
  absl::StatusOr<std::shared_ptr<Buffer>> Find(uint64_t id);

  // Checks a cuda_ipc region of `field` against its buffer (bounds, 16-byte alignment),
  // renews the buffer's lease and returns the mapped bytes.
  absl::StatusOr<Region> Resolve(const v1::CudaIpcRegion& r, absl::string_view field);
  // Queues a wait for the worker's ready event of the region's buffer (no-op without one).
  absl::Status WaitReady(const Region& r);
  // Records the buffer's done event after the writes queued so far.
  absl::Status MarkWritten(const Region& r);
  // The same two orderings through the device signal words at byte `offset` of the region's
  // buffer (decode_channel_layout.h: the ready word, then the done word) instead of its
  // events: WaitSignal queues a wait until ready >= value, WriteSignal writes value into done
  // after the work queued so far. INVALID_ARGUMENT when the 8 bytes are not inside the buffer
  // at a multiple of 8.
  absl::Status WaitSignal(const Region& r, uint64_t offset, uint32_t value);
  absl::Status WriteSignal(const Region& r, uint64_t offset, uint32_t value);

  // Drops every buffer whose lease ended before now_ns; returns how many.
  int ExpireLeases(int64_t now_ns);
  int64_t size() const;

 private:
  Backend* const backend_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Buffer>> buffers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcd
