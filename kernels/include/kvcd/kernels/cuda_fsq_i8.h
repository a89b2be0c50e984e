// FSQ decode attention with the key rebuild on int8 tensor cores (issue 37), beside the FP16
// reference variant of cuda_fsq.h: the same pages, workspace, splits, parts and merge; only
// the prepared key decoder and the kernel's step 1 differ (cuda/fsq_decode_kernel.cuh).
//
// The int8 decoder: each row of W_k (an output channel: KV head h, dim i) is quantized ONCE at
// preparation to int8 with its own scale, FsqQuantizeKeyRow below; the kernel multiplies the
// codes (as their nibbles z + 8, exact in u8) by it on mma.sync m16n8k32 u8 x s8 into int32
// and applies scale, bias, key norm and RoPE on the accumulators in FP32 registers. The error
// this adds is the rounding of each weight to 1/127 of its row's max |w|: on random Gaussian
// rows, a key error about 0.1 of what FSQ's own rounding of the latents (+-0.5 a coordinate)
// puts into the same key (CudaFsqI8KeysTest.KeyErrorIsSmallAgainstFsqRounding bounds it);
// the kernel's arithmetic besides is the FP16 variant's (same oracle bound, against the
// dequantized W_k).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/cuda_fsq.h"

namespace kvcd::kernels::cuda {

// Which kernel serves FSQ decode attention: the FP16 key rebuild (the reference variant,
// cuda_fsq.h), the int8 one (one CTA of 8 warps per SM: up to 255 registers a thread), or
// the int8 one at two CTAs per SM (kInt8Occ2: at most 128 registers a thread, the key's
// n-tiles rebuilt in passes; the same products and decoder as kInt8, the sums in another
// order; a geometry whose shared memory does not fit two CTAs on the device, d 256 with G
// past 160 on sm_90, runs the kInt8 kernel). A prepared decoder belongs to the variant that
// prepared it (kInt8, kInt8Occ2 and kInt8Occ2Fixed prepare the same one). kInt8Occ2Fixed
// (the daemon's default since session 27): kInt8Occ2 with the code size compiled in where
// FsqOcc2Specialized names the geometry (head_dim 128, G 255-256: the same arithmetic on
// constants; 0.68-0.77 of kInt8Occ2's time on an H100), kInt8Occ2 elsewhere.
enum class FsqKeyKernel { kFp16, kInt8, kInt8Occ2, kInt8Occ2Fixed };

// Every variant, in the enum's order, and its name (KVCD_FSQ_KERNEL, cuda_fsq_bench --kernel).
inline constexpr FsqKeyKernel kFsqKeyKernels[] = {FsqKeyKernel::kFp16, FsqKeyKernel::kInt8,
                                                  FsqKeyKernel::kInt8Occ2,
                                                  FsqKeyKernel::kInt8Occ2Fixed};
inline const char* FsqKeyKernelName(FsqKeyKernel kernel) {
  switch (kernel) {
    case FsqKeyKernel::kFp16:
      return "fp16";
    case FsqKeyKernel::kInt8:
      return "int8";
    case FsqKeyKernel::kInt8Occ2:
      return "int8-2cta";
    case FsqKeyKernel::kInt8Occ2Fixed:
      return "int8-2cta-fixed";
  }
  return "?";
}

// The int8 decoder of one row of W_k (G weights): q[k] = rint(w[k] * (127 / m)) with
// m = max |w|, returns the scale m / 127 (a zero row: q = 0, scale 1). The device
// preparation does exactly this arithmetic (IEEE float division and product, round half to
// even), so scale * q on the host is the decoder the int8 kernel uses.
inline float FsqQuantizeKeyRow(const float* w, int G, int8_t* q) {
  float m = 0.0f;
  for (int k = 0; k < G; ++k) m = std::fmax(m, std::fabs(w[k]));
  const float inv = m > 0.0f ? 127.0f / m : 0.0f;
  for (int k = 0; k < G; ++k) {
    const float v = std::nearbyint(w[k] * inv);
    q[k] = static_cast<int8_t>(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
  }
  return m > 0.0f ? m / 127.0f : 1.0f;
}

// Bytes of one layer's prepared decoder for `kernel`.
size_t FsqDecoderBytes(FsqKeyKernel kernel, int num_kv_heads, int head_dim, int latent_width);

// LaunchFsqPrepareDecoder (cuda_fsq.h) for `kernel`: kInt8 writes the int8 B fragments of
// W_k (FsqQuantizeKeyRow per row) and per dim its scale and bias
// (cuda/fsq_decode_attention_i8.cu).
Error LaunchFsqPrepareDecoder(FsqKeyKernel kernel, const FsqLayerCodec& codec, void* prepared,
                              cudaStream_t stream);

// FsqDecodeSplits (cuda_fsq.h) for `kernel` at geometry geo and latent width G: one wave of
// the CTAs the device holds at once, num_sms times the CTAs per SM of the instantiation
// LaunchFsqDecodeParts launches (kInt8Occ2: its residency as
// cudaOccupancyMaxActiveBlocksPerMultiprocessor reports it on the current device, 2 on
// sm_90 where it launches, 1 where it falls back; the others 1, so the same count as
// FsqDecodeSplits(batch, num_kv_heads, max_tokens, num_sms)). Any split count is correct;
// this one fills the GPU.
int FsqDecodeSplits(FsqKeyKernel kernel, const DecodeGeometry& geo, int latent_width,
                    int max_tokens, int num_sms);

// LaunchFsqDecodeParts (cuda_fsq.h) on `kernel`'s key rebuild; args.prepared must come from
// LaunchFsqPrepareDecoder with the same kernel. Same REQUIRES; cudaErrorInvalidValue for
// another kernel value.
Error LaunchFsqDecodeParts(FsqKeyKernel kernel, const PagedList& list, const DecodeGeometry& geo,
                           const FsqDecodeArgs& args, int max_tokens, float* part_o,
                           float* part_lse, int part_base, cudaStream_t stream,
                           const MergeTarget* merge = nullptr);

}  // namespace kvcd::kernels::cuda
