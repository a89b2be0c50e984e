// Per layer and KV head transform codes (tools/transform_codec.h) fitted to a calibration
// dump: keys under the logit-error metric (the second moment of the head's query group),
// values under the output-error metric (identity); with the rate-distortion figures that
// predict, from the measured spectra alone, what the allocation can gain over Hadamard INT2.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/key_transform_profile.h"
#include "tools/eval.h"
#include "tools/transform_codec.h"

namespace kvcd {

struct TransformCalibrationOptions {
  TransformFitOptions k, v;
  int64_t first_row = 64;     // rows before it (the BF16 sink) are not fitted: never coded
  bool uniform_bits = false;  // control: bits spread evenly, same basis and budget
};

// Spectral predictions for one K or V head, all in the head's error metric (per row):
// Hadamard INT2 modelled as 2-bit Gaussian quantization of d equal-variance coordinates
// (tr(W) tr(C) / d each), the allocated code's model distortion, the same basis at uniform
// 2.25 bits, and the Gaussian rate-distortion floor at the full 160 bits.
struct HeadPrediction {
  double hadamard = 0, allocated = 0, uniform = 0, rd_floor = 0;
};

struct TransformCalibration {
  // [layer][kv head] for K and for V.
  std::vector<std::vector<TransformCodec>> k, v;
  std::vector<std::vector<HeadPrediction>> pred_k, pred_v;
};

absl::StatusOr<TransformCalibration> CalibrateTransforms(const ActivationDump& dump,
                                                         const TransformCalibrationOptions& opt);

// The codec as a kvcd-eval row code. keep: 0 both coded, 1 only K coded (V exact), 2 only V.
EvalCodec TransformEvalCodec(std::shared_ptr<const TransformCalibration> cal,
                             const std::string& name, int hkv, int keep = 0);

// Values for the version-3 code: Hadamard INT2 with one clip quantile per KV head, searched
// over ClipGrid(clip_floor) on the attention-output error of the dump's last `holdout`
// fraction of queries (max_queries of them), keys through `cal`'s transform code, history
// rows only (windows BF16).
std::vector<Int2Layer> SearchValueClips(const ActivationDump& dump, const TransformCalibration& cal,
                                        double holdout, int max_queries, float clip_floor,
                                        const StoredWindows& windows);

// Codec file version 3: keys from `cal`, values INT2 through `values` (one Int2Layer per
// layer, per layer or per KV head).
std::vector<KeyTransformProfile::Head> KeyTransformHeads(const TransformCalibration& cal,
                                                         const std::vector<Int2Layer>& values);

// The round trip of a version-3 file: keys through the transform code, values through INT2.
EvalCodec KeyTransformEvalCodec(const KeyTransformProfile& profile, const std::string& name);

}  // namespace kvcd
