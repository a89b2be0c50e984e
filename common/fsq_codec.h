// FsqCodec: the per-layer Transformer-FSQ codec of a model whose history is stored as
// 4-bit latent codes (docs/fsq.md "Codec file").
//
// Codec file (safetensors, version 1): metadata kvcd.codec = "fsq", version = "1",
// num_layers, residual_width (C), latent_width (G), num_kv_heads, head_dim,
// key_norm (none | rms), optional source; all tensors F32, per layer l:
//   layers.<l>.encoder       [G, C]
//   layers.<l>.encoder_bias  [G]
//   layers.<l>.decoder_k     [Hkv*d, G]
//   layers.<l>.decoder_v     [Hkv*d, G]
//   layers.<l>.bias_k        [Hkv*d]
//   layers.<l>.bias_v        [Hkv*d]
//   layers.<l>.key_norm      [d]        present iff key_norm = rms
//
// Thread safety: immutable after construction; may be shared.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd {

// What the model profile says the codec must be.
struct FsqCodecShape {
  int32_t num_layers = 0;
  int32_t residual_width = 0;  // C
  int32_t latent_width = 0;    // G, 1..kernels::kFsqMaxLatent
  int32_t num_kv_heads = 0;    // Hkv
  int32_t head_dim = 0;        // d
  bool key_norm = false;       // per-head RMSNorm on the rebuilt keys
  float key_norm_eps = 1e-6f;  // from the profile (not stored in the file)
};

// The tensors of one layer, row-major F32.
struct FsqLayerTensors {
  std::vector<float> encoder;       // [G][C]
  std::vector<float> encoder_bias;  // [G]
  std::vector<float> decoder_k;     // [Hkv*d][G]
  std::vector<float> decoder_v;     // [Hkv*d][G]
  std::vector<float> bias_k;        // [Hkv*d]
  std::vector<float> bias_v;        // [Hkv*d]
  std::vector<float> key_norm;      // [d], empty when the shape has no key norm
};

class FsqCodec {
 public:
  // Builds a codec from tensors; INVALID_ARGUMENT naming the first tensor whose size
  // disagrees with `shape` or that holds a NaN/Inf, or when the shape itself is invalid.
  static absl::StatusOr<FsqCodec> FromLayers(const FsqCodecShape& shape,
                                             std::vector<FsqLayerTensors> layers,
                                             std::string source = "");
  // Loads a codec file, checking its metadata against `expected`, every tensor's
  // presence, dtype (F32), shape and finiteness; INVALID_ARGUMENT naming the first wrong
  // metadata key or tensor and the expected value.
  static absl::StatusOr<FsqCodec> FromSafetensors(const SafetensorsFile& file,
                                                  const FsqCodecShape& expected);
  // A well-formed random codec (seeded, deterministic) for tests and benchmarks: E with
  // entries of scale 2/sqrt(C) so unit-variance residuals spread over all 16 levels,
  // decoders of scale 1/sqrt(G), small biases, key-norm weights near 1.
  static FsqCodec Synthetic(const FsqCodecShape& shape, uint64_t seed);
  // Checks only the shape itself (ranges); INVALID_ARGUMENT naming the field.
  static absl::Status ValidateShape(const FsqCodecShape& shape);

  // Writes this codec in the codec-file layout (metadata included).
  SafetensorsWriter ToSafetensors() const;

  const FsqCodecShape& shape() const { return shape_; }
  int num_layers() const { return shape_.num_layers; }
  const std::string& source() const { return source_; }
  const FsqLayerTensors& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  // The kernel view of layer l: pointers into this codec's tensors, valid while the codec
  // (or the codec it was moved into: moves keep the buffers) lives.
  kernels::FsqLayerCodec Layer(int l) const;

 private:
  FsqCodecShape shape_;
  std::vector<FsqLayerTensors> layers_;
  std::string source_;
};

}  // namespace kvcd
