#include "server/dataplane/tensor_resolver.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/backends/device_runtime.h"

namespace kvcd {

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
  KVCD_RETURN_IF_ERROR(buffers_->WaitReady(b.region));
  b.data = reinterpret_cast<const char*>(b.region.ptr);
  b.on_device = true;
  return b;
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
  if (wait_ready) KVCD_RETURN_IF_ERROR(buffers_->WaitReady(r));
  return r;
}

}  // namespace kvcd
