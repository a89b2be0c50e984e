// BF16 paged decode attention on tensor cores, split-K (sm_90), framework-free: the kernel
// for long BF16 histories (and the sink/recent windows of other formats). It writes the same
// partial states as LaunchBf16DecodeParts (cuda_decode_attention.h: part_o [parts][rows][d],
// part_lse [parts][rows], natural log, -inf for a part with no tokens), so LaunchMergeParts or
// a merging INT2 launch combines them unchanged.
//
// Grid (splits, kv_heads, batch), 4 warps per CTA; a split is a run of 16-token tiles and the
// warps take every 4th one. Each K/V row is read once per CTA with 16-byte cp.async into a
// swizzled shared-memory ring per warp (3 tiles deep, 2 at head_dim 256) and serves every
// query head of the GQA group: S = Q K^T and O += P V are mma.sync m16n8k16 BF16 with
// FP32 accumulation, rows 0..7 of A the group's queries (or weights) rounded to BF16, rows
// 8..15 their remainders, so the products carry ~16 significant bits of q and p (K and V are
// BF16 already). Online softmax in FP32, base 2. bf16_split_attention.cu says more.
#pragma once

#include <cuda_runtime.h>

#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

// Which kernel attends BF16 pages: the split tensor-core kernel (LaunchBf16SplitDecodeParts)
// or the first one (LaunchBf16DecodeParts: CUDA cores, one warp per token), kept for
// comparison.
enum class Bf16Kernel { kSplit, kWarp };

// CTAs of the split kernel one SM holds (shared memory for its ring): 4 at head_dim 64, 2 at
// 128, 1 at 256; 0 for other head_dims.
int Bf16SplitCtasPerSm(int head_dim);

// The split count for a batch: one CTA per SM (Bf16SplitCtasPerSm may fit more), at least two
// 16-token tiles per warp. kWarp: Int2DecodeSplits (what the first kernel always used).
int Bf16DecodeSplits(Bf16Kernel kernel, int batch, int num_kv_heads, int head_dim, int max_tokens,
                     int num_sms);

// BF16 pages (layout of bf16_attention.h) -> parts [part_base, part_base + splits), the
// contract of LaunchBf16DecodeParts: q [batch][num_q_heads][head_dim] F32 queries rotated by
// r_k (null = none) and scaled; with raw set, the queries are read from it (checked, fault
// words set as LaunchQueriesToFloat does) and q is not used, bit for bit the same parts as
// the conversion followed by the launch; with fold (fold_counters set), the launch takes its
// share of the folded merge (MergeTarget). Tokens past lengths[b] are never read. When the
// pages or page_stride are not 16-byte aligned the first kernel runs instead (same parts).
// Thread-safe; the first launch on a device also raises the kernel's shared-memory limits
// (cudaFuncSetAttribute), which never waits for the device.
// REQUIRES: head_dim in {64, 128, 256}, num_q_heads / num_kv_heads <= 8, page_size > 0,
// splits > 0; cudaErrorInvalidValue otherwise.
Error LaunchBf16SplitDecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                                 const float* r_k, float scale, int splits, int max_tokens,
                                 float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                                 const RawQueries* raw = nullptr,
                                 const MergeTarget* fold = nullptr);

// One entry for both kernels (the daemon's BF16 format, the benchmarks).
Error LaunchBf16Parts(Bf16Kernel kernel, const PagedList& list, const DecodeGeometry& geo,
                      const float* q, const float* r_k, float scale, int splits, int max_tokens,
                      float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                      const RawQueries* raw = nullptr, const MergeTarget* fold = nullptr);

}  // namespace kvcd::kernels::cuda
