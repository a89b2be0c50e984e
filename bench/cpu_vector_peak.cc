// Sustained 512-bit instruction throughput of one core: 8 independent chains of FMAs and of
// vpdpbusd (the instructions the INT2 kernel is built from). Used to read the CPU
// attention benchmark against what the core can issue.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#include "kvcd/kernels/cpu_features.h"

__attribute__((target("avx512f,avx512vnni"))) static void Run() {
  constexpr long kIters = 100000000;
  __m512 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_set1_ps(1.0f + i);
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i)
    for (int k = 0; k < 8; ++k) a[k] = _mm512_fmadd_ps(a[k], b, c);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (auto& v : a) sink += _mm512_reduce_add_ps(v);
  std::printf("vfmadd (zmm):  %.2f G instructions/s  (checksum %g)\n", kIters * 8 / s / 1e9, sink);
  __m512i x[8];
  for (int i = 0; i < 8; ++i) x[i] = _mm512_set1_epi32(i);
  const __m512i y = _mm512_set1_epi32(0x01010101), z = _mm512_set1_epi32(0x02020202);
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i)
    for (int k = 0; k < 8; ++k) x[k] = _mm512_dpbusd_epi32(x[k], y, z);
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int isink = 0;
  for (auto& v : x) isink += _mm512_reduce_add_epi32(v);
  std::printf("vpdpbusd (zmm): %.2f G instructions/s (checksum %d)\n", kIters * 8 / s / 1e9, isink);
}

int main() {
  if (!kvcd::kernels::CpuHasAvx512Vnni()) {
    std::printf("this CPU has no AVX-512 VNNI\n");
    return 0;
  }
  Run();
  return 0;
}
