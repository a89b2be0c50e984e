// OSCAR calibration (DESIGN.md §5): per layer, R_k from the GQA-grouped query covariance
// and R_v from the score-weighted value covariance, composed as R = U·H·P in FP64; and
// optionally the clip quantiles that minimize attention-output error on held-out rows.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/safetensors.h"

namespace kvcd {

struct LayerCalibration {
  std::vector<float> r_k, r_v;  // [d][d]
  float rho_k = 0.96f, rho_v = 0.92f;
  double orthogonality_k = 0, orthogonality_v = 0;  // max |R R^T - I|
  double spread_k = 0, spread_v = 0;                // largest / smallest eigenvalue
  double heldout_error = 0;  // attention-output rel. error on held-out queries (with the rhos)
};

struct CalibrationOptions {
  double holdout = 0.2;      // last fraction of tokens: held-out queries, not in covariances
  bool search_clip = false;  // grid-search rho_k, rho_v per layer on the held-out rows
  int max_queries = 32;      // held-out queries scored per layer
  std::function<void(int layer, int num_layers)> progress;
};

absl::StatusOr<std::vector<LayerCalibration>> Calibrate(const ActivationDump& dump,
                                                        const CalibrationOptions& options);

// Mean relative error ||o_hat - o|| / ||o|| of queries [q_begin, q_end) attending causally,
// with every K/V row of the layer stored through the INT2 codec (rotations, clip quantiles).
double AttentionErrorWithCodec(const LayerActivations& a, int64_t n, int num_q_heads,
                               int num_kv_heads, int head_dim, const std::vector<float>& r_k,
                               const std::vector<float>& r_v, float rho_k, float rho_v,
                               int64_t q_begin, int64_t q_end);

// The codec file (CodecProfile layout: layers.<l>.r_k/r_v/rho_k/rho_v).
SafetensorsWriter CodecFile(const std::vector<LayerCalibration>& layers, int head_dim,
                            const std::string& source);

}  // namespace kvcd
