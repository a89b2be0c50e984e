// Transformer-FSQ codec initialization without training (docs/fsq.md, DESIGN.md §6): per
// layer, PCA of the centered normalized residuals (FP64, deterministic eigenvector signs),
// the encoder E_i = u_{i mod C}^T / (3 σ_{i mod C}) with e = −E μ, the FSQ codes of the
// training tokens, the ridge decoder D = (ZᵀZ + λI)⁻¹ Zᵀ X_c and the model's projections
// folded into it: W_k = W^K Dᵀ, b_k = W^K μ + b^K (likewise V).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/safetensors.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd {

// One layer of an FSQ codec, owned (the tensors of docs/fsq.md "Codec file").
struct FsqCodecLayer {
  std::vector<float> encoder;       // [G][C]
  std::vector<float> encoder_bias;  // [G]
  std::vector<float> decoder_k;     // [Hkv·d][G]
  std::vector<float> decoder_v;     // [Hkv·d][G]
  std::vector<float> bias_k;        // [Hkv·d]
  std::vector<float> bias_v;        // [Hkv·d]
  std::vector<float> key_norm;      // [d], empty = no key norm
};

struct FsqCodec {
  int residual_width = 0, latent_width = 0, num_kv_heads = 0, head_dim = 0;
  float key_norm_eps = 1e-6f;  // not in the file: the model profile's
  std::string source;
  std::vector<FsqCodecLayer> layers;
  kernels::FsqLayerCodec View(int layer) const;
};

// The codec file (docs/fsq.md, version 1).
SafetensorsWriter FsqCodecFile(const FsqCodec& codec);
// Reads and checks a codec file (every shape, dtype, metadata, finiteness; the message
// names the first wrong tensor or key). TODO(fsq-format): common/fsq_codec replaces this
// reader once it lands, so that there is one.
absl::StatusOr<FsqCodec> ReadFsqCodecFile(const SafetensorsFile& file, const std::string& what);

// z = FSQ(E x + e) of one residual row (docs/fsq.md "Math": float64 accumulation over c in
// order, tanh/atanh in float64, round half to even, clamp to [−8, 7]).
// TODO(fsq-kernels): kernels::FsqEncodeRows is the one definition once it lands.
void FsqEncodeLatent(const kernels::FsqLayerCodec& codec, const float* x, int8_t* z);
// The pre-RoPE K/V of one token rebuilt from its latent: k = N_k(W_k z + b_k) per head,
// v = W_v z + b_v ([Hkv·d] each, double).
void FsqDecodeLatent(const kernels::FsqLayerCodec& codec, const int8_t* z, double* k, double* v);

// k [Hkv·d] rotated in place to absolute position `position` (docs/fsq.md "RoPE").
void FsqApplyRope(const kernels::RopeSpec& rope, int num_kv_heads, int head_dim, int64_t position,
                  double* k);
// Post-RoPE K and V of one token from its residual row, as the daemon would rebuild them
// from the stored code (k, v [Hkv·d] F32). TODO(fsq-kernels): kernels::FsqExpandToken.
void FsqRoundTripToken(const kernels::FsqLayerCodec& codec, const kernels::RopeSpec& rope,
                       const float* x, int64_t position, float* k, float* v);

// The model's K/V projections of one layer: W^K, W^V [Hkv·d][C], optional biases [Hkv·d]
// and key norm weights [d].
struct KvProjection {
  std::vector<float> wk, wv, bk, bv, key_norm;
};

// Reads layers.<l>.wk / .wv [Hkv·d, C] and the optional layers.<l>.bk / .bv [Hkv·d] and
// layers.<l>.k_norm [d] (as kvcd_stories --weights writes them).
absl::StatusOr<std::vector<KvProjection>> ReadKvProjections(const SafetensorsFile& file,
                                                            int num_layers, int kv_dim,
                                                            int residual_width, int head_dim);

struct FsqCalibrationOptions {
  int latent_width = 0;       // G
  double lambda = 1.0;        // ridge
  double holdout = 0.2;       // last fraction of tokens: not fitted, scored
  float key_norm_eps = 1e-6f;
};

struct FsqLayerReport {
  double k_rel_err = 0, v_rel_err = 0;  // held-out ||K̂ − K||_F / ||K||_F (pre-RoPE: RoPE is
                                        // a rotation, so post-RoPE is the same)
  double x_rel_err = 0;                 // held-out centered residual reconstruction
  double explained = 0;     // fraction of the training variance in the first min(G, C) PCs
  double saturated = 0;     // fraction of held-out code coordinates at −8 or 7
  int64_t train_tokens = 0, heldout_tokens = 0;
};

// The ridge decoder D [G][C] = (ZᵀZ + λI)⁻¹ Zᵀ Xc for codes Z [n][G] and targets Xc [n][C].
std::vector<double> RidgeDecoder(const std::vector<double>& z, const std::vector<double>& xc,
                                 int64_t n, int g, int c, double lambda);

absl::StatusOr<FsqCodec> CalibrateFsq(const ActivationDump& dump,
                                      const std::vector<KvProjection>& proj,
                                      const FsqCalibrationOptions& options,
                                      std::vector<FsqLayerReport>* reports);

}  // namespace kvcd
