#include "server/dataplane/tensor_resolver.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/finite_check.h"
#include "server/backends/device_runtime.h"

namespace kvcd {
namespace {

// The ready events this thread waited for inside its outermost CallScope.
struct CallWaits {
  int depth = 0;
  int n = 0;
  const void* events[8] = {};
};
thread_local CallWaits call_waits;

}  // namespace

TensorResolver::CallScope::CallScope() { ++call_waits.depth; }

TensorResolver::CallScope::~CallScope() {
  if (--call_waits.depth == 0) call_waits.n = 0;
}

absl::Status TensorResolver::WaitReadyOnce(const BufferRegistry::Region& r) {
  const void* e = r.buffer->ready_event;
  if (e == nullptr) return absl::OkStatus();
  CallWaits& w = call_waits;
  if (w.depth > 0) {
    for (int i = 0; i < w.n; ++i) {
      if (w.events[i] == e) return absl::OkStatus();
    }
  }
  KVCD_RETURN_IF_ERROR(buffers_->WaitReady(r));
  if (w.depth > 0 && w.n < static_cast<int>(sizeof(w.events) / sizeof(w.events[0]))) {
    w.events[w.n++] = e;
  }
  return absl::OkStatus();
}

absl::Status TensorResolver::CheckPayload(const v1::TensorRef& t, absl::string_view field,
                                          int kinds) const {
  const char* name = "inline_data";
  int kind = kInline;
  if (t.payload_case() == v1::TensorRef::kCudaIpc) {
    name = "cuda_ipc";
    kind = kIpc;
  } else if (t.payload_case() == v1::TensorRef::kNccl) {
    name = "nccl";
    kind = kNccl;
  }
  if ((kinds & kind) == 0) {
    std::vector<std::string> want;
    if (kinds & kInline) want.push_back("inline_data");
    if (kinds & kIpc) want.push_back("cuda_ipc");
    if (kinds & kNccl) want.push_back("nccl");
    return absl::InvalidArgumentError(absl::StrCat(field, " carries ", name,
                                                   ", which this field does not accept; expected ",
                                                   absl::StrJoin(want, " or ")));
  }
  if (kind != kInline) {
    absl::Status s = RequireDevice(*backend_).status();
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorResolver::Bytes> TensorResolver::Input(const v1::TensorRef& t,
                                                            absl::string_view field) {
  Bytes b;
  if (t.payload_case() != v1::TensorRef::kCudaIpc) {
    b.data = t.inline_data().data();
    return b;
  }
  KVCD_ASSIGN_OR_RETURN(b.region, buffers_->Resolve(t.cuda_ipc(), field));
  KVCD_RETURN_IF_ERROR(WaitReadyOnce(b.region));
  b.data = reinterpret_cast<const char*>(b.region.ptr);
  b.on_device = true;
  return b;
}

absl::Status TensorResolver::CheckFinite(const Bytes& b, const v1::TensorRef& t,
                                         absl::string_view field) const {
  if (t.dtype() != v1::DTYPE_BF16 && t.dtype() != v1::DTYPE_F32) return absl::OkStatus();
  const bool bf16 = t.dtype() == v1::DTYPE_BF16;
  int64_t count = 1;
  for (int64_t d : t.shape()) count *= d;  // checked by CheckTensorRef: no overflow
  if (count <= 0) return absl::OkStatus();
  if (b.on_device) {  // checked by the kernels that read them (cuda_store_rows.h StoreCheck)
    return absl::InternalError(absl::StrCat(field, ": device bytes are not scanned on the host"));
  }
  const int64_t i = kernels::FirstNonFinite(b.data, count, bf16);
  if (i < 0) return absl::OkStatus();
  float x;
  if (bf16) {
    uint16_t h;
    std::memcpy(&h, b.data + 2 * i, 2);
    x = kernels::Bf16ToFloat(h);
  } else {
    std::memcpy(&x, b.data + 4 * i, 4);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] (flat index of ", count, " ",
                                                 bf16 ? "BF16" : "F32", " values) is ",
                                                 std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"),
                                                 "; expected finite values (nothing was stored)"));
}

absl::StatusOr<const char*> TensorResolver::HostInput(const v1::TensorRef& t,
                                                      absl::string_view field,
                                                      std::string* staging) {
  KVCD_ASSIGN_OR_RETURN(Bytes b, Input(t, field));
  if (!b.on_device) return b.data;
  KVCD_ASSIGN_OR_RETURN(DeviceRuntime * device, RequireDevice(*backend_));
  staging->resize(b.region.size);
  KVCD_RETURN_IF_ERROR(device->CopyDeviceToHost(staging->data(), b.region.ptr, b.region.size));
  return static_cast<const char*>(staging->data());
}

absl::StatusOr<BufferRegistry::Region> TensorResolver::Output(const v1::TensorRef& t,
                                                              absl::string_view field,
                                                              bool wait_ready) {
  KVCD_ASSIGN_OR_RETURN(BufferRegistry::Region r, buffers_->Resolve(t.cuda_ipc(), field));
  if (wait_ready) KVCD_RETURN_IF_ERROR(WaitReadyOnce(r));
  return r;
}

}  // namespace kvcd
