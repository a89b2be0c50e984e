// The FSQ encoder on tensor cores (sm_90): residual rows -> packed 4-bit codes in page
// slots, as cuda_fsq.h LaunchFsqEncodeRows (same arguments, same page layout, same
// non-finite check), with u = E x as a BF16 or FP16 GEMM with FP32 accumulation (mma.sync
// m16n8k16) instead of float64 FMA chains. The bias is added and the 15 rounding thresholds
// (FsqLatentThresholds) are compared in float64 in the epilogue, so a code differs from the
// float64 encoder's (FsqEncodeRows, the oracle) only where the FP32 sum and the float64 sum
// lie on two sides of a threshold: |u_tc - u| <= FsqEncodeTcBound(...).
//
// Operands (fsq_tc.h FsqTcOperands): BF16, FP16 (E's rows scaled by powers of two) or
// split BF16 (two MMAs per product), E prepared once per layer
// (LaunchFsqPrepareEncoderTc), x rounded as it is loaded. fsq_tc.h also has the bound
// (FsqEncodeTcBound) and the scalar reference of this arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/error.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/fsq_tc.h"

namespace kvcd::kernels::cuda {

// Bytes of one layer's prepared encoder: planes x [G rounded up to 128][C rounded up to 32]
// 16-bit operands, zero-padded (kFp16: then [G rounded up] F32 row scales).
size_t FsqEncoderTcBytes(int32_t residual_width, int32_t latent_width, FsqTcOperands ops);

// encoder: [G][C] F32 (device) -> prepared (FsqEncoderTcBytes bytes, device, 16-byte
// aligned). Once per layer (model load).
Error LaunchFsqPrepareEncoderTc(const float* encoder, int32_t residual_width, int32_t latent_width,
                                FsqTcOperands ops, void* prepared, cudaStream_t stream);

// As LaunchFsqEncodeRows (cuda_fsq.h: x, dst, codes_offset, check and their REQUIRES), with
// layer l of the launch taking its bias from layer_codecs[l].encoder_bias and its weights
// from prepared + l * FsqEncoderTcBytes(C, G, ops) (the layers' prepared encoders
// back to back). REQUIRES: prepared 16-byte aligned. cudaErrorInvalidValue otherwise.
Error LaunchFsqEncodeRowsTc(const RowBlock& x, const PagedRows& dst, int64_t codes_offset,
                            const FsqLayerCodec* layer_codecs, const void* prepared,
                            int32_t residual_width, int32_t latent_width, FsqTcOperands ops,
                            cudaStream_t stream, const StoreCheck* check = nullptr);

}  // namespace kvcd::kernels::cuda
