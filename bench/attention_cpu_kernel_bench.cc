// One thread, one KV head per call: the INT2 and BF16 CPU attention kernels called directly
// (no backend, no split-K, no rotation), alternating, on Qwen3-8B pages (8 KV heads, group
// 4, head_dim 128, page 64). Prints thread-CPU nanoseconds per token and KV head (median and
// minimum over the repetitions). Under valgrind it gives exact instruction counts:
//
//   attention_cpu_kernel_bench [tokens=4096] [reps=100]
//   valgrind --tool=callgrind --callgrind-out-file=cg.out attention_cpu_kernel_bench 4096 4
//   callgrind_annotate --threshold=100 --inclusive=yes cg.out | grep 'Pages.*Avx2('
//     -> instructions / (4 * tokens) = instructions per token and KV head
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "common/cli.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"

namespace {

double ThreadNanos() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcd::kernels;
  constexpr int kHkv = 8, kD = 128, kPage = 64, kGroup = 4;
  const kvcd::cli::Program program = {
      .name = "attention_cpu_kernel_bench",
      .summary = "the INT2 and BF16 CPU attention kernels, one thread, one KV head per call",
      .files = {__FILE__},
      .synopsis = "[TOKENS=4096] [REPS=100]",
      .takes_args = true};
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(program, argc, argv);
  if (cli.args.size() > 2) {
    return kvcd::cli::UsageError(program, nullptr, "unexpected argument '" + cli.args[2] + "'");
  }
  const int64_t n = !cli.args.empty()
                        ? std::max<int64_t>(kPage, std::atoll(cli.args[0].c_str())) / kPage * kPage
                        : 4096;
  const int reps = cli.args.size() > 1 ? std::max(1, std::atoi(cli.args[1].c_str())) : 100;
  const int64_t pages = n / kPage;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<int32_t> ids(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  // INT2: random codes, valid FP16 scales and minimums.
  const int64_t int2_bytes = Int2PageBytes(kHkv, kPage, kD);
  std::vector<uint8_t> int2(static_cast<size_t>(int2_bytes * pages));
  for (auto& b : int2) b = static_cast<uint8_t>(rng());
  const Int2PageLayout layout{kHkv, kPage, kD};
  for (int64_t p = 0; p < pages; ++p) {
    for (int h = 0; h < kHkv; ++h) {
      for (const Int2RowRef& r :
           {layout.K(int2.data() + p * int2_bytes, h), layout.V(int2.data() + p * int2_bytes, h)}) {
        for (int s = 0; s < kPage; ++s) {
          r.scale[s] = FloatToHalf(0.5f + 0.001f * ((s * 7 + h) % 97));
          r.lo[s] = FloatToHalf(-0.75f - 0.001f * ((s * 5 + h) % 89));
        }
      }
    }
  }
  const Int2PageTable int2_table{int2.data(), int2_bytes, ids.data(), static_cast<int32_t>(pages),
                                 kPage,       kHkv,       kD};
  const int64_t bf16_elems = Bf16PageElems(kHkv, kPage, kD);
  std::vector<uint16_t> bf16(static_cast<size_t>(bf16_elems * pages));
  for (auto& x : bf16) x = FloatToBf16(normal(rng));
  const Bf16PageTable bf16_table{bf16.data(), bf16_elems, ids.data(), static_cast<int32_t>(pages),
                                 kPage,       kHkv,       kD};
  std::vector<float> q(kGroup * kD), o(q.size()), lse(kGroup);
  for (auto& x : q) x = normal(rng);
  const float scale = 0.08838834764f;  // 1/sqrt(128)
  std::vector<double> t_int2, t_bf16;
  for (int r = 0; r < reps; ++r) {
    const int head = r % kHkv;
    const double t0 = ThreadNanos();
    AttendInt2Pages(int2_table, head, q.data(), kGroup, scale, 0, n, o.data(), lse.data());
    const double t1 = ThreadNanos();
    AttendBf16Pages(bf16_table, head, q.data(), kGroup, scale, 0, n, o.data(), lse.data());
    const double t2 = ThreadNanos();
    t_int2.push_back((t1 - t0) / static_cast<double>(n));
    t_bf16.push_back((t2 - t1) / static_cast<double>(n));
  }
  std::sort(t_int2.begin(), t_int2.end());
  std::sort(t_bf16.begin(), t_bf16.end());
  const double mi = t_int2[t_int2.size() / 2], mb = t_bf16[t_bf16.size() / 2];
  std::printf(
      "isa %s, %lld tokens, %d reps: ns per token and KV head: median INT2 %.2f BF16 %.2f "
      "(%.2fx), min INT2 %.2f BF16 %.2f (%.2fx)\n",
      CpuIsaName(ActiveCpuIsa()), static_cast<long long>(n), reps, mi, mb, mb / mi, t_int2[0],
      t_bf16[0], t_bf16[0] / t_int2[0]);
  return 0;
}
