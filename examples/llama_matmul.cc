// The llama runtime's MatMul: the baseline x86-64 version (SSE2) and the dispatch.
#include "examples/llama_matmul.h"

#include "examples/llama_matmul_impl.h"
#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::llama {

namespace internal {
// Two rows x two tokens: eight accumulators of two SSE registers each.
void MatMulScalar(const float* w, const float* x, int n, int out, int in, float* y) {
  MatMulImpl<ScalarIsa, 2, 2>(w, x, n, out, in, y);
}
}  // namespace internal

void MatMulForIsa(kernels::CpuIsa isa, const float* w, const float* x, int n, int out, int in,
                  float* y) {
  kernels::ForIsa(isa, &internal::MatMulScalar, &internal::MatMulAvx2, &internal::MatMulAvx512)(
      w, x, n, out, in, y);
}

void MatMul(const float* w, const float* x, int n, int out, int in, float* y) {
  MatMulForIsa(kernels::ActiveCpuIsa(), w, x, n, out, in, y);
}

}  // namespace kvcd::llama
