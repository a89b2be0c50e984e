// TransformDeviceCodec: a version-3 codec (KeyTransformProfile) in device memory for the
// CUDA int2-transform format: per (layer, KV head) the profile's tensors and the tables the
// kernels derive from them (kernels::cuda::BuildTransformCodecImage), and the array of
// kernels::cuda::TransformHeadCodec views with device pointers ([layer][kv head], in device
// memory: the row store takes every layer of a Put in one launch). CUDA builds only.
//
// Thread safety: immutable after Upload; may be shared.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/key_transform_profile.h"
#include "kvcd/kernels/cuda_transform.h"

namespace kvcd {

class TransformDeviceCodec {
 public:
  // Uploads every head of p (waits for the copy). RESOURCE_EXHAUSTED when device memory runs
  // out, INTERNAL on another CUDA error.
  static absl::StatusOr<std::shared_ptr<const TransformDeviceCodec>> Upload(
      const KeyTransformProfile& p);
  ~TransformDeviceCodec();
  TransformDeviceCodec(const TransformDeviceCodec&) = delete;
  TransformDeviceCodec& operator=(const TransformDeviceCodec&) = delete;

  // [num_layers][num_kv_heads] head codecs (device); layer l starts at heads(l).
  const kernels::cuda::TransformHeadCodec* heads(int layer) const {
    return device_heads_ + static_cast<int64_t>(layer) * num_kv_heads_;
  }
  size_t bytes() const { return bytes_; }

 private:
  TransformDeviceCodec() = default;
  void* memory_ = nullptr;
  size_t bytes_ = 0;
  int num_kv_heads_ = 0;
  const kernels::cuda::TransformHeadCodec* device_heads_ = nullptr;
};

}  // namespace kvcd
