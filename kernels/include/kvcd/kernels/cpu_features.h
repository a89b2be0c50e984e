// Run-time CPU feature detection for kernel dispatch.
#pragma once

namespace kvcd::kernels {

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best ISA this CPU supports (AVX-512 needs F+BW+VL; AVX2 needs FMA too).
// The environment variable KVCD_CPU_ISA=scalar|avx2|avx512 caps the choice.
CpuIsa DetectCpuIsa();

// Cached DetectCpuIsa().
CpuIsa ActiveCpuIsa();

const char* CpuIsaName(CpuIsa isa);

// AVX-512 VNNI (vpdpbusd), used by the INT2 kernel's integer logit path.
bool CpuHasAvx512Vnni();

// F16C (vcvtph2ps), used by the AVX2 INT2 kernel's integer path for the FP16 row scales.
bool CpuHasF16c();

}  // namespace kvcd::kernels
