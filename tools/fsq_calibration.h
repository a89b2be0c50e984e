// Transformer-FSQ codec initialization without training (docs/calibration.md, FSQ): per
// layer, PCA of the centered normalized residuals (FP64, deterministic eigenvector signs),
// the encoder E_i = u_{i mod C}^T / (3 σ_{i mod C}) with e = −E μ, the FSQ codes of the
// training tokens, the ridge decoder D = (ZᵀZ + λI)⁻¹ Zᵀ X_c and the model's projections
// folded into it: W_k = W^K Dᵀ, b_k = W^K μ + b^K (likewise V). Codes are
// kernels::FsqEncodeRows's (the one definition), the codec is common/fsq_codec's FsqCodec.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/fsq_codec.h"
#include "common/safetensors.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd {

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
  int latent_width = 0;  // G
  double lambda = 1.0;   // ridge
  double holdout = 0.2;  // last fraction of tokens: not fitted, scored
  float key_norm_eps = 1e-6f;
};

struct FsqLayerReport {
  double k_rel_err = 0, v_rel_err = 0;  // held-out ||K̂ − K||_F / ||K||_F, K̂ rebuilt by
                                        // kernels::FsqExpandToken at position 0 (pre-RoPE:
                                        // RoPE is a rotation, post-RoPE is the same)
  double x_rel_err = 0;                 // held-out centered residual reconstruction
  double explained = 0;  // fraction of the training variance in the first min(G, C) PCs
  double saturated = 0;  // fraction of held-out code coordinates at −8 or 7
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
