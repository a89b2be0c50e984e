// Deterministic synthetic prompts and K/V for demos, tools and load tests: the same
// (seed, position) always gives the same token and the same K/V rows, so a prefill
// worker and a decode worker that share a seed agree on the prompt without talking.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fsq_codec.h"
#include "kvcd/v1/kvcache.pb.h"

namespace kvcd::synthetic {

// Token id of position `pos` of the stream `seed` (in [0, vocab)).
int32_t Token(uint64_t seed, int64_t pos, int32_t vocab = 32000);
std::vector<int32_t> Tokens(uint64_t seed, int64_t begin, int64_t n, int32_t vocab = 32000);

// Value in [-1, 1) for element (layer, pos, head, dim, kind) of stream `seed`; kind 0 = K,
// 1 = V, 2 = Q. Keys depend on the token at `pos`, so equal prefixes give equal K/V.
float Value(uint64_t seed, int32_t layer, int64_t pos, int32_t head, int32_t dim, int kind);

// K or V of tokens [begin, begin + n): [layers][n][kv_heads][head_dim] floats.
std::vector<float> Kv(uint64_t seed, const v1::ModelProfile& p, int64_t begin, int64_t n, int kind);

// One token at one layer: [kv_heads][head_dim] (kind 0/1) or [q_heads][head_dim] (kind 2).
std::vector<float> Row(uint64_t seed, const v1::ModelProfile& p, int32_t layer, int64_t pos,
                       int kind);

// FSQ residuals (kind 3) of tokens [begin, begin + n): [layers][n][fsq_residual_width],
// and of one token at one layer: [fsq_residual_width].
std::vector<float> Residuals(uint64_t seed, const v1::ModelProfile& p, int64_t begin, int64_t n);
std::vector<float> ResidualRow(uint64_t seed, const v1::ModelProfile& p, int32_t layer,
                               int64_t pos);

// A synthetic FSQ codec (FsqCodec::Synthetic with `seed`) of an FSQ model profile's shape:
// its layers, residual and latent widths, KV heads, head_dim and key norm.
FsqCodec FsqCodecFor(const v1::ModelProfile& p, uint64_t seed);

// A Put of tokens [0, n) of stream `seed` for model p under `salt`: K and V as BF16, and the
// FSQ residuals when the model takes them.
v1::PutRequest Put(uint64_t seed, const v1::ModelProfile& p, int64_t n,
                   const std::string& salt = "");

}  // namespace kvcd::synthetic
