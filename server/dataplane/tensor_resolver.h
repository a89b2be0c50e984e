// TensorResolver: where the bytes of a request's TensorRef are. Inline data is host memory;
// a cuda_ipc payload names a region of a registered worker buffer, which is checked,
// ordered after the worker's ready event and handed on as device memory so that the data
// stays on the GPU; nccl payloads are received by NcclLinks.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/backends/backend.h"
#include "server/dataplane/buffer_registry.h"

namespace kvcd {

class TensorResolver {
 public:
  // Payload kinds a TensorRef field accepts (bit set).
  enum Kind : int { kInline = 1, kIpc = 2, kNccl = 4 };

  TensorResolver(Backend* backend, BufferRegistry* buffers)
      : backend_(backend), buffers_(buffers) {}

  // INVALID_ARGUMENT for a payload kind the field does not accept, FAILED_PRECONDITION for
  // a device payload on a backend without device memory.
  absl::Status CheckPayload(const v1::TensorRef& t, absl::string_view field, int kinds) const;

  struct Bytes {
    const char* data = nullptr;
    bool on_device = false;
    BufferRegistry::Region region;  // cuda_ipc only
  };
  // An input tensor's bytes where they are: its inline data, or its cuda_ipc region after
  // the daemon's stream waits for the buffer's ready event.
  absl::StatusOr<Bytes> Input(const v1::TensorRef& t, absl::string_view field);
  // INVALID_ARGUMENT if a value of a BF16 or F32 input (its shape already checked) in host
  // memory is NaN or ±Inf (the message names the first bad element); other dtypes pass.
  // Device bytes are not scanned here (INTERNAL): the kernels that read them check them
  // (cuda_store_rows.h StoreCheck, cuda_device_copy.h LaunchQueriesToFloat).
  absl::Status CheckFinite(const Bytes& b, const v1::TensorRef& t, absl::string_view field) const;
  // An input tensor's bytes in host memory: inline data, or its region copied into *staging.
  absl::StatusOr<const char*> HostInput(const v1::TensorRef& t, absl::string_view field,
                                        std::string* staging);
  // A cuda_ipc region the daemon writes (results, fetched pages); with wait_ready, later
  // device work also waits for the worker's ready event (the worker may still read the
  // region's previous contents).
  absl::StatusOr<BufferRegistry::Region> Output(const v1::TensorRef& t, absl::string_view field,
                                                bool wait_ready);
  // Records the region's buffer's done event after the writes queued so far.
  absl::Status MarkWritten(const BufferRegistry::Region& r) { return buffers_->MarkWritten(r); }

  // While one is alive on a thread, the resolutions on that thread wait for each buffer's
  // ready event once: the inputs of one request (q, k_new, v_new) usually share the worker's
  // buffer, whose event the worker records once per request, so a second stream wait on it
  // within the same call orders nothing more and only costs a CUDA API call. Nests; the
  // outermost scope's end forgets the waits. Not for work that spans requests.
  class CallScope {
   public:
    CallScope();
    ~CallScope();
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
  };

 private:
  // Waits for r's ready event unless this thread's CallScope already did.
  absl::Status WaitReadyOnce(const BufferRegistry::Region& r);

  Backend* const backend_;
  BufferRegistry* const buffers_;
};

}  // namespace kvcd
