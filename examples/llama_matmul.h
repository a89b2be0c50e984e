// The llama runtime's matrix products: y = W x for a span of tokens at once, each weight
// row read once for the whole span (the model's FP32 weights are what a token costs).
//
// Summation order, the arithmetic's contract: every output y[t][o] is summed in one fixed
// order whatever the span, the tile or the CPU's ISA — eight partial sums over the lanes
// i = 8k + j of the first in / 8 * 8 elements, each a product added in order of k, then
// tail + ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)), where tail sums the last
// in % 8 products in order; no product is contracted into an FMA. A token's outputs are
// therefore bit-identical whether it runs alone or with others, on a baseline x86-64 CPU or
// with AVX2 / AVX-512.
#pragma once

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::llama {

// y[t][o] = sum_i w[o][i] x[t][i] for t < n, o < out: w [out][in], x [n][in] and y [n][out]
// row-major; the version for the active ISA (kernels::ActiveCpuIsa(), capped by
// KVCD_CPU_ISA).
void MatMul(const float* w, const float* x, int n, int out, int in, float* y);

// The same with the version for `isa` (tests compare the versions; the CPU must support it).
void MatMulForIsa(kernels::CpuIsa isa, const float* w, const float* x, int n, int out, int in,
                  float* y);

namespace internal {
// The ISA tags of the versions' template instantiations (llama_matmul_impl.h).
struct ScalarIsa {};
struct Avx2Isa {};
struct Avx512Isa {};
void MatMulScalar(const float* w, const float* x, int n, int out, int in, float* y);
void MatMulAvx2(const float* w, const float* x, int n, int out, int in, float* y);
void MatMulAvx512(const float* w, const float* x, int n, int out, int in, float* y);
}  // namespace internal

}  // namespace kvcd::llama
