// OSCAR calibration (docs/formats.md "int2-oscar"): per layer (or KV head), R_k from the GQA
// query covariance and R_v from the score-weighted value covariance, composed as R = U·H·P
// in FP64; and optionally the clip quantiles that minimize the attention-output error of
// held-out queries over K/V stored the way kvcd stores them.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/safetensors.h"
#include "tools/int2_layer.h"

namespace kvcd {

struct LayerCalibration {
  Int2Layer codec;                                  // rotations, clip quantiles
  double orthogonality_k = 0, orthogonality_v = 0;  // max |R R^T - I| (worst group)
  // Largest / smallest eigenvalue of the key and value covariances (worst group); +inf
  // when the covariance is singular (fewer training rows than head_dim).
  double spread_k = 0, spread_v = 0;
  double heldout_error = 0;  // attention-output rel. error on held-out queries (with the rhos)
};

// The clip quantiles --search-clip tries (for K and V separately): floor, floor + 0.02, ...,
// 1.00 (floor in (0, 1], default 0.60).
std::vector<float> ClipGrid(float floor = 0.60f);

struct CalibrationOptions {
  double holdout = 0.2;      // last fraction of tokens: held-out queries, not in covariances
  bool search_clip = false;  // grid-search rho_k, rho_v per group on the held-out queries
  bool per_head = false;     // one rotation and clip pair per KV head (codec file version 2)
  bool hadamard = false;     // R = H (data-free) instead of U·H·P; clips still searched
  float clip_floor = 0.60f;  // the clip grid's lowest quantile
  // Joint (rho_k, rho_v) search: coordinate descent, keys and values alternately, until a
  // pass changes neither (each then the best on the grid given the other; at most 6 passes).
  // Off: keys once, then values once.
  bool joint_clip = false;
  StoredWindows windows;  // BF16 sink / recent windows of the scoring (as kvcd stores)
  // Held-out queries scored: all of the held-out fraction, or max_queries of them evenly
  // spaced over it when it is longer.
  int max_queries = 64;
  std::function<void(int layer, int num_layers)> progress;
};

// Warnings about the dump (e.g. too few tokens for full-rank covariances), one line each.
struct CalibrationReport {
  std::vector<std::string> warnings;
};

absl::StatusOr<std::vector<LayerCalibration>> Calibrate(const ActivationDump& dump,
                                                        const CalibrationOptions& options,
                                                        CalibrationReport* report = nullptr);

// The held-out query positions scored: [train, n) evenly subsampled to max_queries.
std::vector<int64_t> HeldOutQueries(int64_t train, int64_t n, int max_queries);

// Largest / smallest of ascending eigenvalues; +inf when the smallest is not positive
// relative to the largest (a singular covariance).
double EigenSpread(const std::vector<double>& ascending);

// The codec file: version 1 (every layer one group: layers.<l>.r_k/r_v [d, d],
// rho_k/rho_v [1]) or, when any layer has one group per KV head, version 2
// (layers.<l>.r_k/r_v [Hkv, d, d], rho_k/rho_v [Hkv], metadata kvcd.codec_version = "2").
SafetensorsWriter CodecFile(const std::vector<LayerCalibration>& layers, int head_dim,
                            const std::string& source);

}  // namespace kvcd
