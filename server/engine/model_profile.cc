// Conversions between the wire's ModelProfile and the formats' ModelSpec.
#include "server/engine/model_profile.h"

#include "server/formats/format_registry.h"

namespace kvcd {

ModelSpec SpecFromProfile(const v1::ModelProfile& p) {
  ModelSpec s;
  s.name = p.name();
  s.num_layers = p.num_layers();
  s.num_q_heads = p.num_q_heads();
  s.num_kv_heads = p.num_kv_heads();
  s.head_dim = p.head_dim();
  s.page_size = p.page_size();
  s.sink_tokens = p.sink_tokens();
  s.recent_tokens = p.recent_tokens();
  // The format registry's (an unknown value was refused before: HistoryFormatOfProto).
  s.history_format = HistoryFormatOfProto(p.history_format()).value_or(FormatId::kBf16);
  s.rope_theta = p.rope().theta() == 0 ? 10000.0 : p.rope().theta();
  s.rope_rotary_dims = p.rope().rotary_dims();
  s.rope_scaling = p.rope().scaling() == 0 ? 1.0 : p.rope().scaling();
  s.rope_interleaved = p.rope().pairing() == v1::ROPE_PAIRING_INTERLEAVED;
  s.key_norm = p.key_norm() == v1::KEY_NORM_RMS;
  s.key_norm_eps = p.key_norm_eps() == 0 ? 1e-6f : p.key_norm_eps();
  s.fsq_residual_width = p.fsq_residual_width();
  s.fsq_latent_width = p.fsq_latent_width();
  s.memory_bytes = p.memory_bytes();
  s.bf16_fraction = p.bf16_fraction() == 0 ? 0.25 : p.bf16_fraction();
  s.codec = p.codec();
  return s;
}

void ProfileFromSpec(const ModelSpec& s, v1::ModelProfile* p) {
  p->set_name(s.name);
  p->set_num_layers(s.num_layers);
  p->set_num_q_heads(s.num_q_heads);
  p->set_num_kv_heads(s.num_kv_heads);
  p->set_head_dim(s.head_dim);
  p->set_page_size(s.page_size);
  p->set_sink_tokens(s.sink_tokens);
  p->set_recent_tokens(s.recent_tokens);
  p->set_history_format(static_cast<v1::HistoryFormat>(ProtoOfHistoryFormat(s.history_format)));
  p->mutable_rope()->set_theta(s.rope_theta);
  p->mutable_rope()->set_rotary_dims(s.rope_rotary_dims);
  p->mutable_rope()->set_scaling(s.rope_scaling);
  p->mutable_rope()->set_pairing(s.rope_interleaved ? v1::ROPE_PAIRING_INTERLEAVED
                                                    : v1::ROPE_PAIRING_HALF);
  p->set_key_norm(s.key_norm ? v1::KEY_NORM_RMS : v1::KEY_NORM_NONE);
  p->set_key_norm_eps(s.key_norm_eps);
  p->set_fsq_residual_width(s.fsq_residual_width);
  p->set_fsq_latent_width(s.fsq_latent_width);
  p->set_memory_bytes(s.memory_bytes);
  p->set_bf16_fraction(s.bf16_fraction);
  p->set_codec(s.codec);
}

}  // namespace kvcd
