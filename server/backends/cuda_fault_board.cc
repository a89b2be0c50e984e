#include "server/backends/cuda_fault_board.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "server/formats/kernel_status.h"

namespace kvcd {

namespace kc = kernels::cuda;

CudaFaultBoard::~CudaFaultBoard() {
  for (const Chunk& c : chunks_) {
    (void)kc::HostFree(c.host);
    (void)kc::Free(c.device);
  }
}

absl::Status CudaFaultBoard::GrowLocked() {
  constexpr size_t kBytes = sizeof(uint64_t) * kChunkWords;
  Chunk c;
  void* host = nullptr;
  void* view = nullptr;
  KVCD_RETURN_IF_ERROR(
      KernelStatus(kc::HostAllocMapped(&host, &view, kBytes), absl::StatusCode::kResourceExhausted,
                   "cannot allocate mapped pinned memory for sequence fault words"));
  std::memset(host, 0, kBytes);
  void* dev = nullptr;
  kernels::Error e = kc::Malloc(&dev, kBytes);
  if (e.ok()) {
    const std::vector<uint64_t> zeros(kChunkWords, 0);
    e = kc::CopyToDevice(dev, zeros.data(), kBytes);
    if (!e.ok()) (void)kc::Free(dev);
  }
  if (!e.ok()) {
    (void)kc::HostFree(host);
    return KernelStatus(e, absl::StatusCode::kResourceExhausted,
                        "cannot allocate device memory for sequence fault words");
  }
  c.host = static_cast<uint64_t*>(host);
  c.host_view = static_cast<unsigned long long*>(view);
  c.device = static_cast<unsigned long long*>(dev);
  const int64_t base = static_cast<int64_t>(chunks_.size()) * kChunkWords;
  chunks_.push_back(c);
  for (int64_t i = kChunkWords - 1; i >= 0; --i) free_.push_back(base + i);
  return absl::OkStatus();
}

absl::StatusOr<DeviceFaultWords> CudaFaultBoard::Acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    if (absl::Status s = GrowLocked(); !s.ok()) return s;
  }
  const int64_t slot = free_.back();
  free_.pop_back();
  const Chunk& c = chunks_[static_cast<size_t>(slot / kChunkWords)];
  const int64_t i = slot % kChunkWords;
  DeviceFaultWords w;
  w.slot = slot;
  w.host = c.host + i;
  w.target.host_word = c.host_view + i;
  w.target.device_word = c.device + i;
  w.target.tag = kernels::FaultTag(next_owner_++, 0);
  return w;
}

void CudaFaultBoard::Release(const DeviceFaultWords& words) {
  if (!words.held()) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(words.slot);
}

}  // namespace kvcd
