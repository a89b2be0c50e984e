// A llama2.c-format Llama-2-style model (e.g. stories260K) run on the CPU in FP32, with
// attention delegated to a callback: local FP32 attention (the reference) or kvcd.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcd::llama2 {

struct Config {
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0,
      seq_len = 0;
  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
};

class Model {
 public:
  // Reads a legacy llama2.c checkpoint (header of 7 int32, then FP32 weights).
  static absl::StatusOr<Model> Load(const std::string& path);
  const Config& config() const { return c_; }

  // Attention of one layer for the current token: q [n_heads*head_dim] and the token's own
  // k, v [kv_dim] (post-RoPE); writes o [n_heads*head_dim]. It must include the token
  // itself (causal decode).
  using AttentionFn = std::function<absl::Status(int layer, int pos, const float* q, const float* k,
                                                 const float* v, float* o)>;
  // Observes the attention block's normalized residual x [dim] of a layer (after the
  // input RMSNorm, before the Q/K/V projections: the FSQ codec's input, docs/fsq.md).
  using ResidualFn = std::function<void(int layer, int pos, const float* x)>;
  // One forward step of `token` at position `pos`; logits [vocab_size].
  absl::Status Forward(int token, int pos, const AttentionFn& attend, std::vector<float>* logits,
                       const ResidualFn& residual = nullptr);
  // The K and V projections of a layer, [kv_dim][dim] row-major (no biases in llama2.c).
  const float* wk(int layer) const { return wk_.data() + int64_t{layer} * c_.kv_dim() * c_.dim; }
  const float* wv(int layer) const { return wv_.data() + int64_t{layer} * c_.kv_dim() * c_.dim; }

 private:
  Config c_;
  std::vector<float> emb_, rms_att_, wq_, wk_, wv_, wo_, rms_ffn_, w1_, w2_, w3_, rms_final_;
};

// FP32 attention over a local KV cache (the reference path and the prefill worker).
class LocalAttention {
 public:
  explicit LocalAttention(const Config& c);
  absl::Status operator()(int layer, int pos, const float* q, const float* k, const float* v,
                          float* o);
  // K or V rows [pos][kv_dim] of a layer written so far.
  const std::vector<float>& keys(int layer) const { return k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }
  // Post-RoPE queries [pos][n_heads*head_dim] seen at a layer (for calibration).
  const std::vector<float>& queries(int layer) const { return q_[layer]; }
  // Normalized residuals [pos][dim] recorded with AddResidual (Model::ResidualFn).
  void AddResidual(int layer, const float* x) { r_[layer].insert(r_[layer].end(), x, x + c_.dim); }
  const std::vector<float>& residuals(int layer) const { return r_[layer]; }

 private:
  Config c_;
  std::vector<std::vector<float>> k_, v_, q_, r_;
};

class Tokenizer {
 public:
  static absl::StatusOr<Tokenizer> Load(const std::string& path, int vocab_size);
  // llama2.c encoding: BOS, a dummy-prefix space, bytes, then BPE merges by score.
  std::vector<int> Encode(const std::string& text) const;
  // The piece of `token` following `prev` (leading space stripped after BOS; <0xXX> bytes).
  std::string Piece(int prev, int token) const;

 private:
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
};

}  // namespace kvcd::llama2
