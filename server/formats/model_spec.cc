#include "server/formats/model_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvcd {

absl::Status ValidateModelSpec(const ModelSpec& s) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("model ", Quote(s.name), ": ", what));
  };
  if (s.name.empty() || s.name.size() > 64) return bad("name must have 1..64 characters");
  for (char c : s.name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return bad("name may contain only [A-Za-z0-9._-]");
  }
  if (s.num_layers < 1 || s.num_layers > 1024) {
    return bad(absl::StrCat("num_layers is ", s.num_layers, ", expected 1..1024"));
  }
  if (s.num_kv_heads < 1 || s.num_kv_heads > 256) {
    return bad(absl::StrCat("num_kv_heads is ", s.num_kv_heads, ", expected 1..256"));
  }
  if (s.num_q_heads < 1 || s.num_q_heads % s.num_kv_heads != 0) {
    return bad(absl::StrCat("num_q_heads is ", s.num_q_heads,
                            ", expected a positive multiple of num_kv_heads (", s.num_kv_heads,
                            ")"));
  }
  if (s.group() > 16) {
    return bad(
        absl::StrCat("GQA group num_q_heads/num_kv_heads is ", s.group(), ", expected at most 16"));
  }
  const int d = s.head_dim;
  if (d != 8 && d != 16 && d != 32 && d != 64 && d != 128 && d != 256) {
    return bad(absl::StrCat("head_dim is ", d, ", expected 8, 16, 32, 64, 128 or 256"));
  }
  if (s.page_size < 1 || s.page_size > 1024) {
    return bad(absl::StrCat("page_size is ", s.page_size, ", expected 1..1024"));
  }
  if (s.sink_tokens < 0 || s.sink_tokens > (1 << 20) || s.sink_tokens % s.page_size != 0) {
    return bad(absl::StrCat("sink_tokens is ", s.sink_tokens,
                            ", expected a multiple of page_size (", s.page_size,
                            ") in 0..1048576"));
  }
  if (s.recent_tokens < 0 || s.recent_tokens > (1 << 20)) {
    return bad(absl::StrCat("recent_tokens is ", s.recent_tokens, ", expected 0..1048576"));
  }
  if (!(s.rope_theta > 0 && std::isfinite(s.rope_theta))) {
    return bad(absl::StrCat("rope.theta is ", s.rope_theta, ", expected a finite value > 0"));
  }
  if (s.rope_rotary_dims < 0 || s.rope_rotary_dims > d || s.rope_rotary_dims % 2 != 0) {
    return bad(absl::StrCat("rope.rotary_dims is ", s.rope_rotary_dims,
                            ", expected an even value in 0..head_dim (0 = head_dim)"));
  }
  if (!(s.rope_scaling > 0 && std::isfinite(s.rope_scaling))) {
    return bad(absl::StrCat("rope.scaling is ", s.rope_scaling, ", expected a finite value > 0"));
  }
  if (s.memory_bytes == 0) return bad("memory_bytes must be > 0 (the model's share of the budget)");
  if (s.history_format != FormatId::kBf16 && !(s.bf16_fraction > 0 && s.bf16_fraction < 1)) {
    return bad(absl::StrCat("bf16_fraction is ", s.bf16_fraction, ", expected 0 < x < 1"));
  }
  if (!s.codec.empty() && s.codec != "identity" && s.codec != "hadamard") {
    return bad(
        absl::StrCat("codec is ", Quote(s.codec), ", expected 'identity', 'hadamard' or empty"));
  }
  if (!s.codec.empty() && !s.codec_file.empty()) {
    return bad("set either codec or codec_file, not both");
  }
  if (s.is_fsq()) {
    if (s.fsq_residual_width < 1 || s.fsq_residual_width > (1 << 16)) {
      return bad(absl::StrCat("fsq_residual_width is ", s.fsq_residual_width,
                              ", expected 1..65536 (the residual width C)"));
    }
    if (s.fsq_latent_width < 1 || s.fsq_latent_width > 4096) {
      return bad(absl::StrCat("fsq_latent_width is ", s.fsq_latent_width,
                              ", expected 1..4096 (the latent width G)"));
    }
    if (!s.codec.empty()) {
      return bad(absl::StrCat("codec is '", s.codec,
                              "', expected empty for history_format fsq (the FSQ codec comes "
                              "from codec_blob or codec_file)"));
    }
    if (s.key_norm && !(s.key_norm_eps > 0.0f && s.key_norm_eps < 1.0f)) {
      return bad(absl::StrCat("key_norm_eps is ", s.key_norm_eps, ", expected 0 < eps < 1"));
    }
  } else if (s.fsq_residual_width != 0 || s.fsq_latent_width != 0) {
    return bad("fsq_residual_width / fsq_latent_width are only used with history_format fsq");
  }
  return absl::OkStatus();
}

std::optional<ModelSpec> BuiltinModelSpec(const std::string& name) {
  ModelSpec s;
  s.name = name;
  if (name == "qwen3-8b") {
    s.num_layers = 36;
    s.num_q_heads = 32;
    s.num_kv_heads = 8;
    s.head_dim = 128;
    s.page_size = 64;
    s.sink_tokens = 64;
    s.recent_tokens = 256;
    s.rope_theta = 1e6;
    s.memory_bytes = 1ull << 30;
    return s;
  }
  if (name == "tiny") {
    s.num_layers = 2;
    s.num_q_heads = 4;
    s.num_kv_heads = 2;
    s.head_dim = 16;
    s.page_size = 4;
    s.sink_tokens = 4;
    s.recent_tokens = 8;
    s.memory_bytes = 1ull << 20;
    return s;
  }
  return std::nullopt;
}

std::vector<std::string> BuiltinModelNames() { return {"qwen3-8b", "tiny"}; }

}  // namespace kvcd
