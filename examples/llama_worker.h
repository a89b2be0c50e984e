// A decode worker for llama-family models whose attention is served by kvcd: the model's
// layers run on the CPU and, per step and per layer, the token's K/V (and, for an FSQ
// history, its normalized residual x) are appended and AttentionDecode called over one
// bidirectional stream, its output used in the residual stream. The same model with local
// FP32 attention is the reference. Codecs (OSCAR rotations, FSQ encoders/decoders) can be
// calibrated here on the model's own recorded runs, or read from codec files.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/activation_dump.h"
#include "common/safetensors.h"
#include "examples/llama_model.h"
#include "tools/fsq_calibration.h"

namespace kvcd::llama {

// Decoding after a prompt: step i feeds the previous token (the prompt's last one first)
// and yields logits[i], from which tokens[i] is chosen.
struct Generation {
  std::vector<int> tokens;                 // generated (or teacher-forced) tokens
  std::vector<std::vector<float>> logits;  // next-token logits per step
  double seconds = 0;                      // wall time of the steps (prefill excluded)
};

// Decoding with local FP32 attention: the prompt is fed in spans (Model::ForwardTokens),
// then up to `max_new` tokens are generated greedily, stopping after `stop` (-1: never).
// With `teacher`, the tokens after the prompt follow teacher and the run lasts
// teacher.size() steps (max_new and stop are ignored), its steps in spans too. `record` (optional,
// empty) receives the post-RoPE activations and residuals of every position.
absl::StatusOr<Generation> RunReference(const Model& model, const std::vector<int>& prompt,
                                        int max_new, int stop = -1,
                                        LocalAttention* record = nullptr,
                                        const std::vector<int>* teacher = nullptr);

// kvcd model geometry and windows; history "bf16", "int2-identity", "int2-hadamard",
// "int2-oscar" with `codec_blob` (the bytes of a kvcd-calibrate codec file), or "fsq"
// with `codec_blob` (an FSQ codec file, docs/fsq.md: its latent width G becomes the
// profile's, the model's RoPE and key norm go with it).
struct ServedProfile {
  std::string name, history = "bf16";
  std::string codec_blob;
  int page_size = 16, sink_tokens = 16, recent_tokens = 32;
  int64_t memory_bytes = 64 << 20;
};
// Registers the profile; returns the daemon's view of it (bytes per token per segment).
// INVALID_ARGUMENT for an unknown history, a missing or malformed codec; the daemon's
// error otherwise.
absl::StatusOr<v1::ModelInfo> RegisterProfile(Client& client, const Config& c,
                                              const ServedProfile& p);

// What a recorder holds per position: post-RoPE keys, values, or the attention blocks'
// normalized residuals (FSQ histories).
enum class Recorded { kKeys, kValues, kResiduals };
// Positions [begin, begin + n) of `rec` as a tensor [layers, n, kv_heads, head_dim]
// (residuals: [layers, n, dim]). REQUIRES: rec holds them.
void RecordedRows(const Config& c, const LocalAttention& rec, Recorded what, int begin, int n,
                  v1::TensorRef* out);

// A prefill worker's Put of `tokens` into model `p.name` under `salt`, with the K/V (and, for
// an FSQ history, the residuals) that `recorded` holds for positions [0, tokens.size())
// (FAILED_PRECONDITION if it holds fewer); the daemon's error otherwise.
absl::StatusOr<v1::PutResponse> PutRecorded(Client& client, const Config& c, const ServedProfile& p,
                                            const std::string& salt,
                                            absl::Span<const int32_t> tokens,
                                            const LocalAttention& recorded);

// The same decoding with attention served by kvcd model `p.name` (registered with `p`):
// all but the prompt's last token is prefilled locally and Put, the sequence opened (its
// uncached tail appended), then every step runs the fused append + attention per layer on
// one stream. An FSQ history also carries the residuals: Put/Append `x` [layers, n, dim],
// the fused call `x_new` [1, dim]. `teacher` as in RunReference. `prefilled` (optional):
// a recorder that already ran the same prompt (e.g. RunReference's), whose first
// prompt.size() - 1 positions are sent instead of prefilling again (FAILED_PRECONDITION if
// it holds fewer).
absl::StatusOr<Generation> RunServed(Client& client, const Model& model, const ServedProfile& p,
                                     const std::vector<int>& prompt, int max_new, int stop = -1,
                                     const std::vector<int>* teacher = nullptr,
                                     const LocalAttention* prefilled = nullptr);

// Recorded runs as an activation dump (common/activation_dump.h): their q, k, v and
// residuals x concatenated per layer.
ActivationDump MakeActivationDump(const Config& c, const std::vector<const LocalAttention*>& runs,
                                  const std::string& source);

// An OSCAR codec file (rotations R_k, R_v per layer, default clips) calibrated on recorded
// runs.
std::string CalibrateOscarCodec(const Config& c, const std::vector<const LocalAttention*>& runs);

// A version-3 codec file (history int2-transform on the daemon) calibrated on the runs'
// activations: transform-coded keys (tools/transform_calibration, query-whitened basis,
// 144 code bits at head_dim 64) fitted on the rows from first_row on (the history; rows in
// the BF16 sink are never coded), Hadamard INT2 values at the default clip.
absl::StatusOr<std::string> CalibrateTransformCodec(const Config& c,
                                                    const std::vector<const LocalAttention*>& runs,
                                                    int64_t first_row);

// The model's K/V projections as `kvcd-calibrate fsq --weights` reads them
// (layers.<l>.wk / .wv [kv_dim, dim], layers.<l>.k_norm [head_dim] with qk_norm).
SafetensorsWriter KvProjectionFile(const Model& model);

// An FSQ codec file with latent width `latent_width`, initialized without training
// (tools/fsq_calibration: PCA encoder, ridge decoder folded into the model's W^K, W^V) on
// the residuals of recorded runs; the last 20% of their tokens are held out for
// `reports`. INVALID_ARGUMENT from the calibration (e.g. G out of range, too few tokens).
absl::StatusOr<std::string> InitializeFsqCodec(const Model& model,
                                               const std::vector<const LocalAttention*>& runs,
                                               int latent_width,
                                               std::vector<FsqLayerReport>* reports = nullptr);

// A history given on a command line, resolved to a profile (name, history, codec):
//   bf16 | int2-identity | int2-hadamard   built-in
//   int2-oscar                             rotations calibrated on `calibration`
//   int2-oscar=FILE | fsq=FILE             a codec file (e.g. kvcd-calibrate's, or a
//                                          fine-tuned FSQ codec from tools/fsq_finetune)
//   fsq:G=N                                an FSQ codec initialized on `calibration`
//   int2-transform                         a version-3 codec (CalibrateTransformCodec) fitted
//                                          on `calibration`'s rows from `sink_tokens` on
// The profile's windows and memory are left at their defaults. `note` (optional)
// receives a line on where the codec came from (with the FSQ held-out errors).
// INVALID_ARGUMENT for an unknown spec or calibration-less in-process codecs; NOT_FOUND
// for a missing file.
absl::StatusOr<ServedProfile> ResolveHistory(const std::string& spec, const Model& model,
                                             const std::vector<const LocalAttention*>& calibration,
                                             std::string* note = nullptr, int sink_tokens = 16);

// How a served run's next-token distributions agree with the reference's (same inputs):
// mean and max KL(reference || served) and the first step whose argmax differs (-1: none).
struct Agreement {
  double mean_kl = 0, max_kl = 0;
  int first_diff = -1;
  int steps = 0;
};
Agreement Compare(const Generation& reference, const Generation& served);

// Dense BF16 K/V bytes per token of the model (all layers), and the compression of `info`'s
// segments over a sequence of `tokens`: dense bytes / (sink and recent windows at their
// bytes per token + the rest at the history's), everything the daemon stores per token.
double DenseBytesPerToken(const Config& c);
double CompressionAt(const Config& c, const v1::ModelInfo& info, int64_t tokens);

// KL(p || q) of the softmaxes of two logit vectors (natural log).
double KlDivergence(const std::vector<float>& p_logits, const std::vector<float>& q_logits);

int Argmax(const std::vector<float>& v);

}  // namespace kvcd::llama
