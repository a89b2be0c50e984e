#include "kvcd/kernels/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstdlib>
#include <cstring>

namespace kvcd::kernels {

CpuIsa DetectCpuIsa() {
  CpuIsa best = CpuIsa::kScalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = CpuIsa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    best = CpuIsa::kAvx512;
  }
#endif
  if (const char* cap = std::getenv("KVCD_CPU_ISA")) {
    CpuIsa want = best;
    if (std::strcmp(cap, "scalar") == 0) want = CpuIsa::kScalar;
    if (std::strcmp(cap, "avx2") == 0) want = CpuIsa::kAvx2;
    if (std::strcmp(cap, "avx512") == 0) want = CpuIsa::kAvx512;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

CpuIsa ActiveCpuIsa() {
  static const CpuIsa isa = DetectCpuIsa();
  return isa;
}

bool CpuHasAvx512Vnni() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool vnni = [] {
    __builtin_cpu_init();
    return ActiveCpuIsa() == CpuIsa::kAvx512 && __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
#else
  return false;
#endif
}

bool CpuHasF16c() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool f16c = [] {
    __builtin_cpu_init();
    // CPUID leaf 1, ECX bit 29 (clang 14 has no "f16c" for __builtin_cpu_supports).
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool has = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
    return ActiveCpuIsa() >= CpuIsa::kAvx2 && has;
  }();
  return f16c;
#else
  return false;
#endif
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

}  // namespace kvcd::kernels
