// The CPU ISA dispatch: a function with scalar, AVX2 and AVX-512 versions (one translation
// unit per ISA, each compiled for its ISA) is picked here, from the ISA asked for
// (cpu_features.h: ActiveCpuIsa() for the best this CPU supports) and what the version's
// vectors need of the sizes. The kernels' CPU versions and the examples' (llama_matmul.h) are
// all chosen this way.
#pragma once

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::kernels {

// `isa` stepped down to the widest ISA whose version takes `n` (the elements its vector loops
// step over): the AVX-512 version needs a multiple of avx512_step, the AVX2 one of avx2_step.
inline CpuIsa UsableIsa(CpuIsa isa, int n, int avx512_step, int avx2_step) {
  if (isa == CpuIsa::kAvx512 && n % avx512_step != 0) isa = CpuIsa::kAvx2;
  if (isa == CpuIsa::kAvx2 && n % avx2_step != 0) isa = CpuIsa::kScalar;
  return isa;
}

// The version of a function for `isa`, all of one function type. A function without a
// version for an ISA passes the next narrower one in its place. The caller must only ask for
// an ISA this CPU supports (ActiveCpuIsa() or narrower).
template <class Fn>
Fn* ForIsa(CpuIsa isa, Fn* scalar, Fn* avx2, Fn* avx512) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return avx512;
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kScalar:
      break;
  }
  return scalar;
}

}  // namespace kvcd::kernels
