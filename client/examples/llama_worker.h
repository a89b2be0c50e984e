// A decode worker for llama-family models whose attention is served by kvcd: the model's
// layers run on the CPU and, per step and per layer, the token's K/V are appended and
// AttentionDecode called over one bidirectional stream, its output used in the residual
// stream. The same model with local FP32 attention is the reference.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/examples/llama_model.h"

namespace kvcd::llama {

// Decoding after a prompt: step i feeds the previous token (the prompt's last one first)
// and yields logits[i], from which tokens[i] is chosen.
struct Generation {
  std::vector<int> tokens;                 // generated (or teacher-forced) tokens
  std::vector<std::vector<float>> logits;  // next-token logits per step
  double seconds = 0;                      // wall time of the steps (prefill excluded)
};

// Greedy decoding with local FP32 attention: the prompt is fed token by token, then up to
// `max_new` tokens are generated, stopping after `stop` (-1: never). `record` (optional)
// receives the post-RoPE activations of every position.
absl::StatusOr<Generation> RunReference(const Model& model, const std::vector<int>& prompt,
                                        int max_new, int stop = -1,
                                        LocalAttention* record = nullptr);

// kvcd model geometry and windows; history "bf16", "int2-identity", "int2-hadamard", or
// "int2-oscar" with `codec_blob` (the bytes of a kvcd-calibrate codec file).
struct ServedProfile {
  std::string name, history = "bf16";
  std::string codec_blob;
  int page_size = 16, sink_tokens = 16, recent_tokens = 32;
  int64_t memory_bytes = 64 << 20;
};
absl::Status RegisterProfile(Client& client, const Config& c, const ServedProfile& p);

// The same decoding with attention served by kvcd model `name`: all but the prompt's last
// token is prefilled locally and Put, the sequence opened (its uncached tail appended),
// then every step runs the fused append + attention per layer on one stream. With
// `teacher`, the tokens after the prompt follow teacher (for KL against the reference),
// and the run lasts teacher.size() steps; otherwise greedy as RunReference.
absl::StatusOr<Generation> RunServed(Client& client, const Model& model, const std::string& name,
                                     const std::vector<int>& prompt, int max_new, int stop = -1,
                                     const std::vector<int>* teacher = nullptr);

// KL(p || q) of the softmaxes of two logit vectors (natural log).
double KlDivergence(const std::vector<float>& p_logits, const std::vector<float>& q_logits);

int Argmax(const std::vector<float>& v);

}  // namespace kvcd::llama
