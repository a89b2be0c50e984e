#include "server/formats/cuda_codec.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

namespace kc = kernels::cuda;

DeviceScratch::~DeviceScratch() {
  if (ptr_ != nullptr) (void)kc::Free(ptr_);
}

absl::StatusOr<uint8_t*> DeviceScratch::Reserve(size_t bytes) {
  if (bytes <= size_) return static_cast<uint8_t*>(ptr_);
  // Work queued on the old buffer must finish before it is freed.
  if (ptr_ != nullptr) {
    (void)kc::Synchronize();
    (void)kc::Free(ptr_);
  }
  ptr_ = nullptr;
  size_ = 0;
  const size_t want = std::max(bytes, size_ * 2);
  if (absl::Status s =
          KernelStatus(kc::Malloc(&ptr_, want), absl::StatusCode::kResourceExhausted,
                       absl::StrCat("cannot allocate ", want, " bytes of device scratch"));
      !s.ok()) {
    return s;
  }
  size_ = want;
  ++generation_;
  return static_cast<uint8_t*>(ptr_);
}

PinnedUploader::~PinnedUploader() {
  for (Slot& s : slots_) {
    if (s.used) (void)kc::EventSynchronize(s.event);
    if (s.host != nullptr) (void)kc::HostFree(s.host);
    if (s.event != nullptr) (void)kc::DestroyEvent(s.event);
  }
}

absl::Status PinnedUploader::Upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  Slot& slot = slots_[next_];
  next_ = (next_ + 1) % (sizeof(slots_) / sizeof(slots_[0]));
  if (slot.used) KVCD_RETURN_IF_ERROR(CudaStatus(kc::EventSynchronize(slot.event), "upload"));
  if (slot.event == nullptr)
    KVCD_RETURN_IF_ERROR(CudaStatus(kc::CreateEvent(&slot.event), "upload"));
  if (slot.bytes < bytes) {
    if (slot.host != nullptr) KVCD_RETURN_IF_ERROR(CudaStatus(kc::HostFree(slot.host), "upload"));
    slot.host = nullptr;
    slot.bytes = 0;
    const size_t want = std::max<size_t>(bytes, 64 << 10);
    KVCD_RETURN_IF_ERROR(CudaStatus(kc::HostAlloc(&slot.host, want), "upload"));
    slot.bytes = want;
  }
  std::memcpy(slot.host, src, bytes);
  KVCD_RETURN_IF_ERROR(CudaStatus(kc::CopyToDeviceAsync(dst, slot.host, bytes), "upload"));
  KVCD_RETURN_IF_ERROR(CudaStatus(kc::RecordEvent(slot.event), "upload"));
  slot.used = true;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const CudaCodec>> CudaCodec::Upload(const CodecProfile& codec) {
  const int layers = codec.num_layers(), d = codec.head_dim();
  const size_t m = static_cast<size_t>(d) * d;
  std::vector<float> host(3 * m * layers + 2 * static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    std::copy(codec.RK(l), codec.RK(l) + m, host.begin() + l * m);
    std::copy(codec.RV(l), codec.RV(l) + m, host.begin() + (layers + l) * m);
    std::copy(codec.RVT(l), codec.RVT(l) + m, host.begin() + (2 * layers + l) * m);
    host[3 * m * layers + l] = codec.RhoK(l);
    host[3 * m * layers + layers + l] = codec.RhoV(l);
  }
  // Which rotations the INT2 stores apply by butterflies (RowCodec::hadamard_k / _v).
  std::vector<uint8_t> hadamard(2 * static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    hadamard[l] = codec.KindK(l) == kernels::Rotation::kHadamard;
    hadamard[layers + l] = codec.KindV(l) == kernels::Rotation::kHadamard;
  }
  std::shared_ptr<CudaCodec> c(new CudaCodec());
  c->head_dim_ = d;
  const size_t float_bytes = host.size() * sizeof(float);
  const size_t bytes = float_bytes + hadamard.size();
  if (auto s = CudaStatus(kc::Malloc(&c->memory_, bytes), "codec upload"); !s.ok()) return s;
  if (auto s = CudaStatus(kc::CopyToDevice(c->memory_, host.data(), float_bytes), "codec upload");
      !s.ok()) {
    return s;
  }
  auto* flags = static_cast<uint8_t*>(c->memory_) + float_bytes;
  if (auto s =
          CudaStatus(kc::CopyToDevice(flags, hadamard.data(), hadamard.size()), "codec upload");
      !s.ok()) {
    return s;
  }
  c->hadamard_k_ = flags;
  c->hadamard_v_ = flags + layers;
  auto* f = static_cast<float*>(c->memory_);
  c->r_k_ = f;
  c->r_v_ = f + m * layers;
  c->r_v_t_ = f + 2 * m * layers;
  c->rho_k_ = f + 3 * m * layers;
  c->rho_v_ = c->rho_k_ + layers;
  return std::shared_ptr<const CudaCodec>(std::move(c));
}

CudaCodec::~CudaCodec() {
  if (memory_ != nullptr) (void)kc::Free(memory_);
}

}  // namespace kvcd
