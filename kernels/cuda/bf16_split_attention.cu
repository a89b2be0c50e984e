// BF16 paged decode attention on tensor cores, split-K (cuda_bf16_split_attention.h).
//
// Grid (splits, kv_heads, batch), 4 warps per CTA. A split is a run of 16-token tiles; warp w
// takes tiles w, w + 4, ... Each warp streams its tiles through its own ring of kStages
// shared-memory stages (K tile [16][d] then V tile [16][d], BF16) with 16-byte cp.async,
// kStages - 1 tiles ahead of the one it computes; a token past the sequence is zero-filled
// (src-size 0), so stale slots are never read. A 16-byte chunk c of tile row r sits at chunk
// c ^ (r & 7) of the row, so the 8 row addresses of every ldmatrix hit distinct banks.
// Lane r < 16 of the warp finds row r's page (page table read one tile ahead), the copies
// take it by shuffle: any page_size works.
//
// mma.sync.m16n8k16 BF16 fragments (g = lane / 4, t = lane % 4):
//   A (16 x 16, row): a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g,
//                     k 2t+8..2t+9), a3 = (row g+8, k 2t+8..)  (low half = lower k)
//   B (16 x 8, col):  b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g)
//   C (16 x 8):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols)
// Rows of A are (head, digit): row h < 8 holds head h's value rounded to BF16, row h + 8 what
// the rounding left (also rounded), so one lane holds both digits of one head and the
// product of the pair is c0 + c2 (c1 + c3): ~16 significant bits of q and p, K and V exact.
//   S = Q K^T per 8 keys: A = the scaled queries (registers, built once), B = K rows as
//       stored ([key][dim] is the col-major B): ldmatrix.x4 gives b0, b1 of two key blocks.
//   Online softmax per head in base 2 (scale * log2(e) folded into q): a lane holds keys
//       2t, 2t+1, 8+2t, 9+2t of head g; the row max is a quad shuffle.
//   O += P V over the 16 keys: the weights' C layout of S is exactly P's A layout (keys 2t..
//       in registers a0/a2 for digit rows g, a1/a3 for g+8); B = V rows transposed by
//       ldmatrix.x4.trans. O is 16 x d in d/8 accumulators, head g = c0 + c2.
// At the end the CTA merges its warps' (m, l, o) in shared memory (reusing the rings) and
// writes part (part_base + split) of each head: o / l and lse = ln 2 * (m + log2 l).
#include <cuda_bf16.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "merge_fold.cuh"
#include "programmatic_launch.cuh"
#include "query_input.cuh"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTile = 16;  // tokens per warp tile: one k-step of P V
constexpr int kMaxGroup = 8;
constexpr int kMinTilesPerWarp = 2;  // splits never cut below this many tiles per warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Ring depth, bytes of one stage (K and V tiles), and the CTAs an SM holds (shared memory:
// 48 KB, 96 KB, 128 KB of rings plus 4, 8, 16 KB of queries).
template <int D>
constexpr int kStages = D == 256 ? 2 : 3;
template <int D>
constexpr int kStageBytes = 2 * kTile* D * 2;
template <int D>
constexpr int kRingBytes = kWarps* kStages<D>* kStageBytes<D>;
template <int D>
constexpr int kCtasPerSm = D == 64    ? 4
                           : D == 128 ? 2
                                      : 1;

struct SplitArgs {
  PagedList list;
  DecodeGeometry geo;
  const float* q;    // [batch][num_q_heads][D] F32 queries (unless q_raw)
  const float* r_k;  // [D][D] or null
  float scale;
  int tokens_per_split;  // a multiple of kTile
  float* part_o;         // [parts][rows][D]
  float* part_lse;       // [parts][rows]
  int part_base;
  // RawQueries (cuda_decode_attention.h): when q_raw is set, queries are read from it.
  const void* q_raw;
  bool q_bf16;
  const DeviceFault* q_faults;
  unsigned long long q_fault_bits;
  FoldArgs fold;  // set: the merge folded into the launch (merge_fold.cuh)
};

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from src to shared dst; only src_bytes (16 or 0) are read, the rest zero-filled.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The two digits of x0 and x1 as A registers: hi = (bf16(x0), bf16(x1)), lo = the BF16 of
// what that rounding left (x - bf16(x) is exact in FP32); x0 in the low half.
__device__ __forceinline__ void SplitPair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
  const __nv_bfloat16 l0 = __float2bfloat16_rn(x0 - __bfloat162float(h0));
  const __nv_bfloat16 l1 = __float2bfloat16_rn(x1 - __bfloat162float(h1));
  hi = static_cast<uint32_t>(__bfloat16_as_ushort(h0)) |
       (static_cast<uint32_t>(__bfloat16_as_ushort(h1)) << 16);
  lo = static_cast<uint32_t>(__bfloat16_as_ushort(l0)) |
       (static_cast<uint32_t>(__bfloat16_as_ushort(l1)) << 16);
}

// Element i of the queries [batch][num_q_heads][D]: a.q[i], or the raw query read with the
// fused non-finite check (query_input.cuh), the same value LaunchQueriesToFloat gives.
__device__ __forceinline__ float QueryAt(const SplitArgs& a, int64_t i) {
  if (a.q_raw == nullptr) return a.q[i];
  return ReadQuery(a.q_raw, a.q_bf16, i, a.q_faults,
                   static_cast<int64_t>(a.geo.num_q_heads) * a.geo.head_dim, a.q_fault_bits);
}

// s_q[h] (h < 8) = the group's queries times R_k, times scale * log2(e); zero rows past the
// group. raw is scratch. Every CTA reads its group's queries (so the raw path checks every
// query even where a sequence has no tokens in the list). Ends with a barrier.
template <int D>
__device__ void LoadGroupQueries(const SplitArgs& a, int b, int kvh, int G, float (*raw)[D],
                                 float (*s_q)[D]) {
  for (int i = threadIdx.x; i < kMaxGroup * D; i += blockDim.x) {
    const int h = i / D, e = i % D;
    raw[h][e] =
        h < G ? QueryAt(a, (static_cast<int64_t>(b) * a.geo.num_q_heads + kvh * G + h) * D + e)
              : 0.0f;
  }
  __syncthreads();
  const float mul = a.scale * kLog2e;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    float acc[kMaxGroup];
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) acc[h] = a.r_k == nullptr ? raw[h][j] : 0.0f;
    if (a.r_k != nullptr) {
      // Thread j computes column j of every row: R_k read once per CTA, coalesced, 32 loads
      // in flight per thread (D / 32 round trips to L2).
      for (int i0 = 0; i0 < D; i0 += 32) {
        float r[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) r[u] = __ldg(a.r_k + (i0 + u) * D + j);
#pragma unroll
        for (int u = 0; u < 32; ++u) {
#pragma unroll
          for (int h = 0; h < kMaxGroup; ++h) acc[h] = fmaf(raw[h][i0 + u], r[u], acc[h]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) s_q[h][j] = acc[h] * mul;
  }
  __syncthreads();
}

// kFold: the instance that takes its share of a folded merge (merge_fold.cuh).
template <int D, bool kFold>
__global__ void __launch_bounds__(kWarps * 32, kCtasPerSm<D>) Bf16SplitKernel(const SplitArgs a) {
  constexpr int S = kStages<D>;
  constexpr int kRowBytes = D * 2;
  constexpr int kChunks = D / 8;                   // 16-byte chunks per row: 8, 16, 32
  constexpr int kRowsPerPass = 32 / kChunks;       // rows one copy instruction of the warp covers
  constexpr int kPasses = kTile / kRowsPerPass;    // copy instructions per lane per matrix
  constexpr int kNt = D / 8;                       // n-tiles of O
  extern __shared__ __align__(16) uint8_t smem[];  // the warps' rings; the states at the end
  __shared__ float s_raw[kMaxGroup][D];
  __shared__ float s_q[kMaxGroup][D];

  const PagedList& p = a.list;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = a.geo.num_q_heads / a.geo.num_kv_heads;
  const int ps = a.geo.page_size;
  const int t_begin = split * a.tokens_per_split;
  const int t_end = min(p.lengths[b], t_begin + a.tokens_per_split);
  const int tiles = t_end > t_begin ? (t_end - t_begin + kTile - 1) / kTile : 0;
  const int n = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;  // this warp's tiles

  const uint32_t ring = SmemAddress(smem) + warp * S * kStageBytes<D>;
  const int64_t head_off = static_cast<int64_t>(kvh) * ps * kRowBytes;
  const int64_t v_off = static_cast<int64_t>(a.geo.num_kv_heads) * ps * kRowBytes;
  const int32_t* table = p.page_table + static_cast<int64_t>(b) * p.max_pages;
  const int my_row = lane & (kTile - 1);
  // First token of this warp's tile k; the page of its row my_row (-1: past the split).
  auto tile_token = [&](int k) { return t_begin + (warp + kWarps * k) * kTile; };
  auto page_of = [&](int k) {
    const int tok = tile_token(k) + my_row;
    return k < n && tok < t_end ? __ldg(table + tok / ps) : -1;
  };
  // Queues the copies of tile k (its rows' pages in `page`) into stage k % S.
  auto issue = [&](int k, int page) {
    const int tok = tile_token(k) + my_row;
    const int64_t off =
        page >= 0 ? page * p.page_stride + head_off + static_cast<int64_t>(tok % ps) * kRowBytes
                  : -1;
    const uint32_t stage = ring + (k % S) * kStageBytes<D>;
    const int col = lane % kChunks;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = lane / kChunks + i * kRowsPerPass;
      const int64_t ro = __shfl_sync(0xffffffffu, off, row);
      const uint8_t* src = p.pages + (ro >= 0 ? ro + col * 16 : 0);
      const uint32_t bytes = ro >= 0 ? 16u : 0u;
      const uint32_t dst = stage + row * kRowBytes + ((col ^ (row & 7)) << 4);
      CpAsync16(dst, src, bytes);
      CpAsync16(dst + kTile * kRowBytes, src + (ro >= 0 ? v_off : 0), bytes);
    }
  };

  // The first S - 1 tiles go out before the queries are prepared: they do not depend on them.
  int page = page_of(0);
#pragma unroll
  for (int k = 0; k < S - 1; ++k) {
    if (k < n) issue(k, page);
    CpAsyncCommit();
    page = page_of(k + 1);
  }

  LoadGroupQueries<D>(a, b, kvh, G, s_raw, s_q);
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const float* row = s_q[g] + 16 * ks + 2 * t;
    SplitPair(row[0], row[1], qa[ks][0], qa[ks][1]);
    SplitPair(row[8], row[9], qa[ks][2], qa[ks][3]);
  }

  float o[kNt][4];
#pragma unroll
  for (int i = 0; i < kNt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int mi = lane >> 3, rr = lane & 7;  // ldmatrix: this lane's matrix and row in it
  for (int k = 0; k < n; ++k) {
    if (k + S - 1 < n) issue(k + S - 1, page);
    CpAsyncCommit();
    page = page_of(k + S);  // read now, used next iteration
    CpAsyncWait<S - 1>();   // tile k has landed (this lane's copies) ...
    __syncwarp();           // ... and every lane's
    const uint32_t sk = ring + (k % S) * kStageBytes<D>;
    const uint32_t sv = sk + kTile * kRowBytes;

    // S = Q K^T: s[nt] covers keys 8 nt .. 8 nt + 7.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      // Matrices: (keys 0-7, dims 16ks..+7), (keys 0-7, +8..), (keys 8-15, ..), (keys 8-15, +8..)
      const int key = (mi >> 1) * 8 + rr, chunk = 2 * ks + (mi & 1);
      uint32_t kb[4];
      LdMatrixX4(kb, sk + key * kRowBytes + ((chunk ^ rr) << 4));
      MmaBf16(s[0], qa[ks], kb[0], kb[1]);
      MmaBf16(s[1], qa[ks], kb[2], kb[3]);
    }

    // Online softmax of head g over keys 8 nt + 2t + j.
    const int valid = t_end - tile_token(k);  // keys of the tile inside the split (>= 1)
    float x[2][2];
    float mx = m;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        x[nt][j] = 8 * nt + 2 * t + j < valid ? s[nt][j] + s[nt][2 + j] : -INFINITY;
        mx = fmaxf(mx, x[nt][j]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float alpha = exp2f(m - mx);  // key 0 is valid, so mx is finite; 0 on the first tile
    m = mx;
    float pr[2][2], sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        pr[nt][j] = exp2f(x[nt][j] - m);
        sum += pr[nt][j];
      }
    }
    l = l * alpha + sum;
#pragma unroll
    for (int i = 0; i < kNt; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) o[i][c] *= alpha;
    }
    uint32_t pa[4];
    SplitPair(pr[0][0], pr[0][1], pa[0], pa[1]);
    SplitPair(pr[1][0], pr[1][1], pa[2], pa[3]);

    // O += P V: dims 16 jj .. 16 jj + 15 per ldmatrix.x4.trans.
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      // Matrices: (keys 0-7, dims 16jj..+7), (keys 8-15, ..), (keys 0-7, +8..), (keys 8-15, +8..)
      const int key = (mi & 1) * 8 + rr, chunk = 2 * jj + (mi >> 1);
      uint32_t vb[4];
      LdMatrixX4Trans(vb, sv + key * kRowBytes + ((chunk ^ rr) << 4));
      MmaBf16(o[2 * jj], pa, vb[0], vb[1]);
      MmaBf16(o[2 * jj + 1], pa, vb[2], vb[3]);
    }
    __syncwarp();  // every lane is done with stage k % S before it is refilled
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  // A merge launched as this grid's programmatic dependent may start its CTAs (and load its
  // R_v^T) now; it waits for the whole grid before it reads a part.
  LaunchDependents();

  // The warps' states, in the rings (every copy landed, every warp past its loop).
  CpAsyncWait<0>();
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(smem);  // [kWarps][8][D]
  float* s_m = s_o + kWarps * kMaxGroup * D;    // [kWarps][8]
  float* s_l = s_m + kWarps * kMaxGroup;        // [kWarps][8]
  float* o_row = s_o + (warp * kMaxGroup + g) * D;
#pragma unroll
  for (int i = 0; i < kNt; ++i) {
    o_row[8 * i + 2 * t] = o[i][0] + o[i][2];
    o_row[8 * i + 2 * t + 1] = o[i][1] + o[i][3];
  }
  if (t == 0) {
    s_m[warp * kMaxGroup + g] = n > 0 ? m : -INFINITY;
    s_l[warp * kMaxGroup + g] = n > 0 ? l : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int h = i / D, e = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w * kMaxGroup + h]);
    float num = 0.0f, den = 0.0f;
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float lw = s_l[w * kMaxGroup + h];
        if (lw <= 0.0f) continue;
        const float f = exp2f(s_m[w * kMaxGroup + h] - M);
        num += f * s_o[(w * kMaxGroup + h) * D + e];
        den += f * lw;
      }
    }
    const int64_t row =
        (static_cast<int64_t>(a.part_base + split) * a.geo.batch + b) * a.geo.num_q_heads +
        kvh * G + h;
    a.part_o[row * D + e] = den > 0.0f ? num / den : 0.0f;
    if (e == 0) a.part_lse[row] = den > 0.0f ? (M + log2f(den)) * kLn2 : -INFINITY;
  }
  if constexpr (kFold) {  // the merge folded into the launches (merge_fold.cuh)
    FoldMerge<D>(a.fold, a.part_o, a.part_lse, a.geo.batch, a.geo.num_q_heads, a.geo.num_kv_heads,
                 b, kvh, a.q_raw, a.q_bf16, s_o);
  }
}

template <int D, bool kFold>
cudaError_t LaunchSplit(const SplitArgs& a, int splits, cudaStream_t stream) {
  // The ring needs more than the default 48 KB of dynamic shared memory, and kCtasPerSm CTAs
  // per SM the largest shared-memory carveout: set both once per device (a bit per ordinal).
  static std::atomic<uint64_t> raised{0};
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit == 0 || (raised.load(std::memory_order_relaxed) & bit) == 0) {
    cudaError_t e = cudaFuncSetAttribute(
        Bf16SplitKernel<D, kFold>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes<D>);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(Bf16SplitKernel<D, kFold>,
                               cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    }
    if (e != cudaSuccess) return e;
    raised.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(a.geo.num_kv_heads),
                  static_cast<unsigned>(a.geo.batch));
  CountLaunch();
  Bf16SplitKernel<D, kFold><<<grid, kWarps * 32, kRingBytes<D>, stream>>>(a);
  return cudaGetLastError();
}

bool SplitGeometry(const DecodeGeometry& g) {
  const int d = g.head_dim;
  return (d == 64 || d == 128 || d == 256) && g.num_kv_heads > 0 && g.batch > 0 &&
         g.num_q_heads >= g.num_kv_heads && g.num_q_heads % g.num_kv_heads == 0 &&
         g.num_q_heads / g.num_kv_heads <= kMaxGroup && g.page_size > 0;
}

}  // namespace

int Bf16SplitCtasPerSm(int head_dim) {
  return kernels::DispatchHeadDim(
      head_dim, [](auto hd) { return kCtasPerSm<decltype(hd)::value>; }, [] { return 0; });
}

int Bf16DecodeSplits(Bf16Kernel kernel, int batch, int num_kv_heads, int head_dim, int max_tokens,
                     int num_sms) {
  if (kernel == Bf16Kernel::kWarp) {
    return Int2DecodeSplits(batch, num_kv_heads, max_tokens, num_sms);
  }
  // One CTA per SM (a second, partial wave would double the time of the last CTAs), each
  // warp at least kMinTilesPerWarp tiles. One CTA's rings keep ~96 KB of K/V in flight,
  // enough for the SM's share of the read rate; the H200 measured 33 splits (two CTAs per
  // SM at d 128) 7% / 4% slower than 16 at batch 1, 32k / 100k
  // (bench/results/2026-12-06-h200-bf16-split.md).
  const int64_t ctas = int64_t{batch} * num_kv_heads;
  if (ctas <= 0 || Bf16SplitCtasPerSm(head_dim) <= 0) return 1;
  int64_t splits = int64_t{num_sms} / ctas;
  const int per_split = kWarps * kTile * kMinTilesPerWarp;
  const int64_t by_tokens = (int64_t{max_tokens} + per_split - 1) / per_split;
  splits = splits < by_tokens ? splits : by_tokens;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

Error LaunchBf16SplitDecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                                 const float* r_k, float scale, int splits, int max_tokens,
                                 float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                                 const RawQueries* raw, const MergeTarget* fold) {
  KVCD_CUDA_BIND_THREAD();
  if (!SplitGeometry(geo) || splits <= 0) return ToError(cudaErrorInvalidValue);
  if (reinterpret_cast<uintptr_t>(list.pages) % 16 != 0 || list.page_stride % 16 != 0) {
    // 16-byte copies need 16-byte aligned rows (BF16 pools are; a pool whose pages carry
    // other data after the rows may not be).
    return LaunchBf16DecodeParts(list, geo, q, r_k, scale, splits, max_tokens, part_o, part_lse,
                                 part_base, stream, raw, fold);
  }
  SplitArgs a{};
  a.list = list;
  a.geo = geo;
  a.q = q;
  a.r_k = r_k;
  a.scale = scale;
  const int per = max_tokens > 0 ? (max_tokens + splits - 1) / splits : 0;
  a.tokens_per_split = (per + kTile - 1) / kTile * kTile;
  a.part_o = part_o;
  a.part_lse = part_lse;
  a.part_base = part_base;
  if (raw != nullptr && raw->q != nullptr) {
    a.q_raw = raw->q;
    a.q_bf16 = raw->bf16;
    a.q_faults = raw->faults;
    a.q_fault_bits = FaultTag(0, raw->fault_layer);
  }
  if (fold != nullptr && !SetFold(*fold, geo, part_base, splits, &a.fold)) {
    return ToError(cudaErrorInvalidValue);
  }
  return ToError(DispatchHeadDim(geo.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    return a.fold.counters != nullptr ? LaunchSplit<kD, true>(a, splits, stream)
                                      : LaunchSplit<kD, false>(a, splits, stream);
  }));
}

Error LaunchBf16Parts(Bf16Kernel kernel, const PagedList& list, const DecodeGeometry& geo,
                      const float* q, const float* r_k, float scale, int splits, int max_tokens,
                      float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                      const RawQueries* raw, const MergeTarget* fold) {
  KVCD_CUDA_BIND_THREAD();
  if (kernel == Bf16Kernel::kWarp) {
    return LaunchBf16DecodeParts(list, geo, q, r_k, scale, splits, max_tokens, part_o, part_lse,
                                 part_base, stream, raw, fold);
  }
  return LaunchBf16SplitDecodeParts(list, geo, q, r_k, scale, splits, max_tokens, part_o, part_lse,
                                    part_base, stream, raw, fold);
}

}  // namespace kvcd::kernels::cuda
