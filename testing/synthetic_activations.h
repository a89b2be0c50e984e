// Synthetic post-RoPE attention activations with the structure that makes KV
// quantization hard, for tests, benchmarks and evaluation (seedable, deterministic):
//  - outlier channels in K: a few RoPE-paired channel pairs (i, i + d/2) per KV head with
//    a large scale and a consistent offset, as measured in real LLM keys;
//  - RoPE: NeoX-style rotation of pairs (i, i + d/2) by position * theta^(-2i/d);
//  - low-rank query covariance: q = A z + small noise with z in R^query_rank;
//  - attention sinks: the first sink_tokens tokens have keys aligned with the mean query
//    direction (large logits for every query) and small values;
//  - values: Gaussian with a few moderately large channels.
// Layout matches the activation dumps of kvcd-calibrate: per layer q [n][Hq][d],
// k [n][Hkv][d], v [n][Hkv][d] (float).
#pragma once

#include <cstdint>
#include <vector>

#include "common/layer_activations.h"

namespace kvcd {

struct ActivationSpec {
  int num_layers = 1;
  int num_q_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 128;
  int64_t tokens = 512;
  uint64_t seed = 1;
  int outlier_pairs = 3;  // per KV head
  float outlier_scale = 6.0f;
  int query_rank = 8;
  float query_scale = 0.25f;  // |q| ~ query_scale * sqrt(head_dim): logits of O(1..10)
  int sink_tokens = 4;
  float sink_strength = 4.0f;
  double rope_theta = 10000.0;
};

// REQUIRES: head_dim even, num_q_heads % num_kv_heads == 0.
std::vector<LayerActivations> GenerateActivations(const ActivationSpec& spec);

}  // namespace kvcd
