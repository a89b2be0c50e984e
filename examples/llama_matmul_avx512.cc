// The llama runtime's MatMul, AVX-512 version (compiled with -mavx512f -mavx512vl
// -ffp-contract=off): the same eight-lane sums in 256-bit registers, of which AVX-512 has 32.
#include "examples/llama_matmul.h"
#include "examples/llama_matmul_impl.h"

namespace kvcd::llama::internal {

// Four rows x five tokens: twenty accumulators, five token and one weight register of 32.
void MatMulAvx512(const float* w, const float* x, int n, int out, int in, float* y) {
  MatMulImpl<Avx512Isa, 4, 5>(w, x, n, out, in, y);
}

}  // namespace kvcd::llama::internal
