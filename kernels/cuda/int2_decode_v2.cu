// The int32-accumulating OSCAR INT2 decode kernel (head_dim 64/128) and its query
// preparation (QueryFragments); int2_decode.cuh has the MMA fragment layout.
#include <cuda_fp16.h>

#include <atomic>
#include <cfloat>
#include <cstdint>

#include "bulk_copy.cuh"
#include "decode_parts.cuh"
#include "dispatch.cuh"
#include "dynamic_smem.cuh"
#include "int2_decode.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_decode_attention.h"

namespace kvcd::kernels::cuda {
namespace {

// The v2 kernel's n-tiles of query heads per KV head (4 heads each), and the CTAs of it an
// SM holds: 4 with one tile (128 registers, no spills), 3 with two.
constexpr int V2HeadTiles(int num_q_heads, int num_kv_heads) {
  return num_q_heads > 4 * num_kv_heads ? 2 : 1;
}
constexpr int V2CtasPerSm(int head_tiles) { return head_tiles == 1 ? 4 : 3; }

// ---------------------------------------------------------------------------------------
// Int2DecodeKernelV2: the history read once with 16-byte loads, codes unpacked with one
// mask (and for K a shift) per 4 elements straight into int8 MMA fragments, the value
// products accumulated in int32 across tiles. mma.sync.m16n8k32 u8 x s8 -> s32 with the
// fragments of the header comment (lane = 4g + t):
//
// logits, per 32-token tile and m-tile mt (16 tokens): A = K codes (rows = tokens: row g is
//   token 4g + 2mt, row g + 8 is token 4g + 2mt + 1), B = the rotated query as two int8
//   digits (column 2h' + digit for head h' of the n-tile). k-block kb = (j, pp) takes planes
//   2pp (k 4t..4t+3) and 2pp + 1 (k 4t+16..) of the K word group 4j + t, so a lane reads
//   only the groups 4j + t of its 4 tokens (one 16-byte load per group). The C fragment
//   then holds, per lane, both digits of head t for the lane's 4 consecutive tokens.
// values: A = V^T codes (rows = elements, k = tokens: a V word is one code byte of 4
//   consecutive tokens, so one mask yields 4 tokens' codes of one plane, scaled by 4^p; the
//   4^-p goes on the output row), B = the weights p_t * s_t as two uint8 digits per head
//   (w / wstep = hi + lo / 256: one FMA rounds 256 w / wstep into the low 16 bits of a float),
//   moved from the logit layout to the B layout with two shuffles per register. The int32
//   accumulators are converted to FP32 only when the running max of a head rises by more
//   than kLazyLog2 (log2 units), when the tile's largest value scale exceeds the one the
//   digits were scaled for, or every kFlushTiles tiles (int32 headroom).
// loads: each warp walks a contiguous quarter of its split page by page; each lane loads its
//   own 16-byte pieces of a tile (K word groups, V byte columns) and the FP16 scale/min of
//   its tokens, one tile ahead in registers (two register tiles used in turn): every byte
//   of a page is read once, coalesced, and the page table once per page. (A 4-deep cp.async
//   ring in shared memory was measured slower: bench/results/2026-12-03-h200-int2-decode-
//   v2.md; L2 prefetch ahead gained nothing: ...-v2-pass2.md.)
// query: prepared once per (b, KV head) by QueryFragments as B fragments; the kernel starts
//   as its programmatic dependent and waits for it only before reading them.
// Weights stay <= 2^kLazyLog2 * S between rescales. (2 instead of 0.25 cut the batch-1 grid
// by 12% but made errors 3-5x larger, the 16-bit digits resolving 2^1.75 coarser: kept.)
constexpr float kLazyLog2 = 0.25f;
constexpr int kFlushTiles = 512;            // 512 * 32 tokens * 255 * 192 < 2^31
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: low byte = round(x) for |x| < 2^22

__device__ __forceinline__ void MmaU8S8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaU8U8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Packs byte B of four words (byte c of the result = byte B of x_c).
template <int B>
__device__ __forceinline__ uint32_t PackBytes(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  constexpr uint32_t sel = (4 + B) << 4 | B;  // byte B of the first word, then of the second
  return __byte_perm(__byte_perm(x0, x1, sel), __byte_perm(x2, x3, sel), 0x5410);
}

// What one lane holds of one 32-token tile.
template <int D>
struct TileWords {
  static constexpr int Q = D / 4;    // code bytes per row
  static constexpr int KW = Q / 16;  // K word groups per lane (groups 4j + t)
  static constexpr int U = Q / 8;    // V byte columns per lane (g*U .. g*U + U - 1)
  uint32_t k[KW][4];                 // [j][token 4g + c]
  uint32_t v[2][U];                  // quads t and t + 4, byte columns g*U + u
  uint2 ks, kl, vs, vl;              // FP16 scale/min of K and V, tokens 4g .. 4g + 3
};

// A load from global memory through the read-only path (kGlobal) or from shared memory.
template <class T, bool kGlobal>
__device__ __forceinline__ T Load(const uint8_t* p) {
  if constexpr (kGlobal) {
    return __ldg(reinterpret_cast<const T*>(p));
  } else {
    return *reinterpret_cast<const T*>(p);
  }
}

template <int N, bool kGlobal>
__device__ __forceinline__ void LoadWords(const uint8_t* p, uint32_t (&w)[N]) {
  if constexpr (N == 2) {
    const uint2 v = Load<uint2, kGlobal>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 v = Load<uint4, kGlobal>(p + 4 * i);
      w[i] = v.x;
      w[i + 1] = v.y;
      w[i + 2] = v.z;
      w[i + 3] = v.w;
    }
  }
}

// Byte offsets, from the start of a page, of what one lane reads of the 32-token tile at
// slot 0 of its KV head's page-layer: k = the 16-byte K word group t of tokens 4g..4g+3
// (group 4j + t is k_step * j further), v = the V byte columns g*U.. of quad t (quad t + 4
// is 16 Q bytes further), p = the FP16 K scales of tokens 4g..4g+3 (minimums p_min, V
// parameters p_v further). A tile at slot s adds s times 4 (K), Q (V) or 2 (parameters).
template <int D>
struct LaneOffsets {
  uint32_t k, v, p;  // K word group t of tokens 4g.., V quad t at byte column g*U, K scale 4g
  uint32_t k_step;   // K word group 4j + t to 4(j + 1) + t: 16 * ps bytes
  uint32_t p_min;    // scales to minimums: 2 * ps bytes
  uint32_t p_v;      // K parameters to V parameters: num_kv_heads * 4 * ps bytes
};

// The lane's offsets for a KV head's rows at `h` (in a page-layer, or in a stage).
template <int D>
__device__ __forceinline__ LaneOffsets<D> LaneOffsetsOf(const Int2HeadOffsets& h, uint32_t ps,
                                                        int lane) {
  constexpr int Q = D / 4, U = Q / 8;
  const uint32_t g = lane >> 2, t = lane & 3;
  LaneOffsets<D> o;
  o.k = h.k + (t * ps + 4 * g) * 4;
  o.v = h.v + (t * Q + g * U) * 4;
  o.p = h.kp + 8 * g;
  o.k_step = 16 * ps;
  o.p_min = 2 * ps;
  o.p_v = h.vp - h.kp;
  return o;
}

// One lane's addresses of the tile it loads next: its K word group, V columns, K and V
// parameters at that tile's slot. Set once per page; the next tile of the same page is a
// fixed number of bytes further (Advance), so a tile costs no page-table read, no 64-bit
// multiply and no offset arithmetic beyond four pointer adds.
template <int D>
struct TilePtrs {
  const uint8_t *k, *v, *kp;  // V parameters: kp + p_v
  __device__ __forceinline__ void Set(const uint8_t* page, uint32_t slot, const LaneOffsets<D>& o) {
    k = page + (o.k + 4u * slot);
    v = page + (o.v + (D / 4) * slot);
    kp = page + (o.p + 2u * slot);
  }
  __device__ __forceinline__ void Advance() {  // the next 32-token tile of the same page
    k += 4 * kTile;
    v += (D / 4) * kTile;
    kp += 2 * kTile;
  }
  // From the last tile of a page (slot ps - kTile) to the first of a page `bytes` further
  // (two 32-bit adds per pointer, no lane offsets recomputed).
  __device__ __forceinline__ void Jump(int64_t bytes, int ps) {
    k += bytes - 4 * (ps - kTile);
    v += bytes - (D / 4) * (ps - kTile);
    kp += bytes - 2 * (ps - kTile);
  }
};

// One lane's pieces of the tile at `at`, from a page (kGlobal) or a shared-memory stage.
template <int D, bool kGlobal>
__device__ __forceinline__ void LoadTile(const TilePtrs<D>& at, const LaneOffsets<D>& o,
                                         TileWords<D>& tw) {
  constexpr uint32_t Q = D / 4;
#pragma unroll
  for (int j = 0; j < TileWords<D>::KW; ++j) {
    const uint4 w = Load<uint4, kGlobal>(at.k + j * o.k_step);
    tw.k[j][0] = w.x;
    tw.k[j][1] = w.y;
    tw.k[j][2] = w.z;
    tw.k[j][3] = w.w;
  }
  LoadWords<TileWords<D>::U, kGlobal>(at.v, tw.v[0]);
  LoadWords<TileWords<D>::U, kGlobal>(at.v + 16 * Q, tw.v[1]);  // quad t + 4
  tw.ks = Load<uint2, kGlobal>(at.kp);
  tw.kl = Load<uint2, kGlobal>(at.kp + o.p_min);
  const uint8_t* vp = at.kp + o.p_v;
  tw.vs = Load<uint2, kGlobal>(vp);
  tw.vl = Load<uint2, kGlobal>(vp + o.p_min);
}

// The staged path (pages of 64 tokens): per warp, kStages shared-memory copies of one KV
// head's part of a page, laid out as in the page (K codes [Q/4 groups][ps] words, V codes
// [ps/4 quads][Q] words, K scales and minimums, V scales and minimums), so LaneOffsetsOf and
// LoadTile serve a stage (StageLayout) as they serve a page-layer (HeadOffsets).
constexpr int kStages = 2;
template <int D>
__host__ __device__ constexpr int StageBytes(int ps) {
  return ps * (2 * (D / 4) + 8);
}

// Where a stage holds its K codes, V codes, K parameters and V parameters.
template <int D>
__device__ __forceinline__ Int2HeadOffsets StageLayout(uint32_t ps) {
  const uint32_t codes = ps * (D / 4);
  return {0, codes, 2 * codes, 2 * codes + 4 * ps};
}

__device__ __forceinline__ void HalvesToFloat(uint2 h, float (&f)[4]) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
  const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = c.x;
  f[3] = c.y;
}

// Element of V^T m-tile vt, row r (0: row g, 1: row g + 8) for lane group g.
template <int D>
__device__ __forceinline__ int ValueElement(int vt, int r, int g) {
  constexpr int Q = D / 4, U = Q / 8, per_plane = U / 2;
  return (vt / per_plane) * Q + g * U + 2 * (vt % per_plane) + r;
}

// Rotated, scaled queries of one (b, kv head) group as the v2 kernel's int8 B fragments
// (two digits per element) in lane order, with the per-head logit unit and query sum. One
// CTA of 4 * D threads per (kv head, b): thread (part, j) sums a quarter of column j of
// R_k for the group's rows, loading its D/4 values of R_k at once (one memory round trip;
// a thread per column with the whole sum took ~19 us at batch 1). Lets the decode kernel
// launch at once (it waits for this grid only where it reads the results).
template <int D, int NT>
__global__ void __launch_bounds__(4 * D) QueryFragments(PartArgs a) {
  LaunchDependents();
  constexpr int R = 4 * NT, Q = D / 4, KB = D / 32, kPer = D / 4;
  constexpr float kLog2e = 1.4426950408889634f;
  const int kvh = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int G = a.geo.num_q_heads / a.geo.num_kv_heads;
  __shared__ float s_raw[R][D], s_part[4][R][D], s_q[R][D];
  __shared__ float s_step[8], s_inv[8], s_qsum[8];
  const int64_t q0 = (static_cast<int64_t>(b) * a.geo.num_q_heads + kvh * G) * D;
  const int part = tid / D, j = tid % D;
  float r[kPer];  // this thread's quarter of column j of R_k, loaded with the queries
  if (a.r_k != nullptr) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) r[u] = __ldg(a.r_k + (part * kPer + u) * D + j);
  }
  for (int i = tid; i < R * D; i += blockDim.x)
    s_raw[i / D][i % D] = i / D < G ? QueryValue(a, q0 + i) : 0.0f;
  __syncthreads();
  float acc[R];
#pragma unroll
  for (int h = 0; h < R; ++h) acc[h] = 0.0f;
  if (a.r_k == nullptr) {
#pragma unroll
    for (int h = 0; h < R; ++h) acc[h] = part == 0 ? s_raw[h][j] : 0.0f;
  } else {
#pragma unroll
    for (int u = 0; u < kPer; ++u)
#pragma unroll
      for (int h = 0; h < R; ++h) acc[h] = fmaf(s_raw[h][part * kPer + u], r[u], acc[h]);
  }
#pragma unroll
  for (int h = 0; h < R; ++h) s_part[part][h][j] = acc[h];
  __syncthreads();
  for (int i = tid; i < R * D; i += blockDim.x) {
    const int h = i / D, e = i % D;
    s_q[h][e] =
        ((s_part[0][h][e] + s_part[1][h][e]) + (s_part[2][h][e] + s_part[3][h][e])) * a.scale;
  }
  __syncthreads();
  RowSteps<D>(s_q, R, s_step, s_inv, s_qsum);
  const int frag = b * a.geo.num_kv_heads + kvh;
  uint32_t* out = a.state.frags + static_cast<int64_t>(frag) * kFragWords;
  for (int i = tid; i < KB * NT * 2 * 32; i += blockDim.x) {
    const int ln = i % 32, half = (i / 32) % 2, nt = (i / 64) % NT, kb = i / (64 * NT);
    const int g = ln >> 2, t = ln & 3;
    const int h = 4 * nt + (g >> 1), jj = kb / 2, pp = kb % 2;
    const float step = s_step[h], inv = s_inv[h];
    const int e0 = (2 * pp + half) * Q + 4 * (4 * jj + t);
    uint32_t d[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float x = s_q[h][e0 + c];
      const int hi = Digit(x * inv);
      const int lo = Digit((x - hi * step) * (254.0f * inv));
      d[c] = static_cast<uint32_t>((g & 1) != 0 ? lo : hi);
    }
    out[i] = PackBytes<0>(d[0], d[1], d[2], d[3]);
  }
  if (tid < R) {
    a.state.scal[frag * kScalFloats + tid] = s_step[tid] / 254.0f * kLog2e;
    a.state.scal[frag * kScalFloats + 8 + tid] = s_qsum[tid] * kLog2e;
  }
}

// PS: the page size when it is 64 (the default; page strides and offsets become immediates),
// 0 for any other multiple of kTile (read from the geometry).
// kFold: the instance that takes its share of a folded merge (merge_fold.cuh); the other
// has none of its code, so the decode loop's registers are the same as without the fold.
template <int D, int NT, int PS, bool kFold>
__global__ void __launch_bounds__(kWarps * 32, V2CtasPerSm(NT)) Int2DecodeKernelV2(PartArgs a) {
  constexpr int KB = D / 32;  // logit k-blocks (2 per K word group of a lane)
  constexpr int VT = D / 16;  // V^T m-tiles
  const PagedList& p = a.list;
  const DecodeGeometry& geo = a.geo;
  // The warp index through a shuffle from lane 0, so the compiler knows it is the same in
  // every lane (the bulk-copy operands derived from it then need no per-lane loop).
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = geo.num_q_heads / geo.num_kv_heads;
  const int ps = PS > 0 ? PS : geo.page_size;
  const int len = p.lengths[b];
  const int t_begin = split * a.tokens_per_split;
  const int t_end = min(len, t_begin + a.tokens_per_split);
  const int32_t* table = p.page_table + static_cast<int64_t>(b) * p.max_pages;

  __shared__ float s_m[kWarps][8], s_l[kWarps][8], s_lacc[kWarps][8];
  __shared__ float s_o[kWarps][4 * NT][D];  // the warps' FP32 value sums (o without 1/l)

  // Each warp takes a contiguous quarter of the split (TokensPerSplit makes it a whole
  // number of tile pairs), so it walks its pages in order: the page table is read once per
  // page, a page ahead, and the next tile of the same page is a pointer step. The first
  // tile's loads go out before the wait for QueryFragments (programmatic dependent launch),
  // so they overlap it.
  const int per_warp = a.tokens_per_split / kWarps;
  const int w_begin = t_begin + warp * per_warp;
  const int w_end = min(t_end, w_begin + per_warp);
  const Int2HeadOffsets head = HeadOffsets(geo, ps, kvh, D / 4);
  const LaneOffsets<D> lo = LaneOffsetsOf<D>(head, ps, lane);
  auto page_at = [&](int page_id) {
    return p.pages + static_cast<int64_t>(page_id) * p.page_stride;
  };
  int tile = w_begin;
  // Pages of 64 tokens (kStaged): each warp streams its pages into a ring of kStages
  // shared-memory stages with bulk copies (one elected lane, four copies per page: K codes,
  // V codes, K and V parameters of this KV head) completing on an mbarrier per stage, so
  // up to kStages pages per warp are in flight while it computes. Other page sizes: each
  // lane loads its pieces of the next tile into registers (two register tiles in turn).
  constexpr bool kStaged = PS == 64;
  constexpr int kStageBytes = StageBytes<D>(PS > 0 ? PS : 64);
  extern __shared__ __align__(128) uint8_t s_stages[];  // [kWarps][kStages][kStageBytes]
  __shared__ uint64_t s_bar[kWarps][kStages];
  const Int2HeadOffsets stage_layout = StageLayout<D>(ps);
  const int idx0 = w_begin / ps;
  const int n_pages = w_end > w_begin ? (w_end - w_begin + ps - 1) / ps : 0;
  int next_id = 0;  // staged: the page id of the next page to copy (every lane reads it)
  auto stage_bar = [&](int st) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(&s_bar[warp][st]));
  };
  auto stage_at = [&](int st) { return s_stages + (warp * kStages + st) * kStageBytes; };
  // Page page_id into stage st: the whole warp computes the (warp-uniform) addresses, lane
  // 0 issues the copies.
  auto copy_page = [&](int st, int page_id) {
    const uint8_t* pg = page_at(page_id);
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage_at(st)));
    const uint32_t bar = stage_bar(st), codes = ps * (D / 4), params = 4 * ps;
    const Int2HeadOffsets& sl = stage_layout;
    if (lane == 0) {
      ExpectBytes(bar, kStageBytes);
      BulkCopy(dst + sl.k, pg + head.k, codes, bar);
      BulkCopy(dst + sl.v, pg + head.v, codes, bar);
      BulkCopy(dst + sl.kp, pg + head.kp, params, bar);
      BulkCopy(dst + sl.vp, pg + head.vp, params, bar);
    }
  };
  TileWords<D> ta, tb;
  // Register path: the pointers of the tile loaded last, its page-table index, slot, page.
  TilePtrs<D> at;
  int idx = 0, slot = 0, page = 0, next_page = 0;
  if constexpr (kStaged) {
    if (lane == 0) {
      for (int st = 0; st < kStages; ++st) InitBarrier(stage_bar(st));
      FenceBarrierInit();
    }
    __syncwarp();
    for (int i = 0; i < kStages && i < n_pages; ++i) copy_page(i, __ldg(table + idx0 + i));
    if (kStages < n_pages) next_id = __ldg(table + idx0 + kStages);
  } else if (tile < w_end) {
    idx = tile / ps;
    slot = tile % ps;
    page = __ldg(table + idx);
    at.Set(page_at(page), slot, lo);
    LoadTile<D, true>(at, lo, ta);
    if (tile - slot + ps < w_end) next_page = __ldg(table + idx + 1);
  }
  WaitPrimaryGrid();
  // Query digits (B of the logit MMAs), prepared by QueryFragments in lane order: k-block
  // kb = 2j + pp, column g = (head g/2 of the n-tile, digit g%2); b0 = plane 2pp, b1 =
  // plane 2pp + 1 of elements 4(4j + t) + 0..3.
  const int frag = b * geo.num_kv_heads + kvh;
  uint32_t bq[KB][NT][2];
  {
    const uint32_t* fw = a.state.frags + static_cast<int64_t>(frag) * kFragWords;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          bq[kb][nt][half] = __ldcg(fw + ((kb * NT + nt) * 2 + half) * 32 + lane);
  }
  float unit[NT], qsum[NT];  // logit (log2 units) = dot_int * unit * s + qsum * lo
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    unit[nt] = __ldcg(a.state.scal + frag * kScalFloats + 4 * nt + t);
    qsum[nt] = __ldcg(a.state.scal + frag * kScalFloats + 8 + 4 * nt + t);
  }
  // This lane's FP32 sums live in shared memory (touched only at rescales): zero them.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int vt = 0; vt < VT; ++vt) {
      s_o[warp][4 * nt + t][ValueElement<D>(vt, 0, g)] = 0.0f;
      s_o[warp][4 * nt + t][ValueElement<D>(vt, 1, g)] = 0.0f;
    }
  }
  __syncwarp();

  int acc[VT][NT][4];
#pragma unroll
  for (int vt = 0; vt < VT; ++vt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      acc[vt][nt][0] = acc[vt][nt][1] = acc[vt][nt][2] = acc[vt][nt][3] = 0;
  float m_ref[NT], l[NT], lacc[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m_ref[nt] = -INFINITY;
    l[nt] = 0.0f;
    lacc[nt] = 0.0f;
  }
  // Digits of w * inv_w with inv_w = 255.99 / (s_run * 2^lazy): below 256 for every weight
  // (kept as inv_w256 = 256 inv_w, the factor the digit FMA takes).
  float s_run = 0.0f, inv_w256 = 0.0f;
  int since_flush = 0;

  // Converts the int32 sums (scaled by the current inv_w) into the FP32 sums and rescales
  // those by alpha (per head of the lane).
  auto flush = [&](const float(&alpha)[NT]) {
    const float to_w = inv_w256 > 0.0f ? 256.0f / inv_w256 : 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* o = s_o[warp][4 * nt + t];
#pragma unroll
      for (int vt = 0; vt < VT; ++vt) {
        constexpr int per_plane = TileWords<D>::U / 2;
        const float sc = to_w / static_cast<float>(1 << (2 * (vt / per_plane)));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float x = (static_cast<float>(acc[vt][nt][2 * r]) +
                           static_cast<float>(acc[vt][nt][2 * r + 1]) * (1.0f / 256.0f)) *
                          sc;
          const int e = ValueElement<D>(vt, r, g);
          o[e] = (o[e] + x) * alpha[nt];
          acc[vt][nt][2 * r] = acc[vt][nt][2 * r + 1] = 0;
        }
      }
    }
  };

  // Register path: the next tile's loads into nxt (issued before this tile's math).
  auto load_next = [&](TileWords<D>& nxt) {
    const int ntile = tile + kTile;
    if (ntile < w_end) {
      if (slot + kTile < ps) {  // the same page
        slot += kTile;
        at.Advance();
      } else {  // the next page, whose id was read a page ago
        slot = 0;
        ++idx;
        at.Jump(static_cast<int64_t>(next_page - page) * p.page_stride, ps);
        page = next_page;
        if (ntile + ps < w_end) next_page = __ldg(table + idx + 1);
      }
      LoadTile<D, true>(at, lo, nxt);
    }
  };
  // One tile's math (the tile at `tile`, in cur); advances `tile`. `masked`: whether the
  // tile may run past w_end (only a warp's last tile can); full tiles skip every per-token
  // validity select.
  auto compute = [&](auto masked, const TileWords<D>& cur) {
    constexpr bool kMasked = decltype(masked)::value;
    float ksc[4], klo[4], vsc[4], vlo[4];
    HalvesToFloat(cur.ks, ksc);
    HalvesToFloat(cur.kl, klo);
    HalvesToFloat(cur.vs, vsc);
    HalvesToFloat(cur.vl, vlo);
    bool valid[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) valid[c] = !kMasked || tile + 4 * g + c < w_end;
    // --- logits of head t (and 4 + t) for tokens 4g .. 4g + 3 ---
    float lg[NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      int c[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0;
#pragma unroll
      for (int kb = 0; kb < KB; ++kb) {
        const int j = kb / 2, pp = kb % 2;
        const uint32_t w0 = cur.k[j][2 * mt], w1 = cur.k[j][2 * mt + 1];
        const uint32_t a4[4] = {(w0 >> (4 * pp)) & kPlane, (w1 >> (4 * pp)) & kPlane,
                                (w0 >> (4 * pp + 2)) & kPlane, (w1 >> (4 * pp + 2)) & kPlane};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) MmaU8S8(c[nt], a4, bq[kb][nt][0], bq[kb][nt][1]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int tok = 2 * mt + r;
          const float dot = static_cast<float>(c[nt][2 * r] * 254 + c[nt][2 * r + 1]);
          const float x = fmaf(dot, unit[nt] * ksc[tok], qsum[nt] * klo[tok]);
          lg[nt][tok] = valid[tok] ? x : -INFINITY;
        }
      }
    }
    // --- lazy rescale: only when a logit rises more than kLazyLog2 above its head's
    // reference, a value scale exceeds the one the digits were scaled for, or every
    // kFlushTiles tiles; each lane tests its own tokens and the tile maxima are reduced
    // across the warp only then ---
    float s_tile = 0.0f, mx[NT];
#pragma unroll
    for (int c = 0; c < 4; ++c) s_tile = fmaxf(s_tile, valid[c] ? fabsf(vsc[c]) : 0.0f);
    ++since_flush;
    bool need = s_tile > s_run || since_flush >= kFlushTiles;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mx[nt] = fmaxf(fmaxf(lg[nt][0], lg[nt][1]), fmaxf(lg[nt][2], lg[nt][3]));
      need = need || mx[nt] > m_ref[nt] + kLazyLog2;
    }
    if (__any_sync(0xffffffffu, need)) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        s_tile = fmaxf(s_tile, __shfl_xor_sync(0xffffffffu, s_tile, off));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx[nt] = fmaxf(mx[nt], __shfl_xor_sync(0xffffffffu, mx[nt], off));
      }
      float alpha[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float m_new = fmaxf(m_ref[nt], mx[nt]);
        alpha[nt] = m_ref[nt] == -INFINITY ? 0.0f : Exp2Approx(m_ref[nt] - m_new);
        m_ref[nt] = m_new;
        l[nt] *= alpha[nt];
        lacc[nt] *= alpha[nt];
      }
      flush(alpha);
      s_run = fmaxf(s_run, fmaxf(s_tile, FLT_MIN));
      inv_w256 = 256.0f * (255.99f / (s_run * exp2f(kLazyLog2)));
      since_flush = 0;
    }
    // --- weights p * s_v as two uint8 digits, moved to the B layout of the value MMAs ---
    // u = round(w * inv_w * 256) < 65536 lands in the low 16 bits of one FMA with the
    // rounding constant: its high byte is the digit hi, its low byte lo (w * inv_w = hi +
    // lo / 256 to 2^-9).
    uint32_t bw[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t u[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        // Stale slots past the sequence may hold NaN parameters: select, never multiply.
        const float pr = valid[c] ? Exp2Approx(lg[nt][c] - m_ref[nt]) : 0.0f;
        l[nt] += pr;
        lacc[nt] += valid[c] ? pr * vlo[c] : 0.0f;
        const float w = valid[c] ? pr * vsc[c] : 0.0f;
        u[c] = __float_as_uint(__fmaf_rn(w, inv_w256, kRoundMagic));
      }
      const uint32_t hi4 = PackBytes<1>(u[0], u[1], u[2], u[3]);
      const uint32_t lo4 = PackBytes<0>(u[0], u[1], u[2], u[3]);
      // b0: tokens 4t'.. of column g' = (head g'/2, digit g'%2) from lane 4t' + g'/2; b1:
      // tokens 16 + 4t'.. from lane 16 + 4t' + g'/2.
      const int src0 = 4 * t + (g >> 1), src1 = 16 + 4 * t + (g >> 1);
      const uint32_t h0 = __shfl_sync(0xffffffffu, hi4, src0);
      const uint32_t l0 = __shfl_sync(0xffffffffu, lo4, src0);
      const uint32_t h1 = __shfl_sync(0xffffffffu, hi4, src1);
      const uint32_t l1 = __shfl_sync(0xffffffffu, lo4, src1);
      bw[nt][0] = (g & 1) ? l0 : h0;
      bw[nt][1] = (g & 1) ? l1 : h1;
    }
    // --- values: V^T m-tiles, one mask per A register ---
#pragma unroll
    for (int vt = 0; vt < VT; ++vt) {
      constexpr int per_plane = TileWords<D>::U / 2;
      const int plane = vt / per_plane, v = vt % per_plane;
      const uint32_t mask = kPlane << (2 * plane);
      const uint32_t a4[4] = {cur.v[0][2 * v] & mask, cur.v[0][2 * v + 1] & mask,
                              cur.v[1][2 * v] & mask, cur.v[1][2 * v + 1] & mask};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) MmaU8U8(acc[vt][nt], a4, bw[nt][0], bw[nt][1]);
    }
    tile += kTile;
  };
  using Full = std::integral_constant<bool, false>;
  using Masked = std::integral_constant<bool, true>;
  if constexpr (kStaged) {
    const LaneOffsets<D> so = LaneOffsetsOf<D>(stage_layout, ps, lane);
    for (int i = 0; i < n_pages; ++i) {
      const int st = i % kStages;
      WaitBarrier(stage_bar(st), (i / kStages) & 1);
      const uint8_t* stage = stage_at(st);
#pragma unroll
      for (int half = 0; half < PS / kTile; ++half) {
        if (tile < w_end) {
          TilePtrs<D> in_stage;
          in_stage.Set(stage, half * kTile, so);
          TileWords<D> cur;
          LoadTile<D, false>(in_stage, so, cur);
          if (tile + kTile <= w_end) {
            compute(Full{}, cur);
          } else {
            compute(Masked{}, cur);
          }
        }
      }
      // Every lane's reads of this stage are consumed: refill it with the page kStages on.
      __syncwarp();
      if (i + kStages < n_pages) {
        if (lane == 0) FenceProxyAsync();
        copy_page(st, next_id);
        if (i + kStages + 1 < n_pages) next_id = __ldg(table + idx0 + i + kStages + 1);
      }
    }
  } else {
    bool in_b = false;  // the current tile is in tb
    while (tile + kTile <= w_end) {
      load_next(tb);
      compute(Full{}, ta);
      if (tile + kTile > w_end) {
        in_b = true;
        break;
      }
      load_next(ta);
      compute(Full{}, tb);
    }
    if (tile < w_end) {  // a last, partial tile
      if (in_b) ta = tb;
      compute(Masked{}, ta);
    }
  }
  LaunchDependents();  // the merge kernel may start once every CTA is past its loop
  {
    float one[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) one[nt] = 1.0f;
    flush(one);
  }
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l[nt] += __shfl_xor_sync(0xffffffffu, l[nt], off);
      lacc[nt] += __shfl_xor_sync(0xffffffffu, lacc[nt], off);
    }
    if (g == 0) {
      const int h = 4 * nt + t;
      s_m[warp][h] = l[nt] > 0.0f ? m_ref[nt] * kLn2 : -FLT_MAX;
      s_l[warp][h] = l[nt];
      s_lacc[warp][h] = lacc[nt];
    }
  }
  __syncthreads();
  WritePart<D>(a, split, b, kvh, G, s_m, s_l, s_lacc, s_o);
  if constexpr (kFold) FoldAfterPart<D>(a, b, kvh, &s_o[0][0][0]);
}

// QueryFragments, then the decode kernel (as its programmatic dependent if `dependent`).
template <int D, int NT, bool kFold>
cudaError_t LaunchV2(dim3 grid, const PartArgs& a, cudaStream_t stream, bool dependent) {
  // Pages of 64 tokens: the staged kernel and its shared-memory stages (with its static
  // shared memory above the 48 KB a launch gets by default at 8 heads per KV head: the
  // limit is raised once per device).
  const bool staged = a.geo.page_size == 64;
  auto kernel = staged ? Int2DecodeKernelV2<D, NT, 64, kFold> : Int2DecodeKernelV2<D, NT, 0, kFold>;
  const int smem = staged ? kWarps * kStages * StageBytes<D>(64) : 0;
  if (staged) {
    const cudaError_t e = RaiseDynamicSmem<Int2DecodeKernelV2<D, NT, 64, kFold>>(smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 prep_grid(a.geo.num_kv_heads, a.geo.batch);
  CountLaunch();
  QueryFragments<D, NT><<<prep_grid, 4 * D, 0, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return LaunchDependent(dependent, kernel, grid, dim3(kWarps * 32), smem, stream, a);
}

}  // namespace

int Int2CtasPerSm(int num_q_heads, int num_kv_heads, int head_dim) {
  return head_dim <= 128 ? V2CtasPerSm(V2HeadTiles(num_q_heads, num_kv_heads)) : 3;
}

cudaError_t LaunchInt2V2(dim3 grid, const PartArgs& a, cudaStream_t stream, bool dependent) {
  return DispatchHeadTiles(V2HeadTiles(a.geo.num_q_heads, a.geo.num_kv_heads), [&](auto nt) {
    return DispatchHeadDim(a.geo.head_dim, [&](auto hd) -> cudaError_t {
      constexpr int kD = decltype(hd)::value, kNT = decltype(nt)::value;
      if constexpr (kD <= 128) {
        return a.fold.counters != nullptr ? LaunchV2<kD, kNT, true>(grid, a, stream, dependent)
                                          : LaunchV2<kD, kNT, false>(grid, a, stream, dependent);
      } else {
        return cudaErrorInvalidValue;  // v2 has no head_dim 256
      }
    });
  });
}

}  // namespace kvcd::kernels::cuda
