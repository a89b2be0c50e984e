// The merge of split-K decode parts every format uses (LaunchMergeParts, and LaunchMerge for
// the INT2 launch that chains it as a programmatic dependent).
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda_error.cuh"
#include "decode_parts.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/device_fault.h"

namespace kvcd::kernels::cuda {
namespace {

// Merges the parts of each (b, head) row and applies R_v^T; one block per row of
// kMergeLanes * D threads: the split weights exp(lse_s - M) are computed once in shared
// memory, each of the kMergeLanes thread groups sums every kMergeLanes-th part and a
// quarter of the R_v^T products. A thread's R_v^T values are loaded before the wait for
// the decode grid (they do not depend on it), so after it only the parts are read.
constexpr int kMergeLanes = 4;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// True once (int32_t)(*word - value) >= 0; false if that took longer than kMergeWaitNs (the
// writer's stream stuck: the row is poisoned rather than the daemon's stream held forever).
__device__ bool WaitForWord(const uint32_t* word, uint32_t value) {
  const uint64_t start = GlobalTimerNs();
  for (unsigned sleep = 32;; sleep = sleep < 256 ? 2 * sleep : sleep) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
    if (static_cast<int32_t>(v - value) >= 0) return true;
    if (GlobalTimerNs() - start > static_cast<uint64_t>(kMergeWaitNs)) return false;
    __nanosleep(sleep);
  }
}

// wait_word: see MergeTarget. The parts are read through L2 (__ldcg): those written on the
// other stream land while this grid runs.
// clang-format off
template <int D>
__global__ void __launch_bounds__(kMergeLanes * D) MergeSplits(
    const float* part_o, const float* part_lse, int splits, int rows, const float* r_v_t,
    float* o, float* lse, const DeviceFault* faults, int rows_per_entry,
    const uint32_t* wait_word, uint32_t wait_value) {
  // clang-format on
  constexpr int kPer = D / kMergeLanes;
  extern __shared__ float wts[];  // [splits]: lse, then exp(lse - M)
  __shared__ float x[D], partial[kMergeLanes][D];
  __shared__ float s_max[32], s_den[32];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = tid / D, j = tid % D;
  float r[kPer];
  if (r_v_t != nullptr) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) r[u] = __ldg(r_v_t + (group * kPer + u) * D + j);
  }
  __shared__ bool s_late;
  WaitPrimaryGrid();  // launched as a programmatic dependent of the decode kernel, or plainly
  if (wait_word != nullptr) {  // parts written on another stream (MergeTarget::wait_word)
    if (tid == 0) s_late = !WaitForWord(wait_word, wait_value);
    __syncthreads();
  }
  const bool late = wait_word != nullptr && s_late;
  // A faulted sequence (device_fault.h). Read after the wait: the words are written by the
  // row stores, the query conversion or the kernels reading raw queries (QueryFragments, whose
  // completion every CTA of the decode grid waits for before this grid's wait returns).
  bool poison = false;
  if (faults != nullptr) {
    const DeviceFault f = faults[row / rows_per_entry];
    poison =
        f.tag != 0 &&
        FaultMatches(*reinterpret_cast<const volatile unsigned long long*>(f.device_word), f.tag);
  }
  poison = poison || late;
  constexpr int warps = kMergeLanes * D / 32;
  float mx = -INFINITY;
  for (int s = tid; s < splits; s += blockDim.x) {
    wts[s] = __ldcg(part_lse + static_cast<int64_t>(s) * rows + row);
    mx = fmaxf(mx, wts[s]);
  }
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) s_max[warp] = mx;
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < warps; ++w) M = fmaxf(M, s_max[w]);
  float den = 0.0f;
  for (int s = tid; s < splits; s += blockDim.x) {
    const float ls = wts[s];
    const float f = (M > -INFINITY && ls > -INFINITY) ? __expf(ls - M) : 0.0f;
    wts[s] = f;
    den += f;
  }
  for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
  if (lane == 0) s_den[warp] = den;
  __syncthreads();
  den = 0.0f;
#pragma unroll
  for (int w = 0; w < warps; ++w) den += s_den[w];
  float num = 0.0f;
#pragma unroll 16
  for (int s = group; s < splits; s += kMergeLanes) {
    num += wts[s] * __ldcg(part_o + (static_cast<int64_t>(s) * rows + row) * D + j);
  }
  partial[group][j] = num;
  __syncthreads();
  if (group == 0) {
    const float total = (partial[0][j] + partial[1][j]) + (partial[2][j] + partial[3][j]);
    x[j] = den > 0.0f ? total / den : 0.0f;
  }
  __syncthreads();
  // o = x R_v^T: each thread group sums a quarter of the terms.
  if (r_v_t != nullptr) {
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < kPer; ++u) acc = fmaf(x[group * kPer + u], r[u], acc);
    partial[group][j] = acc;
    __syncthreads();
  }
  if (group != 0) return;
  const float out =
      r_v_t == nullptr ? x[j] : (partial[0][j] + partial[1][j]) + (partial[2][j] + partial[3][j]);
  o[static_cast<int64_t>(row) * D + j] = poison ? NAN : out;
  if (j == 0) lse[row] = poison ? NAN : den > 0.0f ? M + logf(den) : -INFINITY;
}

size_t MergeSmemBytes(int parts) { return parts * sizeof(float); }

}  // namespace

// The merge kernel for the head_dim, launched plainly or as a programmatic dependent.
cudaError_t LaunchMerge(const float* part_o, const float* part_lse, int parts, int rows,
                        int head_dim, const float* r_v_t, float* o, float* lse, cudaStream_t stream,
                        bool dependent, const DeviceFault* faults, int rows_per_entry,
                        const uint32_t* wait_word, uint32_t wait_value) {
  if (faults != nullptr && rows_per_entry <= 0) return cudaErrorInvalidValue;
  auto go = [&](auto kernel, int d) {
    return LaunchDependent(dependent, kernel, dim3(rows), dim3(kMergeLanes * d),
                           MergeSmemBytes(parts), stream, part_o, part_lse, parts, rows, r_v_t, o,
                           lse, faults, rows_per_entry, wait_word, wait_value);
  };
  return DispatchHeadDim(head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    return go(MergeSplits<kD>, kD);
  });
}

int MaxFoldedMergeParts(int head_dim) {
  // The merging CTA's weights live in its s_o (kWarps x >= G x D floats) beside the G rows:
  // G * parts + G * D + 16 <= kWarps * G * D (FoldSmemFloats).
  return head_dim == 64 || head_dim == 128 || head_dim == 256 ? (kWarps - 1) * head_dim - 16 : 0;
}

Error LaunchMergeParts(const float* part_o, const float* part_lse, int parts, int rows,
                       int head_dim, const float* r_v_t, float* o, float* lse, cudaStream_t stream,
                       const DeviceFault* faults, int rows_per_entry) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(LaunchMerge(part_o, part_lse, parts, rows, head_dim, r_v_t, o, lse, stream,
                             /*dependent=*/false, faults, rows_per_entry, nullptr, 0));
}

Error LaunchMergeTarget(const MergeTarget& m, const float* part_o, const float* part_lse, int rows,
                        int head_dim, cudaStream_t stream, bool dependent) {
  KVCD_CUDA_BIND_THREAD();
  if (m.fold_counters != nullptr || m.parts <= 0 || rows <= 0) {
    return ToError(cudaErrorInvalidValue);
  }
  return ToError(LaunchMerge(part_o, part_lse, m.parts, rows, head_dim, m.r_v_t, m.o, m.lse, stream,
                             dependent, m.faults, m.rows_per_entry, m.wait_word, m.wait_value));
}

}  // namespace kvcd::kernels::cuda
