// Transformer-FSQ kernels on the CPU (docs/fsq.md, docs/formats.md "fsq"): encode residuals to
// 4-bit latent codes, and decode attention computed on the codes (keys rebuilt per token
// in registers, never written; values as W_v (Σ a_t z_t) + b_v).
//
// Layout of one layer of one FSQ page: codes [page_size][FsqCodeBytes(G)] (token-major,
// coordinate 2i in the low nibble of byte i, 2i+1 in the high nibble, stored as z + 8).
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::kernels {

inline constexpr double kFsqH = 7.5075;
inline constexpr double kFsqDelta = 0.5;
inline constexpr int kFsqMaxLatent = 4096;

inline int64_t FsqCodeBytes(int latent_width) { return (int64_t{latent_width} + 1) / 2; }
inline int64_t FsqPageBytes(int32_t page_size, int latent_width) {
  return int64_t{page_size} * FsqCodeBytes(latent_width);
}

// The codec of one layer (all pointers F32, row-major, owned by the caller).
struct FsqLayerCodec {
  int32_t residual_width = 0;           // C
  int32_t latent_width = 0;             // G
  int32_t num_kv_heads = 0;             // Hkv
  int32_t head_dim = 0;                 // d
  const float* encoder = nullptr;       // [G][C]
  const float* encoder_bias = nullptr;  // [G]
  const float* decoder_k = nullptr;     // [Hkv*d][G]
  const float* decoder_v = nullptr;     // [Hkv*d][G]
  const float* bias_k = nullptr;        // [Hkv*d]
  const float* bias_v = nullptr;        // [Hkv*d]
  const float* key_norm = nullptr;      // [d], nullptr = no key norm
  float key_norm_eps = 1e-6f;
};

enum class RopePairing { kHalf = 0, kInterleaved = 1 };

struct RopeSpec {
  double theta = 10000.0;
  int32_t rotary_dims = 0;  // even, <= head_dim
  double scaling = 1.0;     // position = token index / scaling
  RopePairing pairing = RopePairing::kHalf;
};

// Encodes `tokens` residual rows x [tokens][C] into packed codes [tokens][FsqCodeBytes(G)]
// exactly as docs/fsq.md (float64 accumulation, round half to even): the one definition
// of a code, whatever the ISA (`isa` picks the implementation, every one gives the same bits).
// A NaN in u gives z = 0; callers reject non-finite residuals before encoding.
void FsqEncodeRows(const FsqLayerCodec& codec, const float* x, int64_t tokens, uint8_t* codes,
                   CpuIsa isa = ActiveCpuIsa());

// The rounding of a latent as 15 thresholds, found from the encoder's own arithmetic: the
// code of u = sum_c E[g][c] x[c] + e[g] (float64) is -8 + #{k : u >= thresholds[k]}
// (NaN: 0), the same as FsqEncodeRows gives, ties and saturation included (the rounding is
// nondecreasing in u). For encoders that do not run this file's code (the GPU's).
inline constexpr int kFsqThresholds = 15;
void FsqLatentThresholds(double thresholds[kFsqThresholds]);

// Unpacks one token's code to z in {-8..7} (G values).
void FsqUnpackCode(const uint8_t* code, int latent_width, int8_t* z);

// Rebuilds K/V rows of one token at absolute position `position` from its code:
// k [Hkv][d] (key norm and RoPE applied, i.e. post-RoPE as a worker sends it), v [Hkv][d].
void FsqExpandToken(const FsqLayerCodec& codec, const RopeSpec& rope, const uint8_t* code,
                    int64_t position, float* k, float* v);

struct FsqPageTable {
  const uint8_t* base = nullptr;      // layer base of the pool
  int64_t page_stride = 0;            // bytes between consecutive pages of the layer
  const int32_t* page_ids = nullptr;  // [num_pages]
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int64_t first_position = 0;  // absolute position of token 0 of page_ids[0]
};

// Attention of the `group` query heads of KV head `kv_head` over tokens
// [token_begin, token_end) of the table (token t in page t/page_size, RoPE position
// first_position + t).
//   q: [group][head_dim] post-RoPE query, NOT pre-scaled
//   o: [group][head_dim] output (value space, W_v and b_v applied); lse: [group], natural log
// An empty range gives o = 0, lse = -inf.
void AttendFsqPages(const FsqPageTable& pages, const FsqLayerCodec& codec, const RopeSpec& rope,
                    int kv_head, const float* q, int group, float softmax_scale,
                    int64_t token_begin, int64_t token_end, float* o, float* lse,
                    CpuIsa isa = ActiveCpuIsa());

// The scalar oracle: rebuilds every key and value in double and computes softmax attention
// in double. Same arguments as AttendFsqPages.
void AttendFsqPagesReference(const FsqPageTable& pages, const FsqLayerCodec& codec,
                             const RopeSpec& rope, int kv_head, const float* q, int group,
                             float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                             float* lse);

}  // namespace kvcd::kernels
