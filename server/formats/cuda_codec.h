// CudaCodec: a model's rotations and clip ratios in device memory, shared by the model's
// CUDA formats (row stores rotate with R_k / R_v, attention uses R_k and R_v^T), and the
// device scratch the CUDA formats stage request bytes and page tables in. CUDA builds only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "common/codec_profile.h"
#include "server/formats/kernel_status.h"

namespace kvcd {

// Device memory that only grows; one user at a time (callers hold their own lock).
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch();
  absl::StatusOr<uint8_t*> Reserve(size_t bytes);
  // Counts the allocations: contents cached in the scratch are lost when it changes.
  uint64_t generation() const { return generation_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
  uint64_t generation_ = 0;
};

// Uploads small host arrays (page tables, slot lists) to device memory without blocking the
// host: each goes through a ring of pinned buffers and an asynchronous copy on the daemon's
// stream; a buffer is reused once the copy that read it is done. One user at a time.
class PinnedUploader {
 public:
  PinnedUploader() = default;
  PinnedUploader(const PinnedUploader&) = delete;
  PinnedUploader& operator=(const PinnedUploader&) = delete;
  ~PinnedUploader();
  // Queues dst[0, bytes) = src[0, bytes) on the stream.
  absl::Status Upload(void* dst, const void* src, size_t bytes);

 private:
  struct Slot {
    void* host = nullptr;
    size_t bytes = 0;
    void* event = nullptr;
    bool used = false;
  };
  Slot slots_[8];
  size_t next_ = 0;
};

class CudaCodec {
 public:
  // Uploads every layer of `codec`.
  static absl::StatusOr<std::shared_ptr<const CudaCodec>> Upload(const CodecProfile& codec);
  ~CudaCodec();
  CudaCodec(const CudaCodec&) = delete;
  CudaCodec& operator=(const CudaCodec&) = delete;

  int64_t matrix_elems() const { return int64_t{head_dim_} * head_dim_; }
  // [layers][d][d] each; layer l at + l * matrix_elems().
  const float* r_k() const { return r_k_; }
  const float* r_v() const { return r_v_; }
  const float* r_v_t() const { return r_v_t_; }
  const float* RK(int layer) const { return r_k_ + layer * matrix_elems(); }
  const float* RVT(int layer) const { return r_v_t_ + layer * matrix_elems(); }
  // [layers] clip ratios.
  const float* rho_k() const { return rho_k_; }
  const float* rho_v() const { return rho_v_; }
  // [layers] nonzero where the layer's rotation is c·H (kernels::ClassifyRotation).
  const uint8_t* hadamard_k() const { return hadamard_k_; }
  const uint8_t* hadamard_v() const { return hadamard_v_; }

 private:
  CudaCodec() = default;
  int32_t head_dim_ = 0;
  void* memory_ = nullptr;
  float* r_k_ = nullptr;
  float* r_v_ = nullptr;
  float* r_v_t_ = nullptr;
  float* rho_k_ = nullptr;
  float* rho_v_ = nullptr;
  uint8_t* hadamard_k_ = nullptr;
  uint8_t* hadamard_v_ = nullptr;
};

}  // namespace kvcd
