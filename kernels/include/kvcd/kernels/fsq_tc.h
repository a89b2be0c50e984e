// The arithmetic of the tensor-core FSQ encoder (cuda_fsq_encode_tc.h), on the CPU: its
// operand kinds, the bound on how far its latent sums may lie from the float64 encoder's
// (FsqEncodeRows, fsq.h), and its scalar reference.
//
// The reference rounds the operands exactly as the kernel does: E as
// LaunchFsqPrepareEncoderTc prepares it, x as the kernel loads it. It sums the exact
// products in FP32 in order of c, then adds the bias and rounds through the thresholds in
// float64. The tensor cores sum the same products in another order with their own
// truncation, so the reference and the kernel agree to within the bound, not bit for bit.
// The code-difference fraction and its effect on attention can be measured on any machine
// this way (tests/unit/kernels/fsq_tc_test.cc, bench/fsq_tc_accuracy.cc).
#pragma once

#include <cstdint>

#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels {

// How E and x enter the tensor cores:
//  - kBf16: E rounded to BF16 (relative error <= 2^-8 per weight); x BF16 as it comes,
//    F32 rounded to BF16 (<= 2^-8; beyond BF16's range it becomes +-Inf).
//  - kBf16Split: E = hi + lo, both BF16 (<= 2^-16), two MMAs per product; x as for kBf16.
//  - kFp16: each row of E scaled by a power of two (max |E_g| 2^k in [2^14, 2^15)) and
//    rounded to FP16 (<= 2^-11); x converted to FP16 (BF16 exactly in [2^-14, 65504], F32
//    <= 2^-11; below 2^-14 absolutely <= 2^-25). Finite |x| > 65504 is clamped to 65504,
//    which the bound does not cover (a normalized residual is far below it).
enum class FsqTcOperands { kBf16 = 1, kBf16Split = 2, kFp16 = 3 };

// The largest |u_tc - u| of one latent g of one token x, u the float64 sum of the oracle.
// The bound adds four parts:
//  - the operand rounding (E per `ops`, x when it is rounded), relative to
//    abs_sum = sum_c |E[g][c] x[c]|;
//  - the absolute rounding below the operands' normal range, through abs_e = sum_c
//    |E[g][c]| and abs_x = sum_c |x[c]|;
//  - an FP32 accumulation of planes * C + 16 exact products, at most 2^-22 of abs_sum per
//    addition (the tensor cores truncate instead of rounding; 2^-22 leaves a factor two);
//  - the oracle's own float64 error.
// A code of the tensor-core encoder lies between the oracle's codes of u - bound and
// u + bound. x_bf16: x holds BF16 values (widened); otherwise F32.
struct FsqTcBoundTerms {
  double abs_sum = 0, abs_e = 0, abs_x = 0;
};
double FsqEncodeTcBound(const FsqTcBoundTerms& terms, int32_t residual_width, FsqTcOperands ops,
                        bool x_bf16);

// The scalar reference: `tokens` rows x [tokens][C] (F32, or BF16 values widened) ->
// packed codes [tokens][FsqCodeBytes(G)] as the tensor-core encoder computes them, its
// summation order aside (see above). A NaN sum gives z = 0, as FsqEncodeRows.
void FsqEncodeRowsTcReference(const FsqLayerCodec& codec, const float* x, int64_t tokens,
                              FsqTcOperands ops, uint8_t* codes);

}  // namespace kvcd::kernels
