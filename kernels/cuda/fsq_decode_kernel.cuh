// The FSQ decode attention kernel (cuda_fsq.h, cuda_fsq_i8.h), shared by its two variants,
// which differ only in step 1 (kI8): keys rebuilt from 4-bit codes on tensor cores, in
// registers, never written to memory.
//
// Grid (splits, kv_heads, batch), 4 warps per CTA; a split is a run of 16-token tiles, the
// warps of its CTA take every 4th tile. A 16-token tile lies in one page (page_size is a
// multiple of 16), so its codes are one contiguous run of 16 * FsqCodeBytes(G) bytes, copied
// into the warp's shared-memory stage with cp.async one tile ahead. Per tile (all matrix
// products mma.sync, FP32 accumulation):
//   1. K = Z W_k^T  [16 tokens x d]: m16n8k16 FP16. A = codes unpacked straight into FP16
//      fragments (a byte holds latents 2i and 2i+1, exactly an A register's two halves;
//      1024 + nibble is an FP16 bit pattern, minus 1032 gives z in -8..7 exactly). B = W_k
//      prepared once per layer in fragment order as FP16 rows scaled by their max |w|
//      (LaunchFsqPrepareDecoder): FP16's 11-bit significand on values in [-1, 1] gives each
//      weight a relative error <= 2^-12, so the rebuilt key's error is ~2^-12 of its size
//      (the tests measure it against the float64 oracle; FSQ's own reconstruction error is
//      percents, docs/fsq.md). The accumulator of a thread holds dims (8n + 2t, 8n + 2t + 1)
//      of tokens g and g + 8 for every n, so both RoPE pairings and the key norm's sum over
//      d (a quad shuffle) stay in registers.
//   2. Row scale and b_k, key norm, RoPE in FP32 registers. The angle of position p is
//      (p0 + r) f_i: (p0 f_i mod 2 pi) in float64 once per tile and pair, combined with a
//      per-CTA table of (r f_i) (r < 16), so large positions lose nothing to FP32.
//   3. S^T = Q K^T [heads x 16 tokens]: m16n8k8 TF32, K read straight from the accumulator
//      as the B operand; A rows 0..7 are the group's queries (hi TF32 digit), rows 8..15
//      their lo digit, so the score is c0 + c2 (q carries ~21 bits; K is rounded to TF32).
//   4. Online softmax per head (base 2, scale folded into q): each thread holds 4 tokens of
//      one head, the max is a quad shuffle.
//   5. O^T += Z^T P^T [latents x heads]: m16n8k16 FP16, the weights P in FP16 taken from
//      S^T's accumulator as B without shuffles, Z^T unpacked from the stage.
// The CTA combines its warps' states in shared memory and writes (sum_t a_t z_t / l, lse)
// per row and split; the merge kernel combines splits, applies W_v and b_v (FP32) once per
// row and writes one value-space part.
//
// The int8 variant (kI8, fsq_decode_attention_i8.cu) changes step 1: K = Z W_k^T on
// m16n8k32 u8 x s8 MMAs into int32 accumulators, A = the codes' nibbles (0..15, = z + 8) as
// bytes (one word of 8 nibbles gives two A registers: even and odd nibbles), B = W_k quantized
// once per layer to int8 per row (scale = max |w| / 127), half the fragments of the FP16 path
// per tile and twice the MMA rate; the accumulators start at the bits of 1.5 * 2^23 (read as
// floats they are then 1.5 * 2^23 + the integer sum, exact), and the row scale, the nibbles'
// offset 8 and that start are folded into (scale, bias) per dim, so step 2 is the same single
// FMA (the folded bias rounds to ~2^-24 of 1.5 * 2^23 scale: ~1e-4 of a key). It also
// issues the same products of steps 3 and 5 with shorter chains and fewer instructions: the
// scores in two MMA chains (even and odd n), the codes of step 5 paired by a byte permute,
// the states rescaled only in tiles where a head's running max rose.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "cuda_error.cuh"
#include "dispatch.cuh"
#include "dynamic_smem.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/fsq_i8_fragments.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kWarps = 8;  // one CTA per SM: its warps share the W_k fragments in shared memory
constexpr int kTile = 16;  // tokens per warp tile
constexpr int kMaxGroup = 8;
constexpr int kStageSlack = 64;  // bytes read past a tile's codes (latent padding), never used

// Bytes of a warp's stage buffer for tiles of `tok` tokens of codes of cb bytes.
__host__ __device__ constexpr int StageBytes(int cb, int tok) {
  return (tok * cb + kStageSlack + 15) / 16 * 16;
}

// The two-CTA int8 kernel with the codes' size compiled in (FsqDecodeKernel's kCB; selected by
// FsqKeyKernel::kInt8Occ2Fixed): head_dim 128 with 128 code bytes a token (G 255 or 256: 32x
// compression of BF16 K/V at d 128, the issue #37 geometry). Other geometries take the kernel
// with the size read at run time.
constexpr int kFsqOcc2SpecD = 128, kFsqOcc2SpecCb = 128;
inline bool FsqOcc2Specialized(int head_dim, int code_bytes) {
  return head_dim == kFsqOcc2SpecD && code_bytes == kFsqOcc2SpecCb;
}

struct PartArgs {
  PagedList list;
  DecodeGeometry geo;
  int32_t latent, slices, code_bytes;  // G, ceil(G / 16), FsqCodeBytes(G)
  int32_t kchunks;  // k-steps of the key rebuild: slices (FP16, k16), ceil(G / 32) (int8, k32)
  int32_t tokens_per_split, stage_bytes;
  const uint2* wk;        // [Hkv][kchunks][d / 8][32] B fragments (FP16 or int8)
  const float4* col;      // [Hkv * d / 2] (scale, bias, scale, bias) of dims 2i, 2i + 1
  const float* key_norm;  // [d] or null
  float key_norm_eps;
  int32_t rotary;  // rotary dims (0: none)
  bool interleaved;
  double theta, inv_scaling;
  const int64_t* positions;
  const float* q;
  float q_scale;  // softmax_scale * log2(e)
  float* ws_z;    // [splits][rows][slices * 16]
  float* ws_lse;  // [splits][rows], base 2
};

__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// u8 codes x s8 weights, int32 accumulation; the accumulators are passed as the float
// registers of the FP16 path (their bits: KeyAccBase<true>).
__device__ __forceinline__ void MmaU8S8(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  uint32_t d0 = __float_as_uint(c[0]), d1 = __float_as_uint(c[1]), d2 = __float_as_uint(c[2]),
           d3 = __float_as_uint(c[3]);
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  c[0] = __uint_as_float(d0);
  c[1] = __uint_as_float(d1);
  c[2] = __uint_as_float(d2);
  c[3] = __uint_as_float(d3);
}

// The key accumulators' start value. int8: the bits of 1.5 * 2^23, so that the int32 sum S
// added to them (|S| <= 256 * 15 * 127 < 2^22) reads back as the float 1.5 * 2^23 + S, exact:
// no conversion instruction; the prepared bias takes the - 1.5 * 2^23 * scale
// (fsq_decode_attention_i8.cu), so step 2 is the FP16 path's one FMA.
template <bool kI8>
__host__ __device__ constexpr float KeyAccBase() {
  return kI8 ? kFsqI8AccBase : 0.0f;
}

__device__ __forceinline__ void MmaTf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Two nibbles (low half <- lo, high half <- hi, each 0..15) -> FP16x2 of nibble - 8, exact.
__device__ __forceinline__ uint32_t NibblesToHalf2(uint32_t lo, uint32_t hi) {
  const uint32_t v = FsqNibblePairBits(lo, hi);  // 1024 + nibble
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&v), __float2half2_rn(1032.0f));
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t ByteToHalf2(uint32_t b) {
  return NibblesToHalf2(b & 0xFu, (b >> 4) & 0xFu);
}

// The 4 bytes at p as one word (byte 0 lowest): one load when p is 4-byte aligned (G a multiple
// of 8), else four byte loads.
__device__ __forceinline__ uint32_t Word(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint32_t*>(p);
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

// Bytes j and j + 4 of the 8 at p: one 8-byte shared-memory load when p is 8-byte aligned
// (G a multiple of 16), else two byte loads.
__device__ __forceinline__ uint2 BytePair(const uint8_t* p, int j, bool aligned) {
  if (aligned) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_uint2((w.x >> (8 * j)) & 0xFFu, (w.y >> (8 * j)) & 0xFFu);
  }
  return make_uint2(p[j], p[j + 4]);
}

// The 8 bytes at p (8-byte aligned) as loaded, or, unaligned, bytes j and j + 4 at byte 0 of
// each word (two byte loads): PairedNibblesToHalf2's input after a byte permute.
__device__ __forceinline__ uint2 Row8(const uint8_t* p, int j, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint2*>(p);
  return make_uint2(p[j], p[j + 4]);
}

// Bytes 0 and 2 of x, each shifted right by sh (0 or 4), their low nibbles -> FP16x2 of
// nibble - 8 (low half <- byte 0), exact.
__device__ __forceinline__ uint32_t PairedNibblesToHalf2(uint32_t x, int sh) {
  const uint32_t v = FsqPairedNibbleBits(x, sh);  // 1024 + nibble
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&v), __float2half2_rn(1032.0f));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// FsqInPlaceNibbleBits' halves -> FP16x2 of nibble - 8, exact: one FMA by the lane's
// (scale, offset) pair (FsqInPlaceNibbleScale / Offset of its sh).
__device__ __forceinline__ uint32_t InPlaceNibblesToHalf2(uint32_t x, int sh, __half2 scale,
                                                          __half2 offset) {
  const uint32_t v = FsqInPlaceNibbleBits(x, sh);
  const __half2 h = __hfma2(*reinterpret_cast<const __half2*>(&v), scale, offset);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Byte k of row r of a stage tile (fsq_i8_fragments.h: 16-byte chunks XOR (r & 7) when
// cb is a multiple of 128).
__device__ __forceinline__ const uint8_t* StageAt(const uint8_t* tile, int r, int k, int cb,
                                                  bool swz) {
  return FsqStageAt(tile, r, k, cb, swz);
}

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void CpAsyncWaitOne() { asm volatile("cp.async.wait_group 1;\n"); }

// Rotates (x, y) of one pair by the angle whose (cos, sin) is base * step.
__device__ __forceinline__ void Rotate(float& x, float& y, float2 base, float2 step) {
  const float c = base.x * step.x - base.y * step.y;
  const float s = base.y * step.x + base.x * step.y;
  const float nx = x * c - y * s;
  y = x * s + y * c;
  x = nx;
}

// Half pairing with rotary / 16 == kOff: dim 8n + 2t + e (n < kOff) pairs with n + kOff.
template <int kOff, int NT>
__device__ __forceinline__ void RopeHalf(float (&acc)[NT][4], const float2* base,
                                         const float2* tab_g, const float2* tab_g8, int t, int ts) {
#pragma unroll
  for (int n = 0; n < kOff; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 8 * n + 2 * t + e;
      Rotate(acc[n][e], acc[n + kOff][e], base[i], tab_g[i * ts]);
      Rotate(acc[n][2 + e], acc[n + kOff][2 + e], base[i], tab_g8[i * ts]);
    }
  }
}

template <int NT, int... kOffs>
__device__ __forceinline__ void RopeHalfDispatch(int off, float (&acc)[NT][4], const float2* base,
                                                 const float2* tab_g, const float2* tab_g8, int t,
                                                 int ts) {
  ((off == kOffs ? RopeHalf<kOffs, NT>(acc, base, tab_g, tab_g8, t, ts) : void()), ...);
}

template <int NT, int... kOffs>
__device__ __forceinline__ void RopeHalfAny(int off, float (&acc)[NT][4], const float2* base,
                                            const float2* tab_g, const float2* tab_g8, int t,
                                            int ts, std::integer_sequence<int, kOffs...>) {
  RopeHalfDispatch<NT, (kOffs + 1)...>(off, acc, base, tab_g, tab_g8, t, ts);
}

struct Smem {
  uint2* wk;       // [kchunks][D / 8][32] the head's W_k fragments; after the loop:
  uint32_t* q_hi;  // [8][D] TF32 digits of the scaled queries
  uint32_t* q_lo;
  float2* tab;     // [D / 2][TabStride] (cos, sin) of r f_i / scaling, r < 16 MTOK
  double* freq;    // [D / 2]
  float2* base;    // [kWarps][D / 2]
  uint8_t* stage;  // [kWarps][2][stage_bytes]
  float* comb_o;   // [kWarps][MT * 16][8]
  float* comb_m;   // [kWarps][8]
  float* comb_l;   // [kWarps][8]
  float4* col;     // two CTAs per SM only: [D / 8][4] the head's (scale, bias) in slot order
  float2* kn;      // two CTAs per SM only: [D / 8][4] the key norm's weights in slot order
};

// Padded shared-memory strides (bank conflicts): query rows of D + 8 words; the angle table
// is [pair][row] with TabStride rows per pair.
template <int D>
__host__ __device__ constexpr int QStride() {
  return D + 8;
}
template <int MTOK>
__host__ __device__ constexpr int TabStride() {
  return 16 * MTOK + 4;
}

// The W_k fragments of one head, and the warps' states they give way to after the tiles.
template <int D, int MT>
__host__ __device__ constexpr size_t UnionBytes(int kchunks) {
  const size_t wk = size_t{256} * kchunks * (D / 8), comb = size_t{kWarps} * MT * 16 * 8 * 4;
  return wk > comb ? wk : comb;
}

// Two CTAs per SM (kOcc2): everything the tiles read (W_k fragments, frequencies, queries,
// angle tables, base rotations, the head's (scale, bias) and key norm weights, the stages)
// lies in one region that the warps' states take over after the tiles, so a CTA holds
// max(that region, the states) instead of their sum (G 256, d 128: 90 KB, two per SM; the one-CTA
// layout 120.5 KB).
template <int D, int MT, int MTOK>
__host__ __device__ constexpr size_t Occ2LoopBytes(int stage_bytes, int kchunks) {
  return size_t{256} * kchunks * (D / 8) + size_t{D / 2} * 8 + size_t{8} * QStride<D>() * 4 * 2 +
         size_t{TabStride<MTOK>()} * (D / 2) * 8 + size_t{kWarps} * (D / 2) * 8 +
         size_t{D / 2} * 16 + size_t{D / 2} * 8 + size_t{kWarps} * 2 * stage_bytes;
}

template <int D, int MT, int MTOK, bool kOcc2 = false>
__host__ __device__ constexpr size_t SmemBytes(int stage_bytes, int kchunks) {
  if constexpr (kOcc2) {
    const size_t loop = Occ2LoopBytes<D, MT, MTOK>(stage_bytes, kchunks),
                 comb = size_t{kWarps} * MT * 16 * 8 * 4;
    return (loop > comb ? loop : comb) + size_t{kWarps} * 8 * 4 * 2;
  } else {
    return UnionBytes<D, MT>(kchunks) + size_t{8} * QStride<D>() * 4 * 2 +
           size_t{TabStride<MTOK>()} * (D / 2) * 8 + size_t{D / 2} * 8 +
           size_t{kWarps} * (D / 2) * 8 + size_t{kWarps} * 2 * stage_bytes +
           size_t{kWarps} * 8 * 4 * 2;
  }
}

// The two-CTA layout (SmemBytes<..., true>): [W_k | freq | q_hi | q_lo | tab | base | col |
// kn | stages], the warps' states from its start once the tiles are done, then comb_m, comb_l.
template <int D, int MT, int MTOK>
__device__ Smem CarveSmemOcc2(uint8_t* p, int kchunks, int stage_bytes) {
  Smem s;
  uint8_t* const start = p;
  s.wk = reinterpret_cast<uint2*>(p);
  s.comb_o = reinterpret_cast<float*>(p);
  p += size_t{256} * kchunks * (D / 8);
  s.freq = reinterpret_cast<double*>(p);
  p += (D / 2) * 8;
  s.q_hi = reinterpret_cast<uint32_t*>(p);
  p += 8 * QStride<D>() * 4;
  s.q_lo = reinterpret_cast<uint32_t*>(p);
  p += 8 * QStride<D>() * 4;
  s.tab = reinterpret_cast<float2*>(p);
  p += TabStride<MTOK>() * (D / 2) * 8;
  s.base = reinterpret_cast<float2*>(p);
  p += kWarps * (D / 2) * 8;
  s.col = reinterpret_cast<float4*>(p);
  p += (D / 2) * 16;
  s.kn = reinterpret_cast<float2*>(p);
  p += (D / 2) * 8;
  s.stage = p;  // 16-byte aligned: every piece above is a multiple of 16 bytes
  const size_t loop = Occ2LoopBytes<D, MT, MTOK>(stage_bytes, kchunks),
               comb = size_t{kWarps} * MT * 16 * 8 * 4;
  p = start + (loop > comb ? loop : comb);
  s.comb_m = reinterpret_cast<float*>(p);
  s.comb_l = reinterpret_cast<float*>(p + kWarps * 8 * 4);
  return s;
}

template <int D, int MT, int MTOK>
__device__ Smem CarveSmem(uint8_t* p, int kchunks) {
  Smem s;
  s.col = nullptr;
  s.kn = nullptr;
  s.wk = reinterpret_cast<uint2*>(p);
  s.comb_o = reinterpret_cast<float*>(p);  // [kWarps][MT * 16][8], once the tiles are done
  p += UnionBytes<D, MT>(kchunks);
  s.freq = reinterpret_cast<double*>(p);
  p += (D / 2) * 8;
  s.q_hi = reinterpret_cast<uint32_t*>(p);
  p += 8 * QStride<D>() * 4;
  s.q_lo = reinterpret_cast<uint32_t*>(p);
  p += 8 * QStride<D>() * 4;
  s.tab = reinterpret_cast<float2*>(p);
  p += TabStride<MTOK>() * (D / 2) * 8;
  s.base = reinterpret_cast<float2*>(p);
  p += kWarps * (D / 2) * 8;
  s.comb_m = reinterpret_cast<float*>(p);
  p += kWarps * 8 * 4;
  s.comb_l = reinterpret_cast<float*>(p);
  p += kWarps * 8 * 4;
  s.stage = p;  // 16-byte aligned: every piece above is a multiple of 16 bytes
  return s;
}

// MTOK: 16-token m-tiles per warp tile (2: every W_k fragment read from shared memory feeds
// two MMAs; needs page_size % 32 == 0 and the registers of small D x G). kI8: the key rebuild
// on int8 tensor cores (u8 codes x s8 W_k, m16n8k32), else FP16 (m16n8k16). kOcc2 (int8,
// MTOK 1 only): at most 128 registers a thread, two CTAs per SM (cuda_fsq_i8.h kInt8Occ2):
// steps 1-3 in passes of FsqI8PassTiles n-tiles (4 x 4 accumulators beside the 64 of the value
// sums at MT 16, 8 x 4 beside 32 at MT 8), the n-tiles in slot order (FsqI8SlotTile:
// both halves of a RoPE pair in one pass); the CTA copies W_k's fragments, the queries,
// (scale, bias) and the key norm's weights into shared memory in slot order, so every slot's
// address is a constant. The sums over dims (scores, key norm) do not depend on the order.
// kCB (kOcc2 only; 0: read at run time): the code bytes per token compiled in, for the one
// geometry FsqOcc2Specialized names; the same arithmetic on constants.
template <int D, int MT, int MTOK, bool kI8, bool kOcc2 = false, int kCB = 0>
__global__ void __launch_bounds__(kWarps * 32, kOcc2 ? 2 : 1) FsqDecodeKernel(const PartArgs a) {
  static_assert(!kOcc2 || (kI8 && MTOK == 1), "the two-CTA variant is int8 with MTOK 1");
  static_assert(kCB == 0 || (kOcc2 && (kCB + 7) / 8 <= MT), "kCB: the two-CTA variant's codes");
  constexpr int NT = D / 8;
  constexpr int kTok = kTile * MTOK;  // tokens per warp tile
  // The code bytes per token and what follows from them: compile-time constants where kCB is
  // set (the launcher checked a.code_bytes == kCB), so the stage addresses, the alignment
  // tests and the loop bounds fold away; else the launch's values. G and G + 1 share a code
  // size and these counts (ceil(G / 32) = ceil(ceil(G / 2) / 16), ceil(G / 16) likewise).
  const int cb = kCB > 0 ? kCB : a.code_bytes;
  const int kchunks = kCB > 0 ? (kCB + 15) / 16 : a.kchunks;
  const int slices = kCB > 0 ? (kCB + 7) / 8 : a.slices;
  const int stage_bytes = kCB > 0 ? StageBytes(kCB, kTok) : a.stage_bytes;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const Smem sm = kOcc2 ? CarveSmemOcc2<D, MT, MTOK>(smem_raw, kchunks, stage_bytes)
                        : CarveSmem<D, MT, MTOK>(smem_raw, kchunks);
  const int split = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int group = a.geo.num_q_heads / a.geo.num_kv_heads;
  const int rows = a.geo.batch * a.geo.num_q_heads;
  const int half_rot = a.rotary / 2;
  // kCB: step 5's (scale, offset) for this lane's nibble (sh = 4 (g & 1), below).
  const __half2 nib_sc = __float2half2_rn(FsqInPlaceNibbleScale(4 * (g & 1)));
  const __half2 nib_off = __float2half2_rn(FsqInPlaceNibbleOffset(4 * (g & 1)));
  // kOcc2: the n-tile of slot k (above).
  const int koff = kOcc2 && a.rotary > 0 && !a.interleaved ? a.rotary / 16 : 0;
  auto slot_tile = [koff](int k) { return FsqI8SlotTile(k, koff); };

  // Queries (scaled, two TF32 digits), RoPE frequencies and the in-tile angle table. kCB:
  // the digits in the A operand's order of step 3's MMAs, [slot][lane] (over q_hi and q_lo:
  // both regions, contiguous), so a lane loads its four registers with one 16-byte load:
  // (hi, lo) of dims 2t and 2t + 1 of its head g in the slot.
  if constexpr (kCB > 0) {
    static_assert(NT * 32 * 16 <= 2 * 8 * QStride<D>() * 4, "q_hi and q_lo hold the A operands");
    uint4* qa = reinterpret_cast<uint4*>(sm.q_hi);
    for (int i = tid; i < NT * 32; i += blockDim.x) {
      const int slot = i >> 5, qg = (i & 31) >> 2, qt = i & 3;
      uint32_t d[4] = {0, 0, 0, 0};
      if (qg < group) {
        const float* qrow =
            a.q + (static_cast<int64_t>(b) * a.geo.num_q_heads + head * group + qg) * D;
        for (int e = 0; e < 2; ++e) {
          const float v = qrow[8 * slot_tile(slot) + 2 * qt + e] * a.q_scale;
          d[2 * e] = Tf32(v);
          d[2 * e + 1] = Tf32(v - __uint_as_float(d[2 * e]));
        }
      } else {
        d[0] = d[2] = Tf32(0.0f);
        d[1] = d[3] = Tf32(0.0f);
      }
      qa[i] = make_uint4(d[0], d[1], d[2], d[3]);
    }
  }
  for (int i = tid; kCB == 0 && i < kMaxGroup * D; i += blockDim.x) {
    const int j = i / D, dim = i % D;
    float v = 0.0f;
    if (j < group) {
      const int src = kOcc2 ? 8 * slot_tile(dim >> 3) + (dim & 7) : dim;
      v = a.q[(static_cast<int64_t>(b) * a.geo.num_q_heads + head * group + j) * D + src] *
          a.q_scale;
    }
    const uint32_t hi = Tf32(v);
    sm.q_hi[j * QStride<D>() + dim] = hi;
    sm.q_lo[j * QStride<D>() + dim] = Tf32(v - __uint_as_float(hi));
  }
  for (int i = tid; i < half_rot; i += blockDim.x) {
    sm.freq[i] = pow(a.theta, -2.0 * i / a.rotary);
  }
  __syncthreads();
  for (int i = tid; i < kTok * half_rot; i += blockDim.x) {
    const int r = i / half_rot, p = i % half_rot;
    float s, c;
    sincosf(static_cast<float>(r * a.inv_scaling * sm.freq[p]), &s, &c);
    sm.tab[p * TabStride<MTOK>() + r] = make_float2(c, s);
  }
  __syncthreads();

  const int len = a.list.lengths[b];
  const int begin = split * a.tokens_per_split;
  const int end = min(len, begin + a.tokens_per_split);
  const int64_t pos0 = a.positions[b];
  const int32_t* table = a.list.page_table + static_cast<int64_t>(b) * a.list.max_pages;
  const int ps = a.geo.page_size;
  const bool swz = (cb & 127) == 0;  // StageAt
  uint8_t* stage = sm.stage + warp * 2 * stage_bytes;
  float2* base = sm.base + warp * (D / 2);
  // The head's W_k fragments into shared memory (read by every warp, every tile).
  {
    const uint4* src =
        reinterpret_cast<const uint4*>(a.wk + static_cast<size_t>(head) * kchunks * NT * 32);
    uint4* dst = reinterpret_cast<uint4*>(sm.wk);
    if constexpr (kOcc2) {  // slot k of k-step s <- n-tile slot_tile(k)
      for (int i = tid; i < kchunks * NT * 16; i += blockDim.x) {
        const int k = (i >> 4) % NT;
        CpAsync16(dst + i, src + i + (slot_tile(k) - k) * 16);
      }
      const float4* col = a.col + head * (D / 2);
      for (int i = tid; i < D / 2; i += blockDim.x) {
        const int k = i >> 2, from = slot_tile(k) * 4 + (i & 3);
        sm.col[i] = col[from];
        if (a.key_norm != nullptr) sm.kn[i] = reinterpret_cast<const float2*>(a.key_norm)[from];
      }
    } else {
      for (int i = tid; i < kchunks * NT * 16; i += blockDim.x) CpAsync16(dst + i, src + i);
    }
    CpAsyncCommit();
    asm volatile("cp.async.wait_all;\n");
    __syncthreads();
  }
  const uint2* wk = sm.wk + lane;
  const float4* col = a.col + head * (D / 2);

  auto issue = [&](int tile, int buf) {
    if (tile < end) {
      const int page = table[tile / ps];
      const uint8_t* src =
          a.list.pages + page * a.list.page_stride + static_cast<int64_t>(tile % ps) * cb;
      uint8_t* dst = stage + buf * stage_bytes;
      for (int c = lane; c < MTOK * cb; c += 32) {
        uint8_t* to = dst + 16 * c;
        if (swz) {  // chunk c is chunk c % (cb / 16) of row c / (cb / 16)
          const int r = c / (cb >> 4);
          to = const_cast<uint8_t*>(StageAt(dst, r, (c - r * (cb >> 4)) << 4, cb, true));
        }
        CpAsync16(to, src + 16 * c);
      }
    }
    CpAsyncCommit();
  };

  float o[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  int buf = 0;
  int tile = begin + warp * kTok;
  issue(tile, 0);
  for (; tile < end; tile += kWarps * kTok, buf ^= 1) {
    issue(tile + kWarps * kTok, buf ^ 1);
    // Base rotation of the tile's first position, pair by pair (float64 range reduction).
    const double p0 = static_cast<double>(pos0 + tile) * a.inv_scaling;
    for (int i = lane; i < half_rot; i += 32) {
      const double ang = p0 * sm.freq[i];
      const double k = rint(ang * 0.15915494309189535);
      const double r = fma(-k, 6.283185307179586, ang);
      const double r2 = fma(-k, 2.4492935982947064e-16, r);
      float s, c;
      sincosf(static_cast<float>(r2), &s, &c);
      base[i] = make_float2(c, s);
    }
    CpAsyncWaitOne();
    __syncwarp();
    const uint8_t* cs = stage + buf * stage_bytes;

    const bool aligned = (cb & 7) == 0;  // BytePair's 8-byte loads
    // Steps 4 and 5 for m-tile u of the warp tile from the scores sc of head g, tokens 2t,
    // 2t + 1, 2t + 8, 2t + 9 (masked here past the list's end).
    auto attend = [&](float(&sc)[4], int u) {
      // 4. Online softmax of head g over tokens 2t, 2t + 1, 2t + 8, 2t + 9.
      const int n_valid = end - tile - 16 * u;
      const int tok[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
      float tmax = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (tok[k] >= n_valid) sc[k] = -INFINITY;
        tmax = fmaxf(tmax, sc[k]);
      }
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      const float m_new = fmaxf(m, tmax);
      const float alpha = exp2f(m - m_new);
      float p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] = exp2f(sc[k] - m_new);
      l = l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
      m = m_new;
      const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * t);
      const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
      const uint32_t pb0 = PackHalf2(p[0], p[1]), pb1 = PackHalf2(p[2], p[3]);

      // 5. O^T += Z^T P^T.
      const int sh = 4 * (g & 1);
      const int zr = 16 * u + 2 * t;  // rows (tokens) zr, zr + 1, zr + 8, zr + 9
      const int zj = g >> 1;
      if constexpr (kI8) {
        // The same products with fewer instructions: a row's 8 bytes as loaded, the two
        // tokens' bytes zj paired by one byte permute, one shift and mask for the nibble; the
        // states rescaled only when a head's running max rose (alpha != 1) this tile.
        const bool rescale = __any_sync(0xffffffffu, alpha != 1.0f);
        const uint32_t sel = FsqPairSelector(zj, aligned);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (rescale) {
            o[mt][0] *= alpha0;
            o[mt][1] *= alpha1;
            o[mt][2] *= alpha0;
            o[mt][3] *= alpha1;
          }
          if (mt < slices) {
            const uint2 w0 = Row8(StageAt(cs, zr, 8 * mt, cb, swz), zj, aligned);
            const uint2 w1 = Row8(StageAt(cs, zr + 1, 8 * mt, cb, swz), zj, aligned);
            const uint2 w8 = Row8(StageAt(cs, zr + 8, 8 * mt, cb, swz), zj, aligned);
            const uint2 w9 = Row8(StageAt(cs, zr + 9, 8 * mt, cb, swz), zj, aligned);
            uint32_t af[4];
            if constexpr (kCB > 0) {  // the nibble masked in place: no shift
              af[0] = InPlaceNibblesToHalf2(__byte_perm(w0.x, w1.x, sel), sh, nib_sc, nib_off);
              af[1] = InPlaceNibblesToHalf2(__byte_perm(w0.y, w1.y, sel), sh, nib_sc, nib_off);
              af[2] = InPlaceNibblesToHalf2(__byte_perm(w8.x, w9.x, sel), sh, nib_sc, nib_off);
              af[3] = InPlaceNibblesToHalf2(__byte_perm(w8.y, w9.y, sel), sh, nib_sc, nib_off);
            } else {
              af[0] = PairedNibblesToHalf2(__byte_perm(w0.x, w1.x, sel), sh);
              af[1] = PairedNibblesToHalf2(__byte_perm(w0.y, w1.y, sel), sh);
              af[2] = PairedNibblesToHalf2(__byte_perm(w8.x, w9.x, sel), sh);
              af[3] = PairedNibblesToHalf2(__byte_perm(w8.y, w9.y, sel), sh);
            }
            MmaF16(o[mt], af, pb0, pb1);
          }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          o[mt][0] *= alpha0;
          o[mt][1] *= alpha1;
          o[mt][2] *= alpha0;
          o[mt][3] *= alpha1;
          if (mt < slices) {
            const uint2 w0 = BytePair(StageAt(cs, zr, 8 * mt, cb, swz), zj, aligned);
            const uint2 w1 = BytePair(StageAt(cs, zr + 1, 8 * mt, cb, swz), zj, aligned);
            const uint2 w8 = BytePair(StageAt(cs, zr + 8, 8 * mt, cb, swz), zj, aligned);
            const uint2 w9 = BytePair(StageAt(cs, zr + 9, 8 * mt, cb, swz), zj, aligned);
            uint32_t af[4];
            af[0] = NibblesToHalf2((w0.x >> sh) & 0xFu, (w1.x >> sh) & 0xFu);
            af[1] = NibblesToHalf2((w0.y >> sh) & 0xFu, (w1.y >> sh) & 0xFu);
            af[2] = NibblesToHalf2((w8.x >> sh) & 0xFu, (w9.x >> sh) & 0xFu);
            af[3] = NibblesToHalf2((w8.y >> sh) & 0xFu, (w9.y >> sh) & 0xFu);
            MmaF16(o[mt], af, pb0, pb1);
          }
        }
      }
    };
    constexpr float kBase = KeyAccBase<kI8>();
    if constexpr (kOcc2) {
      // Steps 1-3 in passes of kPT key n-tiles (slots p kPT .. p kPT + kPT - 1); the scores
      // and the key norm's sums of squares add up over the passes.
      constexpr int kPT = FsqI8PassTiles(D, MT);
      const bool aligned4 = (cb & 3) == 0;
      float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
      for (int p = 0; p < NT / kPT; ++p) {
        // 1. K = Z W_k^T on the pass's slots (the codes' A fragments are read again per pass).
        float acc[kPT][4];
#pragma unroll
        for (int j = 0; j < kPT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = kBase;
#pragma unroll 2
        for (int s = 0; s < kchunks; ++s) {
          uint32_t af[4];
          const uint32_t lo = Word(StageAt(cs, g, 16 * s + 4 * t, cb, swz), aligned4);
          const uint32_t hi = Word(StageAt(cs, g + 8, 16 * s + 4 * t, cb, swz), aligned4);
          FsqI8CodeFragments(lo, &af[0], &af[2]);
          FsqI8CodeFragments(hi, &af[1], &af[3]);
          const uint2* bp = wk + (static_cast<size_t>(s) * NT + p * kPT) * 32;
#pragma unroll
          for (int j = 0; j < kPT; ++j) {
            const uint2 bf = bp[j * 32];
            MmaU8S8(acc[j], af, bf.x, bf.y);
          }
        }
        // 2. Row scale and bias; the key norm's sums of squares, then its weights (its
        // 1 / rms multiplies the scores below); RoPE.
#pragma unroll
        for (int j = 0; j < kPT; ++j) {
          const float4 cv = sm.col[(p * kPT + j) * 4 + t];
          acc[j][0] = fmaf(acc[j][0], cv.x, cv.y);
          acc[j][1] = fmaf(acc[j][1], cv.z, cv.w);
          acc[j][2] = fmaf(acc[j][2], cv.x, cv.y);
          acc[j][3] = fmaf(acc[j][3], cv.z, cv.w);
        }
        if (a.key_norm != nullptr) {
#pragma unroll
          for (int j = 0; j < kPT; ++j) {
            ss0 += acc[j][0] * acc[j][0] + acc[j][1] * acc[j][1];
            ss1 += acc[j][2] * acc[j][2] + acc[j][3] * acc[j][3];
            const float2 w = sm.kn[(p * kPT + j) * 4 + t];
            acc[j][0] *= w.x;
            acc[j][1] *= w.y;
            acc[j][2] *= w.x;
            acc[j][3] *= w.y;
          }
        }
        if (a.rotary > 0) {
          constexpr int ts = TabStride<MTOK>();
          const float2* tab_g = sm.tab + g;
          const float2* tab_g8 = tab_g + 8;
          if (a.interleaved) {  // slot k is n-tile k
#pragma unroll
            for (int j = 0; j < kPT; ++j) {
              const int i = 4 * (p * kPT + j) + t;  // dims 2i, 2i + 1
              if (i < half_rot) {
                Rotate(acc[j][0], acc[j][1], base[i], tab_g[i * ts]);
                Rotate(acc[j][2], acc[j][3], base[i], tab_g8[i * ts]);
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < kPT; j += 2) {
              const int k = p * kPT + j;  // slots k, k + 1: n-tiles k / 2 and koff + k / 2
              if (k < 2 * koff) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int i = 4 * k + 2 * t + e;  // dim 8 (k / 2) + 2t + e
                  Rotate(acc[j][e], acc[j + 1][e], base[i], tab_g[i * ts]);
                  Rotate(acc[j][2 + e], acc[j + 1][2 + e], base[i], tab_g8[i * ts]);
                }
              }
            }
          }
        }
        // 3. S^T += Q K^T on the pass's slots (the queries are in slot order).
#pragma unroll
        for (int j = 0; j < kPT; ++j) {
          if constexpr (kCB > 0) {  // the operands in order: one 16-byte load, no moves
            const uint4 qa = reinterpret_cast<const uint4*>(sm.q_hi)[(p * kPT + j) * 32 + lane];
            MmaTf32(s0, qa.x, qa.y, qa.z, qa.w, Tf32(acc[j][0]), Tf32(acc[j][1]));
            MmaTf32(s1, qa.x, qa.y, qa.z, qa.w, Tf32(acc[j][2]), Tf32(acc[j][3]));
          } else {
            const int c = 8 * (p * kPT + j) + 2 * t;
            const uint2 qh = *reinterpret_cast<const uint2*>(sm.q_hi + g * QStride<D>() + c);
            const uint2 ql = *reinterpret_cast<const uint2*>(sm.q_lo + g * QStride<D>() + c);
            MmaTf32(s0, qh.x, ql.x, qh.y, ql.y, Tf32(acc[j][0]), Tf32(acc[j][1]));
            MmaTf32(s1, qh.x, ql.x, qh.y, ql.y, Tf32(acc[j][2]), Tf32(acc[j][3]));
          }
        }
      }
      float sc[4] = {s0[0] + s0[2], s0[1] + s0[3], s1[0] + s1[2], s1[1] + s1[3]};
      if (a.key_norm != nullptr) {  // rows g, g + 8; tokens 2t, 2t + 1 are rows of quads 2t, 2t + 1
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
        const float inv0 = 1.0f / sqrtf(ss0 / D + a.key_norm_eps);
        const float inv1 = 1.0f / sqrtf(ss1 / D + a.key_norm_eps);
        sc[0] *= __shfl_sync(0xffffffffu, inv0, 8 * t);
        sc[1] *= __shfl_sync(0xffffffffu, inv0, 8 * t + 4);
        sc[2] *= __shfl_sync(0xffffffffu, inv1, 8 * t);
        sc[3] *= __shfl_sync(0xffffffffu, inv1, 8 * t + 4);
      }
      attend(sc, 0);
    } else {
      // 1. K = Z W_k^T.
      float accs[MTOK][NT][4];
#pragma unroll
      for (int u = 0; u < MTOK; ++u) {
#pragma unroll
        for (int n = 0; n < NT; ++n)
          accs[u][n][0] = accs[u][n][1] = accs[u][n][2] = accs[u][n][3] = kBase;
      }
      if constexpr (kI8) {
        // k-step s: the lane's word of row r holds latents 32 s + 8 t .. + 7 (nibble i: latent
        // 32 s + 8 t + i); its even nibbles are k = 4t..4t+3 of the A fragment, its odd ones
        // k = 16 + 4t..; the prepared B fragments follow the same order
        // (fsq_decode_attention_i8.cu).
        const bool aligned4 = (cb & 3) == 0;
#pragma unroll 2
        for (int s = 0; s < kchunks; ++s) {
          uint32_t af[MTOK][4];
#pragma unroll
          for (int u = 0; u < MTOK; ++u) {
            const uint32_t lo = Word(StageAt(cs, 16 * u + g, 16 * s + 4 * t, cb, swz), aligned4);
            const uint32_t hi =
                Word(StageAt(cs, 16 * u + g + 8, 16 * s + 4 * t, cb, swz), aligned4);
            FsqI8CodeFragments(lo, &af[u][0], &af[u][2]);
            FsqI8CodeFragments(hi, &af[u][1], &af[u][3]);
          }
          const uint2* bp = wk + static_cast<size_t>(s) * NT * 32;
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const uint2 bf = bp[n * 32];
#pragma unroll
            for (int u = 0; u < MTOK; ++u) MmaU8S8(accs[u][n], af[u], bf.x, bf.y);
          }
        }
      } else {
#pragma unroll 2
        for (int s = 0; s < slices; ++s) {
          uint32_t af[MTOK][4];
#pragma unroll
          for (int u = 0; u < MTOK; ++u) {
            const uint2 lo = BytePair(StageAt(cs, 16 * u + g, 8 * s, cb, swz), t, aligned);
            const uint2 hi = BytePair(StageAt(cs, 16 * u + g + 8, 8 * s, cb, swz), t, aligned);
            af[u][0] = ByteToHalf2(lo.x);
            af[u][1] = ByteToHalf2(hi.x);
            af[u][2] = ByteToHalf2(lo.y);
            af[u][3] = ByteToHalf2(hi.y);
          }
          const uint2* bp = wk + static_cast<size_t>(s) * NT * 32;
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const uint2 bf = bp[n * 32];
#pragma unroll
            for (int u = 0; u < MTOK; ++u) MmaF16(accs[u][n], af[u], bf.x, bf.y);
          }
        }
      }
      __syncwarp();  // base[] written
#pragma unroll
      for (int u = 0; u < MTOK; ++u) {
        float(&acc)[NT][4] = accs[u];
        // 2. Row scale and bias, key norm, RoPE.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float4 cv = __ldg(col + n * 4 + t);
          acc[n][0] = fmaf(acc[n][0], cv.x, cv.y);
          acc[n][1] = fmaf(acc[n][1], cv.z, cv.w);
          acc[n][2] = fmaf(acc[n][2], cv.x, cv.y);
          acc[n][3] = fmaf(acc[n][3], cv.z, cv.w);
        }
        // int8: the keys' 1 / rms (rows g, g + 8) multiplies their scores in step 3 instead of
        // every element here (RoPE and the dot product are linear).
        float inv0 = 1.0f, inv1 = 1.0f;
        if (a.key_norm != nullptr) {
          float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            ss0 += acc[n][0] * acc[n][0] + acc[n][1] * acc[n][1];
            ss1 += acc[n][2] * acc[n][2] + acc[n][3] * acc[n][3];
          }
          ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
          ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
          ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
          ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
          inv0 = 1.0f / sqrtf(ss0 / D + a.key_norm_eps);
          inv1 = 1.0f / sqrtf(ss1 / D + a.key_norm_eps);
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const float2 w = __ldg(reinterpret_cast<const float2*>(a.key_norm) + n * 4 + t);
            if constexpr (kI8) {
              acc[n][0] *= w.x;
              acc[n][1] *= w.y;
              acc[n][2] *= w.x;
              acc[n][3] *= w.y;
            } else {
              acc[n][0] *= inv0 * w.x;
              acc[n][1] *= inv0 * w.y;
              acc[n][2] *= inv1 * w.x;
              acc[n][3] *= inv1 * w.y;
            }
          }
        }
        if (a.rotary > 0) {
          constexpr int ts = TabStride<MTOK>();
          const float2* tab_g = sm.tab + 16 * u + g;
          const float2* tab_g8 = tab_g + 8;
          if (a.interleaved) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              const int i = 4 * n + t;  // dims 2i, 2i + 1
              if (i < half_rot) {
                Rotate(acc[n][0], acc[n][1], base[i], tab_g[i * ts]);
                Rotate(acc[n][2], acc[n][3], base[i], tab_g8[i * ts]);
              }
            }
          } else {
            RopeHalfAny<NT>(a.rotary / 16, acc, base, tab_g, tab_g8, t, ts,
                            std::make_integer_sequence<int, NT / 2>{});
          }
        }

        // 3. S^T = Q K^T (two token n-tiles of 8; int8: each in two chains of MMAs, even and
        // odd n, half as deep).
        constexpr int kChains = kI8 ? 2 : 1;
        float s0[kChains][4], s1[kChains][4];
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
#pragma unroll
          for (int k = 0; k < 4; ++k) s0[c][k] = s1[c][k] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint2 qh =
              *reinterpret_cast<const uint2*>(sm.q_hi + g * QStride<D>() + 8 * n + 2 * t);
          const uint2 ql =
              *reinterpret_cast<const uint2*>(sm.q_lo + g * QStride<D>() + 8 * n + 2 * t);
          MmaTf32(s0[n % kChains], qh.x, ql.x, qh.y, ql.y, Tf32(acc[n][0]), Tf32(acc[n][1]));
          MmaTf32(s1[n % kChains], qh.x, ql.x, qh.y, ql.y, Tf32(acc[n][2]), Tf32(acc[n][3]));
        }
#pragma unroll
        for (int c = 1; c < kChains; ++c) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            s0[0][k] += s0[c][k];
            s1[0][k] += s1[c][k];
          }
        }
        float sc[4] = {s0[0][0] + s0[0][2], s0[0][1] + s0[0][3], s1[0][0] + s1[0][2],
                       s1[0][1] + s1[0][3]};
        if (kI8 && a.key_norm != nullptr) {  // tokens 2t, 2t + 1 (rows of quads 2t, 2t + 1), + 8
          sc[0] *= __shfl_sync(0xffffffffu, inv0, 8 * t);
          sc[1] *= __shfl_sync(0xffffffffu, inv0, 8 * t + 4);
          sc[2] *= __shfl_sync(0xffffffffu, inv1, 8 * t);
          sc[3] *= __shfl_sync(0xffffffffu, inv1, 8 * t + 4);
        }
        attend(sc, u);
      }  // u
    }
    __syncwarp();  // the stage buffer and base[] are read before they are refilled
  }
  asm volatile("cp.async.wait_all;\n");
  __syncthreads();  // every warp is done with the W_k fragments: their space takes the states

  // Combine the CTA's warps.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (t == 0) {
    sm.comb_m[warp * 8 + g] = m;
    sm.comb_l[warp * 8 + g] = l;
  }
  float* co = sm.comb_o + warp * MT * 16 * 8;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    co[(mt * 16 + g) * 8 + 2 * t] = o[mt][0];
    co[(mt * 16 + g) * 8 + 2 * t + 1] = o[mt][1];
    co[(mt * 16 + g + 8) * 8 + 2 * t] = o[mt][2];
    co[(mt * 16 + g + 8) * 8 + 2 * t + 1] = o[mt][3];
  }
  __syncthreads();
  const int gp = slices * 16;
  for (int i = tid; i < group * gp; i += blockDim.x) {
    const int j = i / gp, lat = i % gp;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm.comb_m[w * 8 + j]);
    float num = 0.0f, den = 0.0f;
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm.comb_m[w * 8 + j] - M);
        den += f * sm.comb_l[w * 8 + j];
        num += f * sm.comb_o[(w * MT * 16 + lat) * 8 + j];
      }
    }
    const int64_t row = static_cast<int64_t>(b) * a.geo.num_q_heads + head * group + j;
    const int64_t at = static_cast<int64_t>(split) * rows + row;
    a.ws_z[at * gp + lat] = M > -INFINITY ? num / den : 0.0f;
    if (lat == 0) a.ws_lse[at] = M > -INFINITY ? M + log2f(den) : -INFINITY;
  }
}

// Output rows of W_v per block of the merge kernel: grid (kv heads, batch, D / kMergeRows).
constexpr int kMergeRows = 16;

// Combines the splits of the group's rows and applies W_v, b_v: one block of kWarps warps
// per (kv head, batch entry, kMergeRows rows of the output). Each block combines the splits
// itself (the group's few latent rows; its blocks share the loads through L2) so that the
// W_v products spread over D / kMergeRows times as many SMs: with one block per (kv head,
// batch entry) a batch-1 call ran 8 blocks, ~50 us of latency-bound loads (Nsight Compute,
// H100, bench/results/2026-12-05-h200-fsq-keys.md, session 25). The splits' weights first
// (a warp per row of the group: the max and the sum of 2^(lse - max) over the splits), then
// each latent's weighted sum over the splits with independent loads.
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    FsqMergeKernel(const float* ws_z, const float* ws_lse, int splits, DecodeGeometry geo,
                   int latent, int gp, const float* w_v, const float* b_v, float* part_o,
                   float* part_lse, int part_base) {
  extern __shared__ float zbar[];  // [group][latent]
  __shared__ float s_lse[kMaxGroup], s_max[kMaxGroup], s_inv[kMaxGroup];
  const int head = blockIdx.x, b = blockIdx.y, i0 = blockIdx.z * kMergeRows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = geo.num_q_heads / geo.num_kv_heads;
  const int rows = geo.batch * geo.num_q_heads;
  const int64_t row0 = static_cast<int64_t>(b) * geo.num_q_heads + head * group;
  for (int j = warp; j < group; j += kWarps) {
    float M = -INFINITY;
    for (int s = lane; s < splits; s += 32)
      M = fmaxf(M, ws_lse[static_cast<int64_t>(s) * rows + row0 + j]);
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float den = 0.0f;
    if (M > -INFINITY) {
      for (int s = lane; s < splits; s += 32)
        den += exp2f(ws_lse[static_cast<int64_t>(s) * rows + row0 + j] - M);
    }
    for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
    if (lane == 0) {
      s_max[j] = M;
      s_inv[j] = M > -INFINITY ? 1.0f / den : 0.0f;
      s_lse[j] = M > -INFINITY ? (M + log2f(den)) * 0.6931471805599453f : -INFINITY;
    }
  }
  __syncthreads();
  for (int i = tid; i < group * latent; i += blockDim.x) {
    const int j = i / latent, lat = i % latent;
    const float M = s_max[j];
    float num = 0.0f;
    if (M > -INFINITY) {
#pragma unroll 4
      for (int s = 0; s < splits; ++s) {
        const int64_t at = static_cast<int64_t>(s) * rows + row0 + j;
        num = fmaf(exp2f(ws_lse[at] - M), ws_z[at * gp + lat], num);
      }
    }
    zbar[j * latent + lat] = num * s_inv[j];
  }
  __syncthreads();
  for (int i = i0 + warp; i < i0 + kMergeRows && i < D; i += kWarps) {
    const float* wr = w_v + (static_cast<int64_t>(head) * D + i) * latent;
    float acc[kMaxGroup] = {};
#pragma unroll 4
    for (int k = lane; k < latent; k += 32) {
      const float w = __ldg(wr + k);
#pragma unroll
      for (int j = 0; j < kMaxGroup; ++j) {
        if (j < group) acc[j] = fmaf(w, zbar[j * latent + k], acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxGroup; ++j) {
      if (j >= group) break;
      float v = acc[j];
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) {
        const bool empty = s_lse[j] == -INFINITY;
        const int64_t at = static_cast<int64_t>(part_base) * rows + row0 + j;
        part_o[at * D + i] = empty ? 0.0f : v + b_v[static_cast<int64_t>(head) * D + i];
        if (i == 0) part_lse[at] = s_lse[j];
      }
    }
  }
}

template <int D, int MT, int MTOK, bool kI8, bool kOcc2 = false, int kCB = 0>
cudaError_t LaunchParts(const PartArgs& a, int splits, cudaStream_t stream) {
  if (kCB > 0 && (a.code_bytes != kCB || a.stage_bytes != StageBytes(kCB, kTile * MTOK))) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = SmemBytes<D, MT, MTOK, kOcc2>(a.stage_bytes, a.kchunks);
  const cudaError_t e = RaiseDynamicSmem<FsqDecodeKernel<D, MT, MTOK, kI8, kOcc2, kCB>>(smem);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(a.geo.num_kv_heads),
                  static_cast<unsigned>(a.geo.batch));
  FsqDecodeKernel<D, MT, MTOK, kI8, kOcc2, kCB><<<grid, kWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

// LaunchFsqDecodeParts (cuda_fsq.h) with the key rebuild of kI8; the prepared decoder holds
// frag_bytes of B fragments, then the (scale, bias) pairs. fixed_size (kOcc2): the instance
// with the code size compiled in where FsqOcc2Specialized names the geometry.
template <bool kI8, bool kOcc2 = false>
Error LaunchFsqDecode(const PagedList& list, const DecodeGeometry& geo, const FsqDecodeArgs& args,
                      int max_tokens, float* part_o, float* part_lse, int part_base,
                      cudaStream_t stream, const MergeTarget* merge, size_t frag_bytes,
                      bool fixed_size = false) {
  const FsqLayerCodec& c = args.codec;
  const int G = c.latent_width;
  const RopeSpec& rope = args.rope;
  if (geo.batch < 1 || geo.num_kv_heads < 1 || geo.num_q_heads % geo.num_kv_heads != 0 ||
      geo.num_q_heads / geo.num_kv_heads > kMaxGroup || geo.page_size < kTile ||
      geo.page_size % kTile != 0 || G < 1 || G > kFsqCudaMaxLatent || c.head_dim != geo.head_dim ||
      c.num_kv_heads != geo.num_kv_heads || c.decoder_v == nullptr || c.bias_v == nullptr ||
      args.prepared == nullptr || args.positions == nullptr || args.q == nullptr ||
      args.workspace == nullptr || args.splits < 1 || max_tokens < 0 || part_o == nullptr ||
      part_lse == nullptr || part_base < 0 || list.pages == nullptr || list.page_table == nullptr ||
      list.lengths == nullptr || reinterpret_cast<uintptr_t>(list.pages) % 16 != 0 ||
      list.page_stride % 16 != 0 || rope.rotary_dims < 0 || rope.rotary_dims % 2 != 0 ||
      rope.rotary_dims > geo.head_dim || (rope.rotary_dims > 0 && !(rope.scaling > 0.0)) ||
      (rope.rotary_dims > 0 && rope.pairing == RopePairing::kHalf && rope.rotary_dims % 16 != 0) ||
      (merge != nullptr && merge->r_v_t != nullptr)) {
    return ToError(cudaErrorInvalidValue);
  }
  PartArgs a{};
  a.list = list;
  a.geo = geo;
  a.latent = G;
  a.slices = (G + 15) / 16;
  a.kchunks = kI8 ? (G + 31) / 32 : a.slices;
  a.code_bytes = static_cast<int32_t>(FsqCodeBytes(G));
  const int64_t per = (int64_t{max_tokens} + args.splits - 1) / args.splits;
  // Two m-tiles per warp tile where the registers allow (small D x G) and a 32-token tile
  // stays in one page.
  const int mtok = !kOcc2 && geo.page_size % (2 * kTile) == 0 &&
                           ((a.slices <= 8 && geo.head_dim <= 128) || geo.head_dim == 64)
                       ? 2
                       : 1;
  const int tok = kTile * mtok;
  a.tokens_per_split = static_cast<int32_t>((per + tok - 1) / tok * tok);
  if (a.tokens_per_split == 0) a.tokens_per_split = tok;
  a.stage_bytes = StageBytes(a.code_bytes, tok);
  a.wk = static_cast<const uint2*>(args.prepared);
  a.col = reinterpret_cast<const float4*>(static_cast<const uint8_t*>(args.prepared) + frag_bytes);
  a.key_norm = c.key_norm;
  a.key_norm_eps = c.key_norm_eps;
  a.rotary = rope.rotary_dims;
  a.interleaved = rope.pairing == RopePairing::kInterleaved;
  a.theta = rope.theta;
  a.inv_scaling = rope.rotary_dims > 0 ? 1.0 / rope.scaling : 1.0;
  a.positions = args.positions;
  a.q = args.q;
  a.q_scale = args.softmax_scale * 1.4426950408889634f;
  const int rows = geo.batch * geo.num_q_heads;
  const int gp = a.slices * 16;
  a.ws_z = static_cast<float*>(args.workspace);
  a.ws_lse = a.ws_z + static_cast<size_t>(args.splits) * rows * gp;
  const cudaError_t e = DispatchHeadDim(geo.head_dim, [&](auto hd) -> cudaError_t {
    constexpr int D = decltype(hd)::value;
    cudaError_t err = cudaErrorInvalidValue;
    if constexpr (kOcc2) {
      // d 128 with 128 code bytes a token: the kernel with the codes' size compiled in.
      if (fixed_size && FsqOcc2Specialized(D, a.code_bytes)) {
        if constexpr (D == kFsqOcc2SpecD) {
          err = LaunchParts<D, 16, 1, true, true, kFsqOcc2SpecCb>(a, args.splits, stream);
        }
      } else {
        err = a.slices <= 8 ? LaunchParts<D, 8, 1, true, true>(a, args.splits, stream)
                            : LaunchParts<D, 16, 1, true, true>(a, args.splits, stream);
      }
    } else if constexpr (D == 256) {
      err = a.slices <= 8 ? LaunchParts<D, 8, 1, kI8>(a, args.splits, stream)
                          : LaunchParts<D, 16, 1, kI8>(a, args.splits, stream);
    } else if constexpr (D == 128) {
      err = a.slices > 8 ? LaunchParts<D, 16, 1, kI8>(a, args.splits, stream)
            : mtok == 2  ? LaunchParts<D, 8, 2, kI8>(a, args.splits, stream)
                         : LaunchParts<D, 8, 1, kI8>(a, args.splits, stream);
    } else {
      err = mtok == 2 ? (a.slices <= 8 ? LaunchParts<D, 8, 2, kI8>(a, args.splits, stream)
                                       : LaunchParts<D, 16, 2, kI8>(a, args.splits, stream))
                      : (a.slices <= 8 ? LaunchParts<D, 8, 1, kI8>(a, args.splits, stream)
                                       : LaunchParts<D, 16, 1, kI8>(a, args.splits, stream));
    }
    if (err != cudaSuccess) return err;
    const size_t smem = static_cast<size_t>(geo.num_q_heads / geo.num_kv_heads) * G * sizeof(float);
    static_assert(D % kMergeRows == 0, "the merge blocks split D evenly");
    FsqMergeKernel<D>
        <<<dim3(geo.num_kv_heads, geo.batch, D / kMergeRows), kWarps * 32, smem, stream>>>(
            a.ws_z, a.ws_lse, args.splits, geo, G, gp, c.decoder_v, c.bias_v, part_o, part_lse,
            part_base);
    return cudaGetLastError();
  });
  if (e != cudaSuccess || merge == nullptr) return ToError(e);
  return LaunchMergeParts(part_o, part_lse, merge->parts, rows, geo.head_dim, nullptr, merge->o,
                          merge->lse, stream, merge->faults, merge->rows_per_entry);
}

}  // namespace
}  // namespace kvcd::kernels::cuda
