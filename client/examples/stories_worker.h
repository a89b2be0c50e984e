// A decode worker for llama2.c checkpoints whose attention is served by kvcd: it runs the
// model's own layers on the CPU and, per step and per layer, appends the token's K/V and
// calls AttentionDecode over one bidirectional stream, using the returned output in the
// residual stream. The same model with local FP32 attention is the reference.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/examples/llama2.h"

namespace kvcd::llama2 {

struct RunResult {
  std::vector<int> tokens;                 // generated (or teacher-forced) tokens
  std::vector<std::vector<float>> logits;  // next-token logits per step
  std::string text;                        // decoded prompt + generation
  double seconds = 0;
};

// Greedy generation with local FP32 attention. steps = forward passes (positions
// 0..steps-1), starting from `prompt` (BOS first). `calibration` (optional) receives the
// post-RoPE activations seen, per layer: q [n][n_heads*hd], k and v [n][kv_dim], and the
// normalized residuals [n][dim].
absl::StatusOr<RunResult> RunReference(Model& model, const Tokenizer& tok,
                                       const std::vector<int>& prompt, int steps,
                                       LocalAttention* calibration = nullptr);

// Registers the model geometry on kvcd as `name` with the given history format
// ("bf16", "int2-identity", "int2-hadamard", or "int2-oscar" with a codec file).
absl::Status RegisterProfile(Client& client, const Config& c, const std::string& name,
                             const std::string& format, const std::string& codec_blob);

// The same generation with attention served by kvcd model `name`: the prompt (all but its
// last token) is prefilled locally, Put, opened, and its uncached tail appended; then
// every step runs the per-layer fused append + attention on one stream. With `teacher`
// the step inputs follow those tokens (for KL), else greedy.
absl::StatusOr<RunResult> RunServed(Client& client, Model& model, const Tokenizer& tok,
                                    const std::string& name, const std::vector<int>& prompt,
                                    int steps, const std::vector<int>* teacher = nullptr);

// Codec file (safetensors) with OSCAR rotations computed from recorded activations.
std::string CalibrateCodec(const Config& c, const std::vector<const LocalAttention*>& runs);

// KL(p || q) of the softmaxes of two logit vectors (natural log).
double KlDivergence(const std::vector<float>& p_logits, const std::vector<float>& q_logits);

int Argmax(const std::vector<float>& v);

}  // namespace kvcd::llama2
