// Default data-plane answers of a backend without device memory (the CPU backend).
#include "server/backends/backend.h"

#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

absl::Status NoDevice(const Backend& b) {
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA IPC and NCCL payloads need a daemon with backend: cuda; this daemon runs backend: ",
      b.name(), "; send inline_data (inline_pages) instead"));
}

}  // namespace

absl::Status Backend::DataPlaneAvailable() const { return NoDevice(*this); }
absl::StatusOr<void*> Backend::OpenIpcBuffer(const std::string&) { return NoDevice(*this); }
void Backend::CloseIpcBuffer(void*) {}
absl::StatusOr<void*> Backend::OpenIpcEvent(const std::string&) { return NoDevice(*this); }
absl::StatusOr<void*> Backend::CreateIpcEvent(std::string*) { return NoDevice(*this); }
void Backend::DestroyEvent(void*) {}
absl::Status Backend::WaitEvent(void*) { return NoDevice(*this); }
absl::Status Backend::RecordEvent(void*) { return NoDevice(*this); }
absl::Status Backend::CopyDeviceToHost(void*, const void*, size_t) { return NoDevice(*this); }
absl::Status Backend::CopyHostToDevice(void*, const void*, size_t) { return NoDevice(*this); }
absl::Status Backend::CopySpans(const std::vector<DeviceSpan>&, uint64_t*) {
  return NoDevice(*this);
}
absl::Status Backend::StoreRows(const std::vector<RowStoreJob>&, int, bool) {
  return NoDevice(*this);
}
absl::Status Backend::Synchronize() { return absl::OkStatus(); }

}  // namespace kvcd
