// FsqDeviceCodec: an FSQ model's codec in device memory, shared by the model's two CUDA FSQ
// formats: every layer's tensors (F32, the layouts of kvcd/kernels/fsq.h), the per-layer
// kernel views with device pointers (one array of them in device memory for the encoder,
// which takes all layers of a Put in one launch), and each layer's key decoder prepared for
// the attention kernel variant it serves (cuda_fsq_i8.h LaunchFsqPrepareDecoder). CUDA
// builds only.
//
// Thread safety: immutable after Upload; may be shared.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvcd/kernels/cuda_fsq_encode_tc.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/fsq.h"
#include "server/formats/fsq/fsq_format.h"

namespace kvcd {

// Which device encoder computes an FSQ model's codes (KVCD_FSQ_ENCODER, docs/operating.md;
// for a tensor-core one FsqDeviceCodec also holds every layer's encoder prepared for it,
// back to back, PreparedEncoders):
// the float64 encoder, bit-identical to the CPU's (cuda_fsq.h), or the tensor-core encoder
// with BF16, FP16 or split-BF16 operands (cuda_fsq_encode_tc.h), whose codes differ from
// the CPU's only within FsqEncodeTcBound of a rounding threshold.
enum class FsqDeviceEncoder { kExact, kTcBf16, kTcFp16, kTcSplit };

// KVCD_FSQ_ENCODER: "exact", "tc" (BF16), "tc-fp16" or "tc-split"; unset: the default
// (fsq_device_codec.cc). Another value is reported and ignored.
FsqDeviceEncoder FsqDeviceEncoderFromEnv();

class FsqDeviceCodec {
 public:
  // Uploads every layer of m and prepares the key decoders for key_kernel's attention
  // (waits for the device). RESOURCE_EXHAUSTED when device memory runs out, INTERNAL on
  // another CUDA error.
  static absl::StatusOr<std::shared_ptr<const FsqDeviceCodec>> Upload(
      const FsqModelCodec& m, kernels::cuda::FsqKeyKernel key_kernel);
  ~FsqDeviceCodec();
  FsqDeviceCodec(const FsqDeviceCodec&) = delete;
  FsqDeviceCodec& operator=(const FsqDeviceCodec&) = delete;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  // Layer l with device pointers (host struct).
  const kernels::FsqLayerCodec& Layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  // [num_layers] the same structs in device memory.
  const kernels::FsqLayerCodec* device_layers() const { return device_layers_; }
  // Layer l's prepared key decoder (device), for key_kernel().
  const void* Prepared(int l) const { return prepared_[static_cast<size_t>(l)]; }
  kernels::cuda::FsqKeyKernel key_kernel() const { return key_kernel_; }
  const kernels::RopeSpec& rope() const { return rope_; }
  FsqDeviceEncoder encoder() const { return encoder_; }
  // The tensor-core encoders' operands (encoder() not kExact).
  kernels::FsqTcOperands tc_operands() const {
    return encoder_ == FsqDeviceEncoder::kTcSplit  ? kernels::FsqTcOperands::kBf16Split
           : encoder_ == FsqDeviceEncoder::kTcFp16 ? kernels::FsqTcOperands::kFp16
                                                   : kernels::FsqTcOperands::kBf16;
  }
  // Layer l's prepared encoder, the later layers' following it (encoder() not kExact).
  const void* PreparedEncoders(int l) const {
    return static_cast<const uint8_t*>(prepared_encoders_) +
           static_cast<size_t>(l) * encoder_bytes_;
  }

 private:
  FsqDeviceCodec() = default;
  void* memory_ = nullptr;
  std::vector<kernels::FsqLayerCodec> layers_;
  std::vector<const void*> prepared_;
  const kernels::FsqLayerCodec* device_layers_ = nullptr;
  FsqDeviceEncoder encoder_ = FsqDeviceEncoder::kExact;  // FsqDeviceEncoderFromEnv()
  const void* prepared_encoders_ = nullptr;  // tensor-core encoders: every layer's, in turn
  size_t encoder_bytes_ = 0;
  kernels::RopeSpec rope_;
  kernels::cuda::FsqKeyKernel key_kernel_ = kernels::cuda::FsqKeyKernel::kFp16;
};

}  // namespace kvcd
