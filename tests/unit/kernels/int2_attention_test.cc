// INT2 paged attention: the optimized kernels (every ISA this CPU has) against the
// scalar float64 oracle on fresh random pages.
#include "kvcd/kernels/int2_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels {
namespace int2_attention_test {

std::vector<CpuIsa> AvailableIsas() {
  std::vector<CpuIsa> isas = {CpuIsa::kScalar};
  const CpuIsa best = DetectCpuIsa();
  if (best >= CpuIsa::kAvx2) isas.push_back(CpuIsa::kAvx2);
  if (best >= CpuIsa::kAvx512) isas.push_back(CpuIsa::kAvx512);
  return isas;
}

void CheckCase(int64_t n, int hkv, int group, int d, int ps, CpuIsa isa, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t num_pages = (n + ps - 1) / ps;
  const int64_t pool_pages = num_pages + 2;
  const int64_t page_bytes = Int2PageBytes(hkv, ps, d);
  std::vector<uint8_t> pool(pool_pages * page_bytes);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());  // random codes and poisoned slots
  std::vector<int32_t> ids(pool_pages);
  for (int i = 0; i < pool_pages; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(num_pages);
  const Int2PageLayout layout{hkv, ps, d};
  std::vector<float> row(d);
  for (int64_t t = 0; t < n; ++t) {
    uint8_t* page = pool.data() + ids[t / ps] * page_bytes;
    const int slot = static_cast<int>(t % ps);
    for (int h = 0; h < hkv; ++h) {
      for (int which = 0; which < 2; ++which) {
        for (auto& x : row) x = normal(rng) * (which == 0 ? 2.0f : 1.0f);
        DemoteRowsToInt2(row.data(), 1, d, nullptr, which == 0 ? 0.96f : 0.92f,
                         which == 0 ? layout.K(page, h) : layout.V(page, h), slot);
      }
    }
  }
  Int2PageTable kv{pool.data(), page_bytes, ids.data(), static_cast<int32_t>(num_pages),
                   ps,          hkv,        d};
  std::vector<float> q(group * d);
  for (auto& x : q) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // FP32 paths differ from the float64 oracle by accumulation rounding only. The integer
  // paths, AVX-512 VNNI (head_dim % 64 == 0) and AVX2 vpmaddubsw (F16C, head_dim % 32 == 0,
  // page_size % 8 == 0, group 1/2/4/8), also round the query and the value weights to two
  // int8 digits (int2_attention_avx512.cc, int2_attention_avx2.cc): logit errors up to
  // scale*3d*max|q|/64516, ~1e-4 relative in the output (the AVX2 path measures up to
  // ~1.5e-4 on these inputs), so they keep the integer-path bound.
  const bool vnni = isa == CpuIsa::kAvx512 && d % 64 == 0 && CpuHasAvx512Vnni();
  const bool madd = isa == CpuIsa::kAvx2 && CpuHasF16c() && d % 32 == 0 && ps % 8 == 0 &&
                    (group == 1 || group == 2 || group == 4 || group == 8);
  const double tol = vnni || madd ? 1e-3 : 1e-4;
  for (int h = 0; h < hkv; ++h) {
    for (int64_t begin : {int64_t{0}, n / 3}) {
      std::vector<float> ro(group * d), rl(group), o(group * d, NAN), l(group, NAN);
      AttendInt2PagesReference(kv, h, q.data(), group, scale, begin, n, ro.data(), rl.data());
      AttendInt2Pages(kv, h, q.data(), group, scale, begin, n, o.data(), l.data(), isa);
      for (int i = 0; i < group; ++i) {
        double err = 0, norm = 0;
        for (int c = 0; c < d; ++c) {
          err += (o[i * d + c] - ro[i * d + c]) * (o[i * d + c] - ro[i * d + c]);
          norm += ro[i * d + c] * ro[i * d + c];
        }
        // FP32 accumulation against the float64 oracle on the same codes.
        EXPECT_LE(std::sqrt(err), tol * std::sqrt(norm) + 1e-6)
            << "n=" << n << " d=" << d << " ps=" << ps << " isa=" << CpuIsaName(isa);
        if (begin < n) {
          EXPECT_NEAR(l[i], rl[i], tol * (1 + std::fabs(rl[i])));
        } else {
          EXPECT_EQ(l[i], kEmptyLse);
        }
      }
    }
  }
}

TEST(Int2AttentionTest, MatchesTheScalarOracle) {
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (CpuIsa isa : AvailableIsas()) {
    for (int64_t n : {1, 3, 17, 1000}) {
      for (int ps : {1, 3, 16, 64, 128}) {
        CheckCase(n, 2, 4, 128, ps, isa, seed++);
      }
    }
    for (int d : {8, 16, 32, 64, 256}) {
      for (int group : {1, 2, 8}) CheckCase(129, 2, group, d, 16, isa, seed++);
    }
  }
}

}  // namespace int2_attention_test
}  // namespace kvcd::kernels
