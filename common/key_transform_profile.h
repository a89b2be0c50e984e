// KeyTransformProfile: codec file version 3 — keys stored as a per-KV-head transform code
// with uneven bits across directions (tools/transform_codec.h), values as INT2 with one
// rotation and clip per KV head (as version 2). Issue #22: at the INT2 budget (160 bits per
// 64-value row) it halves Hadamard INT2's attention-output error on SmolLM2-135M.
//
// Codec file (safetensors, metadata kvcd.codec = "int2-oscar", kvcd.codec_version = "3"):
//   layers.<l>.k_encode F32 [Hkv, d, d]  y = k_encode[h] (k - k_mean[h])   (rows: directions)
//   layers.<l>.k_decode F32 [Hkv, d, d]  k = k_mean[h] + k_decode[h] y
//   layers.<l>.k_mean   F32 [Hkv, d]
//   layers.<l>.k_sigma  F32 [Hkv, d]     > 0 wherever k_bits > 0
//   layers.<l>.k_bits   F32 [Hkv, d]     integers 0..8, non-increasing along d; the same sum
//                                        B (a multiple of 8) on every layer and head
//   layers.<l>.r_v      F32 [Hkv, d, d]  orthogonal value rotation (INT2, as version 2)
//   layers.<l>.rho_v    F32 [Hkv]        value clip quantile in (0, 1]
// A stored key row is B / 8 bytes of codes (direction i at bits[i] bits, LSB first, in
// direction order) and one FP16 gain g; direction i decodes to
// y_i = sigma_i * g * step(bits_i) * (c_i - (2^bits_i - 1) / 2), step(b) being the unit
// Gaussian's optimal uniform step (tools/bit_allocation.h), so that
// q . k = q . mean + g * sum_i (k_decode^T q)_i sigma_i step_i (c_i - (2^b_i - 1) / 2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "kvcd/kernels/transform_codec.h"

namespace kvcd {

class KeyTransformProfile {
 public:
  struct Head {
    std::vector<float> k_encode, k_decode;  // [d][d]
    std::vector<float> k_mean, k_sigma;     // [d]
    std::vector<int> k_bits;                // [d]
    std::vector<float> r_v;                 // [d][d]
    float rho_v = 0;
  };

  // INVALID_ARGUMENT naming the tensor and the expected shape or range when a check fails
  // (version, layer count, shapes, bit widths and their sum, sigma, orthogonality of r_v).
  static absl::StatusOr<KeyTransformProfile> FromSafetensors(const SafetensorsFile& file,
                                                             int num_layers, int num_kv_heads,
                                                             int head_dim);

  const Head& head(int layer, int kv_head) const {
    return heads_[static_cast<size_t>(layer) * num_kv_heads_ + kv_head];
  }
  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  // Code bits per key row (B); a stored key row is B / 8 + 2 bytes.
  int key_code_bits() const { return key_code_bits_; }
  // One head's key code as the kernels take it (pointers into this profile).
  kernels::TransformKeyCode KeyCode(int layer, int kv_head) const;

  // Random heads for tests and benchmarks ([layer][kv head]): orthogonal key bases (decode =
  // encode^T), deviations decaying from 3, non-increasing widths 8..0 summing to INT2's
  // budget less the gain (2 d + 16 code bits: 144 at head_dim 64), orthogonal r_v, rho_v 0.92.
  static std::vector<Head> SyntheticHeads(int num_layers, int num_kv_heads, int head_dim,
                                          uint32_t seed);

  // Writes the profile in the version-3 layout (heads_ in [layer][kv head] order).
  static SafetensorsWriter ToSafetensors(const std::vector<Head>& heads, int num_layers,
                                         int num_kv_heads, int head_dim, const std::string& source);

 private:
  int num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0, key_code_bits_ = 0;
  std::vector<Head> heads_;
};

}  // namespace kvcd
