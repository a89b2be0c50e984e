// Model profile: geometry and cache policy of one served model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/formats/format_id.h"

namespace kvcd {

struct ModelSpec {
  std::string name;
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 64;
  int32_t sink_tokens = 64;
  int32_t recent_tokens = 256;
  FormatId history_format = FormatId::kBf16;  // the window is always BF16
  double rope_theta = 10000.0;
  int32_t rope_rotary_dims = 0;  // 0 = head_dim
  double rope_scaling = 1.0;
  bool rope_interleaved = false;  // pairing: false = half (i, i + r/2), true = (2i, 2i+1)
  bool key_norm = false;          // per-head RMSNorm on the keys (FSQ rebuilds keys)
  float key_norm_eps = 1e-6f;
  int32_t fsq_residual_width = 0;  // C (history_format fsq only)
  int32_t fsq_latent_width = 0;    // G (history_format fsq only), 1..4096
  uint64_t memory_bytes = 0;       // share of the daemon budget for this model's pools
  double bf16_fraction = 0.25;     // BF16 share of memory_bytes when history is compressed
  std::string codec_file;          // optional codec (safetensors) path
  std::string codec;  // int2: "identity", "hadamard", or "" (codec_file, else hadamard)

  int32_t group() const { return num_q_heads / num_kv_heads; }
  int32_t sink_pages() const { return sink_tokens / page_size; }
  bool is_fsq() const { return history_format == FormatId::kFsq; }
  int32_t rotary_dims() const { return rope_rotary_dims == 0 ? head_dim : rope_rotary_dims; }
};

// Checks every field; INVALID_ARGUMENT naming the field and the accepted range.
absl::Status ValidateModelSpec(const ModelSpec& spec);

// Built-in profiles: "qwen3-8b" (36 layers, 32 q / 8 kv heads, head_dim 128, page 64,
// sink 64, recent 256) and "tiny" (2 layers, 4 q / 2 kv heads, head_dim 16, page 4,
// sink 4, recent 8; for tests and demos). nullopt for an unknown name.
std::optional<ModelSpec> BuiltinModelSpec(const std::string& name);
std::vector<std::string> BuiltinModelNames();

}  // namespace kvcd
