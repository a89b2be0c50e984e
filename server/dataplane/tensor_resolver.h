// TensorResolver: where the bytes of a request's TensorRef are. Inline data is host memory;
// a cuda_ipc payload names a region of a registered worker buffer, which is checked,
// ordered after the worker's ready event and handed on as device memory so that the data
// stays on the GPU; nccl payloads are received by NcclLinks.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcd/v1/kvcache.pb.h"
#include "server/backends/backend.h"
#include "server/dataplane/buffer_registry.h"

namespace kvcd {

// What a request field must be: its name, shape and dtypes, the payload kinds it may
// come as, and what the daemon does with its bytes.
struct TensorSpec {
  enum class DTypes { kBf16OrF32, kF32, kU8 };
  enum class Access {
    kRead,       // an input: a cuda_ipc region is ordered after the worker's ready event
    kWrite,      // an output the daemon writes (o_out, lse_out)
    kOverwrite,  // an output whose older bytes the worker may still read: waits for ready
  };
  absl::string_view field;
  std::vector<int64_t> shape;
  DTypes dtypes = DTypes::kBf16OrF32;
  int kinds = 1;  // TensorResolver::Kind bits
  Access access = Access::kRead;
  // Set for a tensor whose shape is only known once its payload kind is accepted (a fetch
  // destination is as large as the stored pages; pushed pages as the pages they hold): it
  // is asked for after the payload check, and its error is the answer.
  std::function<absl::StatusOr<std::vector<int64_t>>()> shape_after_payload;
  // Host bytes of a BF16/F32 input are scanned for NaN/±Inf (the first bad element is
  // named; nothing was stored). Device bytes are checked by the kernels that read them
  // (cuda_store_rows.h StoreCheck, cuda_device_copy.h LaunchQueriesToFloat).
  bool scan_host = false;
  // With it, an input's device bytes are copied here and handed on as host bytes.
  std::string* host_staging = nullptr;
  // Set for V beside K: the two share one dtype (INVALID_ARGUMENT "v.dtype is X, expected
  // the dtype of k (Y)" after both shapes are checked).
  const v1::TensorRef* same_dtype_as = nullptr;
  absl::string_view same_dtype_field;
};

class TensorResolver {
 public:
  // Payload kinds a TensorRef field accepts (bit set).
  enum Kind : int { kInline = 1, kIpc = 2, kNccl = 4 };

  TensorResolver(Backend* backend, BufferRegistry* buffers)
      : backend_(backend), buffers_(buffers) {}

  // Where a resolved tensor's bytes are: inline data (host), a cuda_ipc region (device,
  // or copied to the spec's host_staging), or neither for an nccl payload (NcclLinks
  // moves those bytes; `nccl_communicator` names the link).
  struct Bytes {
    const char* data = nullptr;
    bool on_device = false;
    BufferRegistry::Region region;  // cuda_ipc only
    uint64_t nccl_communicator = 0;
    bool is_nccl = false;
  };
  // The one call per tensor: checks `t` against `spec` (dtype, shape, payload size as
  // CheckTensorRef; INVALID_ARGUMENT for a payload kind the field does not accept,
  // FAILED_PRECONDITION for a device payload on a backend without device memory) and
  // resolves where its bytes are, scanning or staging them as the spec says.
  absl::StatusOr<Bytes> Resolve(const v1::TensorRef& t, const TensorSpec& spec);
  // The same for the tensors of one request that travel together (K and V; o_out and
  // lse_out), in one call: every shape first, then every payload kind, then where each
  // one's bytes are, so that the first error a request gets does not depend on how its
  // tensors are resolved. out[i] receives the bytes of items[i].
  struct Item {
    const v1::TensorRef* ref;
    const TensorSpec* spec;
    Bytes* out;
  };
  absl::Status ResolveAll(absl::Span<const Item> items);

  // Records the region's buffer's done event after the writes queued so far (or, inside a
  // SignalScope naming its buffer, writes the done word once).
  absl::Status MarkWritten(const BufferRegistry::Region& r);

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

  // While one is alive on a thread (a decode channel's call whose worker set device signal
  // words, decode_channel_layout.h), the resolutions on that thread order buffer `buffer_id`
  // through its signal words at `offset` instead of its events: one wait until the ready
  // word >= value before the first read of that buffer, one write of value into the done
  // word at the first MarkWritten on it. If the call waited but wrote nothing (it failed),
  // the scope's end writes the done word, so that the worker's stream is never left waiting
  // on a call that answered. Does not nest.
  class SignalScope {
   public:
    SignalScope(BufferRegistry* buffers, uint64_t buffer_id, uint64_t offset, uint32_t value);
    ~SignalScope();
    SignalScope(const SignalScope&) = delete;
    SignalScope& operator=(const SignalScope&) = delete;

   private:
    BufferRegistry* const buffers_;
  };

 private:
  absl::Status CheckPayload(const v1::TensorRef& t, absl::string_view field, int kinds) const;
  absl::Status CheckShape(const v1::TensorRef& t, const TensorSpec& spec) const;
  absl::StatusOr<Bytes> Locate(const v1::TensorRef& t, const TensorSpec& spec);
  absl::Status CheckFinite(const Bytes& b, const v1::TensorRef& t, absl::string_view field) const;
  // Waits for r's ready event unless this thread's CallScope already did.
  absl::Status WaitReadyOnce(const BufferRegistry::Region& r);

  Backend* const backend_;
  BufferRegistry* const buffers_;
};

}  // namespace kvcd
