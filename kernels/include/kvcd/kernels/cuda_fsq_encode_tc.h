// The FSQ encoder on tensor cores (sm_90): residual rows -> packed 4-bit codes in page
// slots, as cuda_fsq.h LaunchFsqEncodeRows (same arguments, same page layout, same
// non-finite check), with u = E x as a BF16 or FP16 GEMM with FP32 accumulation (mma.sync
// m16n8k16) instead of float64 FMA chains. The bias is added and the 15 rounding thresholds
// (FsqLatentThresholds) are compared in float64 in the epilogue, so a code differs from the
// float64 encoder's (FsqEncodeRows, the oracle) only where the FP32 sum and the float64 sum
// lie on two sides of a threshold: |u_tc - u| <= FsqEncodeTcBound(...).
//
// Operands: E is prepared once per layer (LaunchFsqPrepareEncoderTc):
//  - kBf16: E rounded to BF16 (relative error <= 2^-8 per weight); x as it comes (BF16
//    exactly; F32 rounded to BF16 on load, <= 2^-8; beyond BF16's range it becomes +-Inf);
//  - kBf16Split: E = hi + lo, both BF16 (<= 2^-16), two MMAs per product; x as for kBf16;
//  - kFp16: each row of E scaled by a power of two (max |E_g| in [2^14, 2^15)) and rounded
//    to FP16 (<= 2^-11); x converted to FP16 on load (BF16 exactly in [2^-14, 65504],
//    F32 <= 2^-11; below 2^-14 absolutely <= 2^-25). Finite |x| > 65504 is clamped to
//    65504, which the bound does not cover (a normalized residual is far below it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/error.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels::cuda {

enum class FsqTcOperands { kBf16 = 1, kBf16Split = 2, kFp16 = 3 };

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

// The largest |u_tc - u| of one latent g of one token x, u the float64 sum of the oracle:
// the operand rounding (E per `ops`, x when it is rounded) relative to
// abs_sum = sum_c |E[g][c] x[c]|, the absolute rounding below the operands' normal range
// (through abs_e = sum_c |E[g][c]| and abs_x = sum_c |x[c]|), an FP32 accumulation of
// planes * C exact products with an error of at most 2^-22 of abs_sum per addition (the
// tensor cores truncate instead of rounding; 2^-22 leaves a factor two), and the oracle's
// own float64 error. A code of the tensor-core encoder lies between the oracle's codes of
// u - bound and u + bound. (x as given: F32, or BF16 widened.)
struct FsqTcBoundTerms {
  double abs_sum = 0, abs_e = 0, abs_x = 0;
};
double FsqEncodeTcBound(const FsqTcBoundTerms& terms, int32_t residual_width, FsqTcOperands ops,
                        bool x_bf16);

}  // namespace kvcd::kernels::cuda
