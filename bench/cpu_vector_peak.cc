// Sustained 512-bit instruction throughput of one core: 8 independent chains of FMAs and of
// vpdpbusd (the instructions the INT2 kernel is built from); 256-bit FMAs where AVX2 is the
// best ISA (the FSQ key rebuild); and one thread's read bandwidth from DRAM and from L2.
// Used to read the CPU attention benchmarks against what the core can issue.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <vector>

#include "common/cli.h"
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

// CPU seconds of this thread: on a shared machine the wall clock counts others' slices.
static double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((target("avx2,fma"))) static void RunAvx2() {
  constexpr long kIters = 100000000;
  // Ten named chains (an array loop stays in memory at -O2).
  __m256 a0 = _mm256_set1_ps(1.0f), a1 = _mm256_set1_ps(2.0f), a2 = _mm256_set1_ps(3.0f),
         a3 = _mm256_set1_ps(4.0f), a4 = _mm256_set1_ps(5.0f), a5 = _mm256_set1_ps(6.0f),
         a6 = _mm256_set1_ps(7.0f), a7 = _mm256_set1_ps(8.0f), a8 = _mm256_set1_ps(9.0f),
         a9 = _mm256_set1_ps(10.0f);
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  const double t0 = ThreadSeconds();
  for (long i = 0; i < kIters; ++i) {
    a0 = _mm256_fmadd_ps(a0, b, c);
    a1 = _mm256_fmadd_ps(a1, b, c);
    a2 = _mm256_fmadd_ps(a2, b, c);
    a3 = _mm256_fmadd_ps(a3, b, c);
    a4 = _mm256_fmadd_ps(a4, b, c);
    a5 = _mm256_fmadd_ps(a5, b, c);
    a6 = _mm256_fmadd_ps(a6, b, c);
    a7 = _mm256_fmadd_ps(a7, b, c);
    a8 = _mm256_fmadd_ps(a8, b, c);
    a9 = _mm256_fmadd_ps(a9, b, c);
  }
  const double s = ThreadSeconds() - t0;
  const __m256 a[10] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
  float sink[8] = {};
  for (auto& v : a) {
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int j = 0; j < 8; ++j) sink[0] += t[j];
  }
  const double g = kIters * 10 / s / 1e9;
  std::printf("vfmadd (ymm, CPU time):  %.2f G instructions/s = %.1f GFLOP/s fp32 (checksum %g)\n",
              g, g * 16, sink[0]);
}

// Sums `bytes` of floats `reps` times with 8 independent AVX2 accumulators: GB/s read.
__attribute__((target("avx2,fma"))) static double ReadBandwidth(size_t bytes, int reps) {
  std::vector<float> buf(bytes / 4, 1.0f);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = ThreadSeconds();
    for (size_t i = 0; i + 64 <= buf.size(); i += 64) {
      const float* p = buf.data() + i;
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + 8));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + 16));
      s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + 24));
      s4 = _mm256_add_ps(s4, _mm256_loadu_ps(p + 32));
      s5 = _mm256_add_ps(s5, _mm256_loadu_ps(p + 40));
      s6 = _mm256_add_ps(s6, _mm256_loadu_ps(p + 48));
      s7 = _mm256_add_ps(s7, _mm256_loadu_ps(p + 56));
    }
    const double s = ThreadSeconds() - t0;
    best = std::max(best, bytes / s / 1e9);
  }
  float t[8];
  _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)),
                                    _mm256_add_ps(_mm256_add_ps(s4, s5), _mm256_add_ps(s6, s7))));
  if (t[0] < 0) std::printf("impossible\n");
  return best;
}

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cpu_vector_peak",
      .summary = "sustained vector throughput and read bandwidth of one core",
      .files = {__FILE__},
      .synopsis = "(no flags)"};
  kvcd::cli::Parse(program, argc, argv);
  using kvcd::kernels::CpuIsa;
  if (kvcd::kernels::DetectCpuIsa() >= CpuIsa::kAvx2) {
    RunAvx2();
    std::printf(
        "read bandwidth, 1 thread (CPU time): DRAM (1 GiB) %.1f GB/s, L2 (256 KiB) %.1f GB/s\n",
        ReadBandwidth(size_t{1} << 30, 3), ReadBandwidth(size_t{256} << 10, 2000));
  }
  if (!kvcd::kernels::CpuHasAvx512Vnni()) {
    std::printf("this CPU has no AVX-512 VNNI\n");
    return 0;
  }
  Run();
  return 0;
}
