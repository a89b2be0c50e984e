#include "server/backends/backend.h"

#include "absl/strings/str_cat.h"
#include "server/backends/device_runtime.h"

namespace kvcd {

absl::StatusOr<DeviceRuntime*> RequireDevice(Backend& backend) {
  if (DeviceRuntime* d = backend.device(); d != nullptr) return d;
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA IPC and NCCL payloads need a daemon with backend: cuda; this daemon runs backend: ",
      backend.name(), "; send inline_data (inline_pages) instead"));
}

}  // namespace kvcd
