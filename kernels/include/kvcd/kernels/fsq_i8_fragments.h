// The layouts and integer arithmetic of the int8 FSQ key rebuild (cuda/fsq_decode_kernel.cuh
// with kI8, cuda/fsq_decode_attention_i8.cu), shared by the kernel, its decoder preparation
// and the CPU tests that emulate the MMAs on them (cuda_fsq_test.cc), so the fragment orders
// and the folded bias are checked without a GPU.
//
// mma.sync m16n8k32 with 8-bit operands (PTX ISA; lane = 4 g + t): A register r (0..3) holds
// in byte i the element (row g + 8 (r & 1), k = 4 t + 16 (r >> 1) + i); B register r (0..1)
// holds in byte i the element (k = 4 t + 16 r + i, column g); C register r (0..3) the sum at
// (row g + 8 (r >> 1), column 2 t + (r & 1)).
//
// The key rebuild: A = codes (rows = tokens), B = W_k (columns = dims), k-step s covers the
// latents 32 s .. 32 s + 31 in the order FsqI8Latent gives: a lane's A registers come from
// ONE 4-byte word of its token row (bytes 16 s + 4 t ..), even nibbles to k = 4 t .., odd
// ones to k = 16 + 4 t ..
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/host_device.h"

namespace kvcd::kernels {

// The accumulators start at the bits of 1.5 * 2^23: an int32 sum S added to them with
// |S| < 2^22 reads back as the float 1.5 * 2^23 + S, exact.
inline constexpr uint32_t kFsqI8AccBaseBits = 0x4B400000u;
inline constexpr float kFsqI8AccBase = 12582912.0f;

// The latent (offset in its k-step) that k (0..31) of the m16n8k32 operands stands for.
KVCD_HOST_DEVICE constexpr int FsqI8Latent(int k) {
  return 8 * ((k & 15) >> 2) + 2 * (k & 3) + (k >> 4);
}

// A registers of a token row from the lane's word (bytes 16 s + 4 t .. + 3 of the row's code,
// byte 0 lowest): the nibbles z + 8 as u8, even ones (k = 4 t + i) and odd ones (k = 16 + ..).
KVCD_HOST_DEVICE inline void FsqI8CodeFragments(uint32_t word, uint32_t* even, uint32_t* odd) {
  *even = word & 0x0F0F0F0Fu;
  *odd = (word >> 4) & 0x0F0F0F0Fu;
}

// Bytes of a layer's prepared int8 B fragments ([Hkv][ksteps][head_dim / 8][32 lanes] of 8
// bytes, ksteps = ceil(G / 32)); the (scale, bias) pairs per dim follow them.
KVCD_HOST_DEVICE constexpr size_t FsqI8FragBytes(int num_kv_heads, int head_dim, int latent) {
  return static_cast<size_t>(num_kv_heads) * ((latent + 31) / 32) * (head_dim / 8) * 32 * 8;
}

// The two-CTA kernel (cuda/fsq_decode_kernel.cuh with kOcc2) rebuilds a tile's key in passes
// of FsqI8PassTiles(D, MT) n-tiles of 8 dims (4 beside 16 m-tiles of value sums, else 8; at
// most D / 8), taking the n-tiles in slot order: with the half RoPE pairing over rotary dims
// (koff = rotary / 16 n-tiles rotate with the n-tile koff further) slot 2i is n-tile i and
// slot 2i + 1 n-tile koff + i (i < koff), so both halves of a rotated pair lie in one pass
// (passes start at even slots); the other slots, and every slot with koff 0 (interleaved
// pairing, no RoPE), are their own n-tile.
KVCD_HOST_DEVICE constexpr int FsqI8PassTiles(int head_dim, int m_tiles) {
  return (m_tiles == 16 ? 4 : 8) < head_dim / 8 ? (m_tiles == 16 ? 4 : 8) : head_dim / 8;
}
KVCD_HOST_DEVICE constexpr int FsqI8SlotTile(int slot, int koff) {
  return slot < 2 * koff ? (slot & 1 ? koff : 0) + (slot >> 1) : slot;
}

// Byte offset, in a layer's prepared int8 decoder ([Hkv][ksteps][head_dim / 8][32 lanes] of
// 8-byte B fragments), of the weight of (KV head, dim, latent).
KVCD_HOST_DEVICE inline size_t FsqI8WeightByte(int head, int dim, int latent, int ksteps,
                                               int head_dim) {
  const int s = latent / 32, r = latent % 32;
  const int t = r >> 3, i = (r >> 1) & 3, e = r & 1;  // r = 8 t + 2 i + e: k = 4 t + 16 e + i
  const int n = dim / 8, g = dim % 8;
  const size_t frag = (static_cast<size_t>(head) * ksteps + s) * (head_dim / 8) + n;
  return (frag * 32 + (4 * g + t)) * 8 + 4 * e + i;
}

// The bias of a dim whose int8 row q has scale `scale` and sum(q) = `qsum`: the key is
// scale * acc + bias, acc the accumulator read as a float (kFsqI8AccBase + sum q * (z + 8)),
// so bias = b - scale (8 qsum + kFsqI8AccBase), in double, rounded once to float.
KVCD_HOST_DEVICE inline float FsqI8Bias(float b, float scale, int qsum) {
  return static_cast<float>(static_cast<double>(b) -
                            static_cast<double>(scale) *
                                (8.0 * static_cast<double>(qsum) + kFsqI8AccBase));
}

// --- The weighted code sums (step 5): codes as FP16 A fragments of Z^T -------------------

// Byte k of row r of a stage tile of rows of cb bytes. With swz (cb a multiple of 128) the
// 16-byte chunks of row r are stored XOR (r & 7): the 8 rows a fragment load touches at one
// column fall in 8 different bank groups.
KVCD_HOST_DEVICE inline const uint8_t* FsqStageAt(const uint8_t* tile, int r, int k, int cb,
                                                  bool swz) {
  const int chunk = swz ? (k >> 4) ^ (r & 7) : k >> 4;
  return tile + r * cb + (chunk << 4) + (k & 15);
}

// A lane of step 5 reads, per token row, the 8 bytes at byte 8 mt of the row when G is a
// multiple of 16 (8-byte aligned rows), else only bytes j and j + 4 of them (j = g / 2): the
// FP16 variant takes byte j of each word out (shift, mask) and pairs two tokens' nibbles with
// FsqNibblePairBits; the int8 variant pairs the two tokens' words with one byte permute
// (FsqPairSelector; unaligned: the two bytes loaded to byte 0 of each word) and takes the
// nibbles with FsqPairedNibbleBits. The same FP16 operands (cuda_fsq_test.cc checks).

// The byte-permute selector (PTX prmt, default mode) putting byte j of the first word in byte
// 0 and byte j of the second in byte 2 (j <= 3; unaligned: byte 0 of each).
KVCD_HOST_DEVICE inline uint32_t FsqPairSelector(int j, bool aligned) {
  return aligned ? static_cast<uint32_t>(j | ((4 + j) << 8)) : 0x0400u;
}

// prmt's default mode, for the host (the device uses __byte_perm).
inline uint32_t FsqBytePermHost(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (s >> (4 * n)) & 0xFu;
    uint32_t b = static_cast<uint32_t>(v >> (8 * (sel & 7))) & 0xFFu;
    if (sel & 8) b = (b & 0x80u) ? 0xFFu : 0u;  // replicate the sign bit
    r |= b << (8 * n);
  }
  return r;
}

// FP16x2 bits of 1024 + nibble: the low half from byte 0's nibble, the high half from byte
// 2's, each byte shifted right by sh (0: low nibble, 4: high) first.
KVCD_HOST_DEVICE inline uint32_t FsqPairedNibbleBits(uint32_t x, int sh) {
  return ((x >> sh) & 0x000F000Fu) | 0x64006400u;
}

// The same nibbles left in place (kInt8Occ2Fixed's step 5: one instruction fewer): bytes 0
// and 2 masked to their nibble sh / 4, so the FP16 halves hold 1024 + 16^(sh / 4) * nibble;
// one FMA by FsqInPlaceNibbleScale(sh) plus FsqInPlaceNibbleOffset(sh), both exact in FP16,
// gives nibble - 8 exactly, as FsqPairedNibbleBits' halves minus 1032 do.
KVCD_HOST_DEVICE inline uint32_t FsqInPlaceNibbleBits(uint32_t x, int sh) {
  return (x & (0x000F000Fu << sh)) | 0x64006400u;
}
KVCD_HOST_DEVICE inline float FsqInPlaceNibbleScale(int sh) { return sh != 0 ? 0.0625f : 1.0f; }
KVCD_HOST_DEVICE inline float FsqInPlaceNibbleOffset(int sh) { return sh != 0 ? -72.0f : -1032.0f; }

// The same from two separate nibbles (low half <- lo, high half <- hi, each 0..15).
KVCD_HOST_DEVICE inline uint32_t FsqNibblePairBits(uint32_t lo, uint32_t hi) {
  return lo | (hi << 16) | 0x64006400u;
}

}  // namespace kvcd::kernels
