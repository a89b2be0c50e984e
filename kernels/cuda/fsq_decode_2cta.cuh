// The int8 FSQ decode attention at two CTAs per SM (cuda_fsq_i8.h FsqKeyKernel::kInt8Occ2 and
// kInt8Occ2Fixed),
// fsq_decode_attention_i8_2cta.cu: the one dispatch of cuda_fsq_i8.h reaches it through
// these two entry points (its own translation unit: its kernels compile beside the others).
#pragma once

#include <cuda_runtime.h>

#include "kvcd/kernels/cuda_fsq.h"

namespace kvcd::kernels::cuda {

// CTAs per SM of the kernel LaunchFsqDecodeI8TwoCta launches for (head_dim, G) on the
// current device: the two-CTA instantiation's residency (cudaOccupancyMaxActiveBlocksPer-
// Multiprocessor with its shared memory) where that is at least 2, else 1 (the geometry
// launches the one-CTA int8 kernel). fixed_size: of the instance with the code size compiled
// in where FsqOcc2Specialized names the geometry (kInt8Occ2Fixed).
int FsqI8TwoCtaPerSm(int head_dim, int latent_width, bool fixed_size = false);

// LaunchFsqDecodeParts(kInt8Occ2, ...) (cuda_fsq_i8.h): the two-CTA kernel where
// FsqI8TwoCtaPerSm is 2 or more, else LaunchFsqDecodeParts(kInt8, ...); args.prepared from
// the int8 preparation. fixed_size (kInt8Occ2Fixed): the instance with the code size
// compiled in where FsqOcc2Specialized names the geometry.
Error LaunchFsqDecodeI8TwoCta(const PagedList& list, const DecodeGeometry& geo,
                              const FsqDecodeArgs& args, int max_tokens, float* part_o,
                              float* part_lse, int part_base, cudaStream_t stream,
                              const MergeTarget* merge, bool fixed_size = false);

}  // namespace kvcd::kernels::cuda
