// CUDA decode attention over paged K/V (sm_90), framework-free: raw device pointers, sizes
// and a stream; launchers return an Error (error.h) and never synchronize or allocate.
//
// A sequence's pages are split by format into two lists (attention does not depend on
// token order, and only a sequence's last page can be partial): INT2 history pages and
// BF16 pages (sink and recent windows). Each list yields partial states (o_rot, lse) per
// split; one merge combines every part of a row and applies R_v^T.
//
// Pages use the layout of int2_attention.h, so both matrix products map straight onto
// int8 tensor-core MMAs (mma.sync m16n8k32): the rotated, scaled query and the softmax
// weights enter as two 8-bit digits, the codes as one masked plane of 32-bit K words (4
// consecutive elements of a token) or V words (one element of 4 consecutive tokens). The
// v2 kernel (head_dim 64/128) takes the codes as A and accumulates the value products in
// int32 across tiles; with pages of 64 tokens its warps stream their pages into shared
// memory by bulk copies (mbarrier-completed stages). The first kernel (every head_dim) takes
// the query and the weights as A and accumulates in FP32 per tile (int2_decode_v1.cu and
// int2_decode_v2.cu say more).
// Split-K: grid (splits, kv_heads, batch); partial (o_rot, lse) in FP32; a merge kernel
// combines the splits (and optional extra states, e.g. BF16 windows) and applies R_v^T.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

// Which INT2 kernel runs: kAuto picks the int32-accumulating kernel where it exists
// (head_dim 64/128) and the first kernel otherwise; kFirst forces the first kernel (per-tile
// FP32 accumulation, every head_dim), kept for head_dim 256 and for comparison.
enum class Int2Kernel { kAuto, kFirst };

struct Int2DecodeParams {
  const uint8_t* pages = nullptr;       // layer base of the INT2 pool (device)
  int64_t page_stride = 0;              // bytes between pages of the layer
  const int32_t* page_table = nullptr;  // [batch][max_pages] (device)
  int32_t max_pages = 0;
  const int32_t* lengths = nullptr;  // [batch] tokens per sequence (device)
  int32_t batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
  const float* q = nullptr;      // [batch][num_q_heads][head_dim] raw queries (device)
  const float* r_k = nullptr;    // [head_dim][head_dim] (device), null = identity
  const float* r_v_t = nullptr;  // R_v^T [head_dim][head_dim] (device), null = identity
  float softmax_scale = 0;
  int32_t num_splits = 0;     // > 0; Int2DecodeSplits(.., Int2CtasPerSm(..)) fills the GPU
  float* o = nullptr;         // [batch][num_q_heads][head_dim] (device)
  float* lse = nullptr;       // [batch][num_q_heads] natural log (device)
  void* workspace = nullptr;  // Int2DecodeWorkspaceBytes(...) bytes (device)
  Int2Kernel kernel = Int2Kernel::kAuto;
  bool dependent_launch = true;  // see Int2PartsOptions
};

// Workspace for the partial states and the v2 kernel's state (Int2StateBytes).
size_t Int2DecodeWorkspaceBytes(int batch, int num_q_heads, int head_dim, int max_splits);

// Device memory the v2 INT2 kernel (kAuto at head_dim 64/128) needs per launch besides the
// parts: the prepared query fragments. One launch at a time per buffer (stream order).
size_t Int2StateBytes(int batch, int num_kv_heads);

// The split count for a batch: one wave of ctas_per_sm CTAs of 4 warps per SM, at least one
// 32-token tile per warp.
int Int2DecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms, int ctas_per_sm = 3);

// CTAs of the INT2 kernel kAuto picks that fit on one SM (its register use): 4 for the v2
// kernel with up to 4 query heads per KV head (head_dim 64/128), 3 otherwise.
int Int2CtasPerSm(int num_q_heads, int num_kv_heads, int head_dim);

// REQUIRES: head_dim in {64, 128, 256}, num_q_heads / num_kv_heads <= 8, page_size a
// multiple of 32. Returns cudaErrorInvalidValue otherwise.
Error LaunchInt2Decode(const Int2DecodeParams& p, int max_tokens, cudaStream_t stream);

// --- The stages, for callers that combine several page lists (the daemon) ---------------
// Partial states: part_o [parts][rows][head_dim], part_lse [parts][rows] (rows =
// batch * num_q_heads); a part with no tokens has lse = -inf.

struct PagedList {
  const uint8_t* pages = nullptr;       // layer base of the pool
  int64_t page_stride = 0;              // bytes between pages of the layer
  const int32_t* page_table = nullptr;  // [batch][max_pages]
  int32_t max_pages = 0;
  const int32_t* lengths = nullptr;  // [batch] tokens in the list
};

struct DecodeGeometry {
  int32_t batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
};

// Where a launch also merges: parts [0, parts) of every row (this launch's and those earlier
// launches on the stream wrote, e.g. BF16 windows) into o / lse, times R_v^T (null = none).
// With faults ([batch] device, device_fault.h), every row of batch entry b (rows b *
// rows_per_entry ...) whose faults[b] device word is set for its tag gets NaN in o and lse:
// a pipelined caller reading the outputs of a call whose inputs were not finite sees it.
//
// fold_counters set: no merge kernel. Every launch of the call that writes parts (INT2, BF16,
// int2-transform on tensor cores) carries the same target, and the last CTA to write a part of a
// (sequence, KV head) group merges that group (merge_fold.cuh): counters [batch][num_kv_heads] on
// the device, zero before the call and zero again after it (the merging CTA resets its group's);
// the launches of one call must write exactly `parts` parts per row, at most
// MaxFoldedMergeParts(head_dim), and with faults, rows_per_entry == num_q_heads. Results agree with
// the merge kernel's to float rounding (the sums run in another order), and a sequence whose fault
// word is set, or whose raw queries (RawQueries) hold a non-finite value, is poisoned as there.
//
// wait_word set (merge kernel only, not with fold_counters): some of the parts are written on
// another stream, whose work writes wait_value into *wait_word once they are (a stream memory
// operation: cuda_stream_memops.h); the merge kernel reads no part before
// (int32_t)(*wait_word - wait_value) >= 0, so it can follow the last launch on its own stream
// as that launch's programmatic dependent instead of after a join of the two streams. It
// waits at most kMergeWaitNs; a row whose wait ran out is poisoned (o and lse NaN). Its CTAs
// (one per row, 4 x head_dim threads) hold their SM slots while they wait, so the
// other stream's grids need the rest: callers keep rows <= the SM count.
struct MergeTarget {
  int parts = 0;
  const float* r_v_t = nullptr;
  float* o = nullptr;
  float* lse = nullptr;
  const DeviceFault* faults = nullptr;
  int rows_per_entry = 1;
  unsigned int* fold_counters = nullptr;
  const uint32_t* wait_word = nullptr;
  uint32_t wait_value = 0;
};
inline constexpr int64_t kMergeWaitNs = 1'000'000'000;

// The most parts a folded merge takes at head_dim (the merging CTA keeps their weights in the
// shared memory its part no longer needs).
int MaxFoldedMergeParts(int head_dim);

// The worker's queries as they arrive, for launches that read them in place of converted F32
// queries (one launch fewer per call): q [batch][num_q_heads][head_dim] BF16 (bf16) or F32 on
// the device; each value is read as LaunchQueriesToFloat converts it (a NaN or ±Inf becomes 0
// and sets its sequence's fault words, faults [batch] or null, layer fault_layer), so the
// results are bit for bit those of the conversion followed by the same launch on its output.
struct RawQueries {
  const void* q = nullptr;
  bool bf16 = false;
  const DeviceFault* faults = nullptr;
  int64_t fault_layer = 0;
};

struct Int2PartsOptions {
  Int2Kernel kernel = Int2Kernel::kAuto;
  void* state = nullptr;  // v2 kernel: Int2StateBytes(batch, num_kv_heads) bytes (device)
  // Null: leave the parts for LaunchMergeParts. Otherwise the merge kernel follows (after
  // the v2 kernel as its programmatic dependent, so its launch overlaps the decode tail), or,
  // with merge->fold_counters, the launch folds its share of the merge (MergeTarget).
  const MergeTarget* merge = nullptr;
  // v2 kernel: launch it as the programmatic dependent of its query preparation, and the
  // merge as its dependent (each starts while the previous grid runs); false: plain
  // launches, one grid after the other.
  bool dependent_launch = true;
  // Set: the queries are read from here (checked) and the q argument is not used.
  const RawQueries* raw = nullptr;
};

// INT2 pages -> parts [part_base, part_base + splits). q: [batch][num_q_heads][head_dim]
// raw queries, rotated by r_k (null = none) and scaled (by a small kernel before the v2
// kernel, which starts as its programmatic dependent; inside the first kernel). With
// opt.merge the launch also produces o / lse. Same requirements as above; the v2 kernel
// also needs opt.state.
Error LaunchInt2DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                            const float* r_k, float scale, int splits, int max_tokens,
                            float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                            const Int2PartsOptions& opt = {});

// BF16 pages (layout of bf16_attention.h) -> parts [part_base, part_base + splits); with raw
// set, the queries are read from it (checked) and q is not used; with fold (its
// fold_counters set, see MergeTarget) the launch takes its share of the folded merge.
// REQUIRES: head_dim in {64, 128, 256}, num_q_heads / num_kv_heads <= 8.
Error LaunchBf16DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                            const float* r_k, float scale, int splits, int max_tokens,
                            float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                            const RawQueries* raw = nullptr, const MergeTarget* fold = nullptr);

// o[row] = merge of the parts of row, times R_v^T (null = identity); lse natural log;
// faults / rows_per_entry as in MergeTarget.
Error LaunchMergeParts(const float* part_o, const float* part_lse, int parts, int rows,
                       int head_dim, const float* r_v_t, float* o, float* lse, cudaStream_t stream,
                       const DeviceFault* faults = nullptr, int rows_per_entry = 1);

// The merge of m.parts parts per row into m.o / m.lse, waiting for m.wait_word if set
// (MergeTarget); `dependent`: launched as the programmatic dependent of the previous launch
// on `stream` (it waits for that grid before reading parts). REQUIRES: no fold_counters.
Error LaunchMergeTarget(const MergeTarget& m, const float* part_o, const float* part_lse, int rows,
                        int head_dim, cudaStream_t stream, bool dependent);

}  // namespace kvcd::kernels::cuda
