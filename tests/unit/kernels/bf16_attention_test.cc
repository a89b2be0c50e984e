// BF16 paged decode attention against the float64 oracle, every ISA this CPU has.
#include "kvcd/kernels/bf16_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"

namespace kvcd::kernels {
namespace bf16_attention_test {

struct Case {
  int64_t n;
  int num_q_heads, num_kv_heads, head_dim, page_size;
};

std::vector<CpuIsa> AvailableIsas() {
  std::vector<CpuIsa> isas = {CpuIsa::kScalar};
  const CpuIsa best = DetectCpuIsa();
  if (best >= CpuIsa::kAvx2) isas.push_back(CpuIsa::kAvx2);
  if (best >= CpuIsa::kAvx512) isas.push_back(CpuIsa::kAvx512);
  return isas;
}

// Builds a shuffled page table holding the BF16-rounded K/V and checks every query head
// against the float64 reference on the same (rounded) values.
void CheckCase(const Case& c, CpuIsa isa, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int d = c.head_dim, hkv = c.num_kv_heads, ps = c.page_size;
  const int g = c.num_q_heads / hkv;
  const int64_t num_pages = (c.n + ps - 1) / ps;
  std::vector<float> k(c.n * hkv * d), v(c.n * hkv * d), q(c.num_q_heads * d);
  for (auto& x : k) x = Bf16ToFloat(FloatToBf16(normal(rng)));
  for (auto& x : v) x = Bf16ToFloat(FloatToBf16(normal(rng)));
  for (auto& x : q) x = normal(rng);
  // Pages in a scrambled order inside a pool with spare pages.
  const int64_t pool_pages = num_pages + 3;
  std::vector<int32_t> ids(pool_pages);
  for (int64_t i = 0; i < pool_pages; ++i) ids[i] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(num_pages);
  const int64_t page_elems = Bf16PageElems(hkv, ps, d);
  std::vector<uint16_t> pool(pool_pages * page_elems, FloatToBf16(NAN));  // poisoned
  for (int64_t t = 0; t < c.n; ++t) {
    uint16_t* page = pool.data() + ids[t / ps] * page_elems;
    for (int h = 0; h < hkv; ++h) {
      for (int i = 0; i < d; ++i) {
        page[(h * ps + t % ps) * d + i] = FloatToBf16(k[(t * hkv + h) * d + i]);
        page[hkv * ps * d + (h * ps + t % ps) * d + i] = FloatToBf16(v[(t * hkv + h) * d + i]);
      }
    }
  }
  // Unwritten slots of the last page stay NaN: the kernel must never read them.
  Bf16PageTable table{pool.data(), page_elems, ids.data(), static_cast<int32_t>(num_pages),
                      ps,          hkv,        d};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> ref_o(c.num_q_heads * d), ref_lse(c.num_q_heads);
  ReferenceAttention(q.data(), k.data(), v.data(), c.n, c.num_q_heads, hkv, d, scale, ref_o.data(),
                     ref_lse.data());
  for (int h = 0; h < hkv; ++h) {
    std::vector<float> o(g * d, NAN), lse(g, NAN);
    AttendBf16Pages(table, h, q.data() + h * g * d, g, static_cast<float>(scale), 0, c.n, o.data(),
                    lse.data(), isa);
    for (int i = 0; i < g; ++i) {
      const int qh = h * g + i;
      double err = 0, norm = 0;
      for (int j = 0; j < d; ++j) {
        const double diff = o[i * d + j] - ref_o[qh * d + j];
        err += diff * diff;
        norm += ref_o[qh * d + j] * ref_o[qh * d + j];
      }
      // FP32 accumulation over n tokens: relative error well under 1e-4.
      EXPECT_LE(std::sqrt(err), 1e-4 * std::sqrt(norm) + 1e-6)
          << "n=" << c.n << " head=" << qh << " isa=" << CpuIsaName(isa);
      EXPECT_NEAR(lse[i], ref_lse[qh], 1e-4 * (1 + std::fabs(ref_lse[qh])));
    }
  }
}

TEST(Bf16AttentionTest, MatchesFloat64ReferenceOnRandomInputs) {
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (CpuIsa isa : AvailableIsas()) {
    for (int64_t n : {1, 3, 17, 1000}) {
      for (int group : {1, 4, 8}) {
        for (int ps : {1, 3, 16, 64}) {
          CheckCase({n, 2 * group, 2, 64, ps}, isa, seed++);
        }
      }
    }
    for (int d : {8, 16, 32, 128, 256}) CheckCase({129, 8, 2, d, 16}, isa, seed++);
  }
}

TEST(Bf16AttentionTest, SplitRangesMergeToTheWhole) {
  // Attending [0, a) and [a, n) separately and merging equals attending [0, n).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int d = 64, hkv = 1, ps = 16, g = 4;
  const int64_t n = 200, a = 77;
  const int64_t num_pages = (n + ps - 1) / ps;
  const int64_t page_elems = Bf16PageElems(hkv, ps, d);
  std::vector<uint16_t> pool(num_pages * page_elems);
  for (auto& x : pool) x = FloatToBf16(normal(rng));
  std::vector<int32_t> ids(num_pages);
  for (int i = 0; i < num_pages; ++i) ids[i] = i;
  std::vector<float> q(g * d);
  for (auto& x : q) x = normal(rng);
  Bf16PageTable t{pool.data(), page_elems, ids.data(), static_cast<int32_t>(num_pages), ps, hkv, d};
  std::vector<float> o_all(g * d), l_all(g), o1(g * d), l1(g), o2(g * d), l2(g);
  AttendBf16Pages(t, 0, q.data(), g, 0.125f, 0, n, o_all.data(), l_all.data());
  AttendBf16Pages(t, 0, q.data(), g, 0.125f, 0, a, o1.data(), l1.data());
  AttendBf16Pages(t, 0, q.data(), g, 0.125f, a, n, o2.data(), l2.data());
  MergeStates(g, d, o1.data(), l1.data(), o2.data(), l2.data());
  for (int i = 0; i < g * d; ++i) EXPECT_NEAR(o1[i], o_all[i], 1e-4 * (1 + std::fabs(o_all[i])));
  for (int i = 0; i < g; ++i) EXPECT_NEAR(l1[i], l_all[i], 1e-4 * (1 + std::fabs(l_all[i])));
}

TEST(AttentionStateTest, EmptyStatesMergeWithoutNaN) {
  const int heads = 2, d = 8;
  std::vector<float> o(heads * d, 123.0f), lse(heads, 0.0f);
  ResetStates(heads, d, o.data(), lse.data());
  std::vector<float> eo(heads * d, 0.0f), el(heads, kEmptyLse);
  MergeStates(heads, d, o.data(), lse.data(), eo.data(), el.data());  // empty + empty
  for (float x : o) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, kEmptyLse);
  std::vector<float> bo(heads * d), bl = {0.5f, -3.0f};
  for (int i = 0; i < heads * d; ++i) bo[i] = 0.25f * i;
  MergeStates(heads, d, o.data(), lse.data(), bo.data(), bl.data());  // empty + state
  for (int i = 0; i < heads * d; ++i) EXPECT_EQ(o[i], bo[i]);
  EXPECT_EQ(lse[0], 0.5f);
  MergeStates(heads, d, o.data(), lse.data(), eo.data(), el.data());  // state + empty
  for (int i = 0; i < heads * d; ++i) EXPECT_EQ(o[i], bo[i]);
  // Two equal states: lse grows by log 2, o unchanged.
  MergeStates(heads, d, o.data(), lse.data(), bo.data(), bl.data());
  EXPECT_NEAR(lse[1], -3.0f + std::log(2.0f), 1e-6);
  for (int i = 0; i < heads * d; ++i) EXPECT_NEAR(o[i], bo[i], 1e-6);
}

TEST(AttentionStateTest, EmptyRangeGivesEmptyState) {
  std::vector<uint16_t> pool(Bf16PageElems(1, 4, 8), 0);
  int32_t id = 0;
  Bf16PageTable t{pool.data(), Bf16PageElems(1, 4, 8), &id, 1, 4, 1, 8};
  std::vector<float> q(8, 1.0f), o(8, NAN), lse(1, 0);
  AttendBf16Pages(t, 0, q.data(), 1, 1.0f, 2, 2, o.data(), lse.data());
  EXPECT_EQ(lse[0], kEmptyLse);
  for (float x : o) EXPECT_EQ(x, 0.0f);
}

TEST(Bf16Test, RoundTripAndRounding) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even (1.0).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

}  // namespace bf16_attention_test
}  // namespace kvcd::kernels
