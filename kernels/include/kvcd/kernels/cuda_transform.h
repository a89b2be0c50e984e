// Transform-coded key pages (codec file version 3, int2-transform) on the GPU (sm_90),
// framework-free: raw device pointers, sizes and a stream; launchers return an Error (error.h) and
// never synchronize or allocate. Page layout: kvcd/kernels/transform_attention.h; key code:
// transform_codec.h; values: OSCAR INT2 rows rotated by their KV head's R_v (int2_codec.h).
//
//  - Store (LaunchStoreTransformRows): K/V rows of many tokens, all layers at once, into
//    their page slots. Keys: one thread per direction, float64 in the CPU encoder's
//    operation order with every product and sum rounded separately (__dmul_rn / __dadd_rn:
//    no FMA contraction), so codes and FP16 gains are EncodeTransformKeys' bit for bit.
//    Values: one warp per row, the INT2 row quantizer (int2_row_quantizer.cuh) with the
//    row's (layer, head) rotation and clip, DemoteRowsToInt2's bytes bit for bit.
//  - Decode attention (LaunchTransformDecodeParts): grid (splits, kv heads, batch); each CTA
//    projects its GQA group's queries into the key basis once (a = (D^T q') sigma step,
//    c_mean = q' . mean), scores every row on its codes (logit = c_mean + g (c_off +
//    sum_i a_i c_i), c_off = -sum_i a_i (2^b_i - 1) / 2), runs the online softmax, sums the
//    INT2 values in the head's rotated space and rotates its split's output back (o R_v^T)
//    before writing the part, so the parts merge with the BF16 windows' parts through
//    LaunchMergeParts (cuda_decode_attention.h) with no rotation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/error.h"
#include "kvcd/kernels/transform_attention.h"
#include "kvcd/kernels/transform_codec.h"

namespace kvcd::kernels::cuda {

// One KV head's codec as the kernels read it: DEVICE pointers (float32 unless said), d =
// head_dim. Built on the host by BuildTransformCodecImage (with the tables it derives) and
// copied to device memory by the caller ([num_layers][num_kv_heads] of them).
struct TransformHeadCodec {
  const float* k_encode_t = nullptr;  // [d][d] k_encode transposed: [j][i] = k_encode[i][j]
  const float* k_decode = nullptr;    // [d][d] as the profile: k_j = mean_j + sum_i [j][i] y_i
  const float* k_mean = nullptr;      // [d]
  const float* k_sigma = nullptr;     // [d]
  const int32_t* k_bits = nullptr;    // [d] 0..8
  // [d] sigma_i * step(b_i) in FP32 (the CPU kernel's product), 0 where b_i = 0.
  const float* k_unit = nullptr;
  // [d] where direction i's code sits in a row: (pos_i >> 5) << 16 | mask_i << 8 |
  // (pos_i & 31), pos_i = sum of the bits before i, mask_i = 2^b_i - 1 (TransformDirWord).
  const uint32_t* k_dirs = nullptr;
  const float* r_v = nullptr;    // [d][d] value rotation, row-major (x_rot = x R_v)
  const float* r_v_t = nullptr;  // [d][d] R_v transposed
  float rho_v = 1.0f;
  // R_v[0][0] when R_v is exactly c H (ClassifyRotation: kHadamard, applied by butterflies
  // as DemoteRowsToInt2 does), else 0 (dense).
  float hadamard_v = 0.0f;
  int32_t coded = 0;  // directions with b_i > 0 (they come first: bits are non-increasing)
  int32_t code_bytes = 0;
};

// Direction i of a row at bit pos with b bits, packed as TransformHeadCodec::k_dirs says.
inline uint32_t TransformDirWord(int pos, int bits) {
  return (static_cast<uint32_t>(pos) >> 5) << 16 | ((1u << bits) - 1u) << 8 |
         (static_cast<uint32_t>(pos) & 31u);
}

// What one head's codec is built from (host pointers; key.bits non-increasing, as
// KeyTransformProfile checks).
struct TransformHeadSource {
  TransformKeyCode key;
  const float* r_v = nullptr;  // [d][d]
  float rho_v = 1.0f;
};

// Bytes of the device image of num_heads head codecs of head_dim d.
size_t TransformCodecBytes(int num_heads, int head_dim);

// Fills `image` (TransformCodecBytes bytes, host) with the heads' codecs as they will lie at
// `device_base` once the image is copied there (one allocation, 256-byte aligned): every
// head's tensors and derived tables (transposes, k_unit, k_dirs, the Hadamard test), then
// the [num_heads] TransformHeadCodec array, whose device address is returned (REQUIRES:
// num_heads >= 1, one head_dim for all). With
// device_base = image the pointers are the image's own (host reads, tests).
const TransformHeadCodec* BuildTransformCodecImage(const TransformHeadSource* heads, int num_heads,
                                                   void* device_base, uint8_t* image);

// The CPU page layout's offsets, as the kernels take them (from TransformPageLayout).
struct TransformPageOffsets {
  int32_t num_kv_heads = 0, page_size = 0, head_dim = 0, code_bytes = 0;
  int64_t k_codes = 0, k_codes_head = 0;    // KCodes(0), KCodes(1) - KCodes(0)
  int64_t k_gains = 0, k_gains_head = 0;    // KGains(0), per head
  int64_t v_codes = 0, v_codes_head = 0;    // VCodes(0), per head
  int64_t v_params = 0, v_params_head = 0;  // VParams(0), per head (scales, then minimums)
  explicit TransformPageOffsets(const TransformPageLayout& l);
  TransformPageOffsets() = default;
};

// K and V rows -> their page slots (cuda_store_rows.h: RowBlock, PagedRows addressing; the
// launch covers dst.num_layers layers from the pool base dst.base). heads: [dst.num_layers]
// [num_kv_heads] codecs in DEVICE memory (entry l * num_kv_heads + h for layer l of the
// launch). With `check`: the fused non-finite check of cuda_store_rows.h (row index ((layer
// * num_tokens + token) * 2 + which) * num_kv_heads + head); a bad row is stored as the
// codes of a zero row.
// REQUIRES: dst.head_dim in {64, 128, 256} and equal to layout.head_dim, dst.num_kv_heads =
// layout.num_kv_heads, dst.page_size = layout.page_size, 1 <= code_bytes <= head_dim.
// cudaErrorInvalidValue otherwise.
Error LaunchStoreTransformRows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                               const TransformPageOffsets& layout, const TransformHeadCodec* heads,
                               cudaStream_t stream, const StoreCheck* check = nullptr);

// Split count filling one wave of the GPU for this batch and context (at least 32 tokens per
// split).
int TransformDecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms);

// The largest GQA group (num_q_heads / num_kv_heads) the decode kernel takes.
inline constexpr int kTransformCudaMaxGroup = 8;

// int2-transform pages of `list` -> parts [part_base, part_base + splits) of every row
// (rows = batch * num_q_heads; part_o [parts][rows][head_dim], part_lse [parts][rows] as
// LaunchMergeParts reads them), in the ORIGINAL value space (R_v^T applied per head); a
// split with no tokens gets o = 0, lse = -inf. heads: [num_kv_heads] codecs of the layer
// (device). q: [batch][num_q_heads][head_dim] raw queries (device, not pre-scaled).
// REQUIRES: head_dim in {64, 128, 256}, num_q_heads a multiple of num_kv_heads with group
// <= kTransformCudaMaxGroup, page_size a multiple of 32, layout matching geo, splits >= 1.
// cudaErrorInvalidValue otherwise.
Error LaunchTransformDecodeParts(const PagedList& list, const DecodeGeometry& geo,
                                 const TransformPageOffsets& layout,
                                 const TransformHeadCodec* heads, const float* q, float scale,
                                 int splits, int max_tokens, float* part_o, float* part_lse,
                                 int part_base, cudaStream_t stream);

// --- The int8 tensor-core variant (transform_decode_attention_tc.cu) ---------------------
// Same pages, same parts (original value space, mergeable with LaunchMergeParts), INT2 v2's
// arithmetic: a query-preparation kernel projects the group's queries into the key basis once
// per (sequence, KV head) and spreads them over the code row's BITS as two int8 digits (the
// logit is linear in the bits whatever the directions' widths), then the decode kernel runs
// u8 x s8 MMAs on the code rows' bit planes and INT2's integer value path.

// Which decode kernel serves int2-transform history: the FP32 one above (the reference
// variant, every geometry) or the tensor-core one (TransformTensorCoreServes).
enum class TransformKernel { kFp32, kTensorCore };

// Whether the tensor-core variant takes this geometry: head_dim 64 or 128, group <=
// kTransformCudaMaxGroup, page_size a multiple of 32, code rows of at most 3 bits per
// direction on average (ceil(code_bytes / 4) <= 3 head_dim / 32).
bool TransformTensorCoreServes(const DecodeGeometry& geo, const TransformPageOffsets& layout);

// Device scratch the tensor-core variant needs (query fragments per sequence and KV head).
size_t TransformTcStateBytes(int batch, int num_kv_heads);

// Split count of the tensor-core variant: one wave of its resident CTAs (4 per SM, 3 for
// groups above 4), at least 4 tiles (one per warp) per split.
int TransformTcDecodeSplits(int batch, int num_q_heads, int num_kv_heads, int max_tokens,
                            int num_sms);

// LaunchTransformDecodeParts' contract on the tensor cores; `state`: TransformTcStateBytes
// (batch, num_kv_heads) bytes of device scratch (written and read by this launch on `stream`).
// REQUIRES additionally: TransformTensorCoreServes, page_stride and pages 16-byte aligned.
// An Error of cudaErrorInvalidValue otherwise. Two launches on the stream (the preparation,
// then the decode kernel as its programmatic dependent). With fold (its fold_counters set,
// MergeTarget in cuda_decode_attention.h) the decode kernel takes its share of the folded
// merge.
Error LaunchTransformDecodePartsTc(const PagedList& list, const DecodeGeometry& geo,
                                   const TransformPageOffsets& layout,
                                   const TransformHeadCodec* heads, const float* q, float scale,
                                   int splits, int max_tokens, float* part_o, float* part_lse,
                                   int part_base, void* state, cudaStream_t stream,
                                   const MergeTarget* fold = nullptr);

}  // namespace kvcd::kernels::cuda
