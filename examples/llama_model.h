// A llama-family decoder (Llama, SmolLM2, Mistral; Qwen3 with its q/k norm) run on the
// CPU in FP32, one token or several at a time, with attention delegated to a callback: local
// FP32 attention (the reference) or kvcd. Loaded from one safetensors file with Hugging Face
// tensor names and the geometry in its metadata (tools/gguf_to_safetensors.py writes it):
//   kvcd.model = "llama", kvcd.{dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim,
//   vocab_size, max_seq_len, rope_theta, rms_eps, rope_pairing (half | interleaved),
//   tied_embeddings (0 | 1), qk_norm (0 | 1)};
// or from a llama2.c checkpoint (e.g. stories260K: Meta's interleaved RoPE pairing,
// theta 10000, RMSNorm eps 1e-5, head_dim = dim / n_heads).
//
// Thread safety: a loaded Model is immutable; Forward may run concurrently.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/safetensors.h"

namespace kvcd::llama {

// Which lanes of a head RoPE rotates together: kHalf pairs (i, i + d/2) (Hugging Face
// rotate_half, GPT-NeoX), kInterleaved pairs (2i, 2i + 1) (Meta's original, llama.cpp's
// permuted rows). Pair i turns by pos * theta^(-2i/d) either way.
enum class RopePairing { kHalf, kInterleaved };

struct Config {
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0,
      vocab_size = 0, max_seq_len = 0;
  double rope_theta = 10000, rms_eps = 1e-5;
  RopePairing pairing = RopePairing::kHalf;
  bool tied_embeddings = true;
  bool qk_norm = false;  // per-head RMSNorm of q and k before RoPE (Qwen3)
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// Applies RoPE in place to `n_heads` heads of `head_dim` lanes at position `pos`.
void ApplyRope(float* x, int n_heads, int head_dim, int pos, double theta, RopePairing pairing);

class Model {
 public:
  // NOT_FOUND for a missing file or tensor; INVALID_ARGUMENT naming the metadata key
  // that is missing or malformed, or the tensor of the wrong shape or dtype.
  static absl::StatusOr<Model> Load(const std::string& path);
  static absl::StatusOr<Model> FromSafetensors(const SafetensorsFile& file);
  // A legacy llama2.c checkpoint: a header of 7 int32 (dim, hidden_dim, n_layers, n_heads,
  // n_kv_heads, vocab_size (negative: unshared classifier), seq_len), then FP32 weights
  // stacked per kind over the layers. NOT_FOUND for a missing file, INVALID_ARGUMENT for
  // an implausible header or truncated weights.
  static absl::StatusOr<Model> LoadLlama2c(const std::string& path);
  const Config& config() const { return c_; }

  // The K and V projections of a layer, [kv_dim][dim] row-major, and its k_norm
  // weights [head_dim] (empty without qk_norm). No biases in this model family.
  const std::vector<float>& wk(int layer) const { return layers_[layer].wk; }
  const std::vector<float>& wv(int layer) const { return layers_[layer].wv; }
  const std::vector<float>& k_norm(int layer) const { return layers_[layer].k_norm; }

  // Attention of one layer for the current token: x [dim], the attention block's
  // normalized residual (after the input RMSNorm, the input of the Q/K/V projections and
  // of an FSQ codec, docs/fsq.md), q [n_heads*head_dim] and the token's own k, v [kv_dim]
  // (post-RoPE); writes o [n_heads*head_dim]. It must include the token itself (causal
  // decode).
  using AttentionFn = std::function<absl::Status(int layer, int pos, const float* x, const float* q,
                                                 const float* k, const float* v, float* o)>;
  // One forward step of `token` at position `pos`; logits [vocab_size]. INVALID_ARGUMENT
  // for a token or position out of range; the callback's error otherwise.
  absl::Status Forward(int token, int pos, const AttentionFn& attend,
                       std::vector<float>* logits) const;

  // One token of a multi-token forward: its attention, and its logits [vocab_size] if
  // `logits` is non-null (the classifier is skipped for the others).
  struct Step {
    int token = 0, pos = 0;
    const AttentionFn* attend = nullptr;
    std::vector<float>* logits = nullptr;
  };
  // The steps through the model together: every projection and the MLP as one matrix
  // product over the steps (each weight row read once for all of them). Per layer, each
  // step's `attend` is called in the order of `steps`, so the steps of one callback must
  // come in position order (LocalAttention requires it), and layer l of every step runs
  // before layer l + 1 of any: a callback that needs a token's layers back to back (kvcd's
  // fused append) takes one step per call. Steps may have different callbacks (e.g. a
  // served step and its FP32 reference, the same token read off the weights once).
  // Every step's logits are bit-identical to its one-step Forward (llama_matmul.h's
  // summation order). INVALID_ARGUMENT for a token or position out of range (nothing
  // runs); a callback's error otherwise (later steps and layers do not run).
  absl::Status Forward(absl::Span<const Step> steps) const;

  // `tokens` at positions first_pos, first_pos + 1, ... with one attention, in spans of at
  // most kSpan steps; the last token's logits into `last_logits` if non-null.
  static constexpr int kSpan = 64;
  absl::Status ForwardTokens(absl::Span<const int> tokens, int first_pos, const AttentionFn& attend,
                             std::vector<float>* last_logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, q_norm, k_norm, ffn_norm, w_gate, w_up, w_down;
  };
  Config c_;
  std::vector<float> embed_, final_norm_, lm_head_;  // lm_head_ empty when tied
  std::vector<Layer> layers_;
};

// FP32 causal attention over a local KV cache (the reference path and the prefill
// worker). It also records what it saw: post-RoPE q [pos][q_dim], k, v [pos][kv_dim] and
// the normalized residuals x [pos][dim]. Each score and each output lane is summed in
// position (and lane) order, as one loop per score and per output would.
class LocalAttention {
 public:
  explicit LocalAttention(const Config& c);
  // FAILED_PRECONDITION unless positions of a layer arrive in order 0, 1, 2, ...
  absl::Status operator()(int layer, int pos, const float* x, const float* q, const float* k,
                          const float* v, float* o);
  const std::vector<float>& keys(int layer) const { return k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }
  const std::vector<float>& queries(int layer) const { return q_[layer]; }
  const std::vector<float>& residuals(int layer) const { return x_[layer]; }
  int tokens() const { return static_cast<int>(k_[0].size() / c_.kv_dim()); }

 private:
  Config c_;
  std::vector<std::vector<float>> k_, v_, q_, x_;
};

}  // namespace kvcd::llama
