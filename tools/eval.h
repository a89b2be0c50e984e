// kvcd-eval's core: for an activation dump and a set of codecs, simulate the daemon's
// storage path (BF16 sink and recent windows, everything between through the codec) and
// measure what each codec costs in attention quality.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/activation_dump.h"
#include "common/fsq_codec.h"
#include "common/safetensors.h"
#include "kvcd/kernels/fsq.h"
#include "tools/int2_layer.h"

namespace kvcd {

struct EvalCodec {
  enum class Kind { kBf16, kInt2, kKivi2, kFsq, kRows };
  std::string name;
  Kind kind = Kind::kBf16;
  // INT2: per layer the rotations and clip quantiles (per layer or per KV head).
  std::vector<Int2Layer> int2;
  // FSQ (docs/fsq.md): history K/V rebuilt from the codes of the dump's residuals; dump row
  // t is RoPE position t (the dump must be one sequence).
  FsqCodec fsq;
  kernels::RopeSpec rope;
  // kRows: any per-row history code, given as its round trip of layer l's K (which = 0) or
  // V (which = 1) rows [n][hkv][d] into `out` (same shape), and its honest stored bits per
  // K row and per V row and per-model bytes (the study codecs of tools/int2_study_main).
  std::function<void(int layer, int which, const std::vector<float>& rows, int64_t n,
                     std::vector<float>* out)>
      round_trip;
  double row_bits_k = 0, row_bits_v = 0, rows_fixed_bytes = 0;
};

struct EvalOptions {
  int64_t sink = 64;            // BF16 sink window (INT2 codecs)
  int64_t recent = 256;         // BF16 recent window (INT2 codecs)
  int kivi_group = 32;          // KIVI-2 group size (tokens for K, channels for V)
  int64_t kivi_residual = 128;  // KIVI-2 FP16 residual window
  int positions = 16;           // query positions evaluated, spread over the dump
  int64_t min_position = 0;     // first position evaluated (default: past the windows)
};

struct EvalStats {
  double kl_mean = 0, kl_p99 = 0, out_err = 0, logit_err = 0;
};

struct CodecResult {
  std::string name;
  std::vector<EvalStats> layers;
  EvalStats overall;
  double bits_per_element = 0;  // at the dump's full context, windows included
  double bytes_per_token = 0;   // all layers, K and V (FSQ: codes), windows included
  double compression = 0;       // dense BF16 K/V bytes / bytes_per_token
  double fixed_bytes = 0;       // per model, not per token: the codec's tensors
  std::vector<std::pair<int64_t, double>> out_err_by_position;  // mean over layers, heads
  std::string warning;  // non-empty when the figures do not measure the codec (short dump)
};

// INVALID_ARGUMENT when a codec does not fit the dump, or when the dump is too short for
// any evaluated position to have codec-stored history (tokens <= sink + recent for INT2
// and FSQ): that would report the codec equal to BF16. A dump shorter than KIVI-2's FP16
// residual window plus one group gets CodecResult::warning instead (kivi2 is a standard
// codec, and the short dumps of the small-window FSQ runs are otherwise fine).
absl::StatusOr<std::vector<CodecResult>> Evaluate(const ActivationDump& dump,
                                                  const std::vector<EvalCodec>& codecs,
                                                  const EvalOptions& options);

// An OSCAR INT2 codec file (version 1: CodecProfile; version 2: one rotation and clip pair
// per KV head, layers.<l>.r_k/r_v [Hkv, d, d], rho_k/rho_v [Hkv]) for the dump's
// geometry; INVALID_ARGUMENT naming what does not fit (layer count, shapes, orthogonality).
absl::StatusOr<EvalCodec> LoadInt2Codec(const SafetensorsFile& file, const ActivationDump& dump,
                                        const std::string& name);

// The standard codecs: bf16, naive INT2 (identity), Hadamard INT2, KIVI-2.
std::vector<EvalCodec> StandardCodecs(int num_layers, int head_dim);

}  // namespace kvcd
