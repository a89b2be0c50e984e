// CodecProfile: the per-layer rotations (R_k, R_v, FP32 d x d) and clip ratios of a
// model whose history is stored as OSCAR INT2.
//
// Codec file (safetensors; docs/formats.md "Codec files"):
//   layers.<l>.r_k   F32 [head_dim, head_dim]   key rotation of layer l (rows x·R)
//   layers.<l>.r_v   F32 [head_dim, head_dim]   value rotation of layer l
//   layers.<l>.rho_k F32 [] or [1] (optional)   key clip quantile (default 0.96)
//   layers.<l>.rho_v F32 [] or [1] (optional)   value clip quantile (default 0.92)
// Every rotation must be orthogonal (max |R R^T - I| <= 1e-3). Files with more layers than
// the model, or with metadata kvcd.codec_version other than "1" (version 2: one rotation
// per KV head, written by kvcd-calibrate --per-head; version 3: transform-coded keys,
// common/key_transform_profile.h; both read by the tools only), are rejected.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

class CodecProfile {
 public:
  // Naive INT2 (R = I) / data-free Hadamard rotation on every layer.
  static CodecProfile Identity(int num_layers, int head_dim);
  static CodecProfile Hadamard(int num_layers, int head_dim);
  // Loads a codec file; INVALID_ARGUMENT naming the tensor when a shape, dtype, ratio or
  // orthogonality check fails.
  static absl::StatusOr<CodecProfile> FromSafetensors(const SafetensorsFile& file, int num_layers,
                                                      int head_dim, const std::string& description);

  const float* RK(int layer) const { return layers_[layer].r_k.data(); }
  const float* RV(int layer) const { return layers_[layer].r_v.data(); }
  // Transposes (= inverses): un-rotating a row y is y · R^T = RotateRows(y, R^T).
  const float* RKT(int layer) const { return layers_[layer].r_k_t.data(); }
  const float* RVT(int layer) const { return layers_[layer].r_v_t.data(); }
  // kernels::ClassifyRotation of RK / RV, computed once (kHadamard: applied as butterflies).
  kernels::Rotation KindK(int layer) const { return layers_[layer].kind_k; }
  kernels::Rotation KindV(int layer) const { return layers_[layer].kind_v; }
  float RhoK(int layer) const { return layers_[layer].rho_k; }
  float RhoV(int layer) const { return layers_[layer].rho_v; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  int head_dim() const { return head_dim_; }
  const std::string& description() const { return description_; }
  void set_description(std::string d) { description_ = std::move(d); }

  // Writes this profile in the codec-file layout.
  SafetensorsWriter ToSafetensors() const;

 private:
  struct Layer {
    std::vector<float> r_k, r_v;
    float rho_k, rho_v;
    std::vector<float> r_k_t, r_v_t;
    kernels::Rotation kind_k = kernels::Rotation::kDense, kind_v = kernels::Rotation::kDense;
  };
  // The transposes and the rotations' kinds, derived once from r_k / r_v.
  void ComputeTransposes();
  // The same rotation r for K and V on every layer.
  static CodecProfile Uniform(int num_layers, int head_dim, const std::vector<float>& r,
                              std::string description);
  int head_dim_ = 0;
  std::vector<Layer> layers_;
  std::string description_;
};

}  // namespace kvcd
