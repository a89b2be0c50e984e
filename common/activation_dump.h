// Activation dumps: post-RoPE attention activations of a model on some prompts, the input
// of kvcd-calibrate and kvcd-eval. One safetensors file:
//   layers.<l>.q  [n, num_q_heads, head_dim]   F32, F16 or BF16
//   layers.<l>.k  [n, num_kv_heads, head_dim]
//   layers.<l>.v  [n, num_kv_heads, head_dim]
//   layers.<l>.x  [n, residual_width]          optional (FSQ, docs/fsq.md): the attention
//                                               block's normalized residual (after the input
//                                               norm, before the Q/K/V projections)
//   metadata: "kvcd.dump" = "1", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
//             "tokens" (decimal strings), optional "source"; "residual_width" (C) iff the
//             layers carry x (then every layer does).
// Tokens of several prompts may be concatenated: calibration does not depend on the order;
// kvcd-eval reads the dump as one sequence (causal attention over everything before a query).
// tools/dump_activations.py writes this layout from a Hugging Face model;
// `kvcd-calibrate synth` writes it from the synthetic generator.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "layer_activations.h"
#include "safetensors.h"

namespace kvcd {

struct ActivationDump {
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;
  std::string source;
  std::vector<LayerActivations> layers;
  int residual_width = 0;             // C; 0 = the dump carries no residuals
  std::vector<std::vector<float>> x;  // per layer [tokens][residual_width] (empty if C = 0)
};

// Reads and checks a dump (INVALID_ARGUMENT naming the tensor or key; NOT_FOUND if absent).
absl::StatusOr<ActivationDump> LoadActivationDump(const std::string& path);
// The same checks on a parsed file (`path` only names it in messages).
absl::StatusOr<ActivationDump> ParseActivationDump(const SafetensorsFile& file,
                                                   const std::string& path);
// Writes a dump with F32 tensors.
absl::Status WriteActivationDump(const ActivationDump& dump, const std::string& path);

}  // namespace kvcd
