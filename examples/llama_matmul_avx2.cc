// The llama runtime's MatMul, AVX2 version (compiled with -mavx2 -ffp-contract=off).
#include "examples/llama_matmul.h"
#include "examples/llama_matmul_impl.h"

namespace kvcd::llama::internal {

// Three rows x three tokens: nine accumulators, three token and one weight register of 16.
void MatMulAvx2(const float* w, const float* x, int n, int out, int in, float* y) {
  MatMulImpl<Avx2Isa, 3, 3>(w, x, n, out, in, y);
}

}  // namespace kvcd::llama::internal
