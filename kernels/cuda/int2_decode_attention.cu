// The host entry points of the OSCAR INT2 decode attention (cuda_decode_attention.h): sizes,
// splits, and the launch of one of the two kernels (int2_decode_v1.cu, int2_decode_v2.cu)
// with the merge (merge_splits.cu) chained after it.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_error.cuh"
#include "decode_parts.cuh"
#include "device_binding.cuh"
#include "int2_decode.cuh"
#include "kvcd/kernels/cuda_decode_attention.h"

namespace kvcd::kernels::cuda {
namespace {

Int2State CarveState(void* state, int batch, int num_kv_heads) {
  const int64_t n = static_cast<int64_t>(batch) * num_kv_heads;
  Int2State st;
  st.frags = static_cast<uint32_t*>(state);
  st.scal = reinterpret_cast<float*>(st.frags + n * kFragWords);
  return st;
}

}  // namespace

size_t Int2StateBytes(int batch, int num_kv_heads) {
  return static_cast<size_t>(batch) * num_kv_heads *
         (sizeof(uint32_t) * kFragWords + sizeof(float) * kScalFloats);
}

size_t Int2DecodeWorkspaceBytes(int batch, int num_q_heads, int head_dim, int max_splits) {
  const size_t rows = static_cast<size_t>(batch) * num_q_heads;
  // parts, then the v2 kernel's state (sized for up to one KV head per query head)
  return sizeof(float) * static_cast<size_t>(max_splits) * rows * (head_dim + 1) +
         Int2StateBytes(batch, num_q_heads);
}

int Int2DecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms, int ctas_per_sm) {
  // As many splits as fit in one wave of resident CTAs (a second, partial wave would double
  // the time of the last CTAs), at least one 32-token tile per warp.
  const int ctas = batch * num_kv_heads;
  int splits = ctas_per_sm * num_sms / ctas;
  const int max_by_tokens = (max_tokens + kWarps * kTile - 1) / (kWarps * kTile);
  splits = splits < max_by_tokens ? splits : max_by_tokens;
  return splits < 1 ? 1 : splits;
}

Error LaunchInt2DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                            const float* r_k, float scale, int splits, int max_tokens,
                            float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                            const Int2PartsOptions& opt) {
  KVCD_CUDA_BIND_THREAD();
  const bool v2 = opt.kernel == Int2Kernel::kAuto && geo.head_dim <= 128;
  if (!SupportedGeometry(geo) || geo.page_size % kTile != 0 || splits <= 0 ||
      (v2 && opt.state == nullptr) ||
      (opt.merge != nullptr && opt.merge->parts < part_base + splits)) {
    return ToError(cudaErrorInvalidValue);
  }
  const int per_split = TokensPerSplit(max_tokens, splits, v2 ? kWarps * 2 * kTile : kTile);
  PartArgs a{list, geo, q, r_k, scale, per_split, part_o, part_lse, part_base};
  SetRawQueries(opt.raw, &a);
  const bool fold = opt.merge != nullptr && opt.merge->fold_counters != nullptr;
  if (fold && !SetFold(*opt.merge, geo, part_base, splits, &a.fold)) {
    return ToError(cudaErrorInvalidValue);
  }
  const dim3 grid(splits, geo.num_kv_heads, geo.batch);
  cudaError_t e = cudaSuccess;
  if (v2) {
    a.state = CarveState(opt.state, geo.batch, geo.num_kv_heads);
    e = LaunchInt2V2(grid, a, stream, opt.dependent_launch);
  } else {
    e = LaunchInt2V1(grid, a, stream);
  }
  if (e != cudaSuccess || opt.merge == nullptr || fold) return ToError(e);
  // The merge as the decode kernel's programmatic dependent: its launch overlaps the tail
  // of the decode grid (which signals once every CTA is past its loop).
  const MergeTarget& m = *opt.merge;
  const int rows = geo.batch * geo.num_q_heads;
  return ToError(LaunchMerge(part_o, part_lse, m.parts, rows, geo.head_dim, m.r_v_t, m.o, m.lse,
                             stream,
                             /*dependent=*/v2 && opt.dependent_launch, m.faults, m.rows_per_entry,
                             m.wait_word, m.wait_value));
}

Error LaunchInt2Decode(const Int2DecodeParams& p, int max_tokens, cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  const DecodeGeometry geo{p.batch, p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size};
  if (!SupportedGeometry(geo) || p.page_size % kTile != 0 || p.num_splits <= 0) {
    return ToError(cudaErrorInvalidValue);
  }
  const int rows = p.batch * p.num_q_heads;
  float* part_o = static_cast<float*>(p.workspace);
  float* part_lse = part_o + static_cast<size_t>(p.num_splits) * rows * p.head_dim;
  const PagedList list{p.pages, p.page_stride, p.page_table, p.max_pages, p.lengths};
  const MergeTarget merge{p.num_splits, p.r_v_t, p.o, p.lse};
  Int2PartsOptions opt;
  opt.kernel = p.kernel;
  opt.dependent_launch = p.dependent_launch;
  opt.state = part_lse + static_cast<size_t>(p.num_splits) * rows;
  opt.merge = &merge;
  return LaunchInt2DecodeParts(list, geo, p.q, p.r_k, p.softmax_scale, p.num_splits, max_tokens,
                               part_o, part_lse, 0, stream, opt);
}

}  // namespace kvcd::kernels::cuda
