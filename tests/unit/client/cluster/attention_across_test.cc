// The exact merge of attention over two parts of a history (client/cluster/
// attention_across.h) against a float64 softmax over the whole, on random inputs.
#include "client/cluster/attention_across.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvcd::cluster {
namespace attention_across_test {

// o [heads][dim], lse [heads] of q over keys [lo, hi) (float64, then float32).
void Attend(const std::vector<double>& q, const std::vector<double>& k,
            const std::vector<double>& v, int heads, int dim, int lo, int hi, std::vector<float>* o,
            std::vector<float>* lse) {
  o->assign(heads * dim, 0.f);
  lse->assign(heads, -std::numeric_limits<float>::infinity());
  for (int h = 0; h < heads; ++h) {
    if (hi <= lo) continue;
    std::vector<double> s(hi - lo);
    double m = -INFINITY;
    for (int t = lo; t < hi; ++t) {
      double dot = 0;
      for (int d = 0; d < dim; ++d) dot += q[h * dim + d] * k[(t * heads + h) * dim + d];
      s[t - lo] = dot / std::sqrt(static_cast<double>(dim));
      m = std::max(m, s[t - lo]);
    }
    double sum = 0;
    std::vector<double> acc(dim, 0.0);
    for (int t = lo; t < hi; ++t) {
      const double p = std::exp(s[t - lo] - m);
      sum += p;
      for (int d = 0; d < dim; ++d) acc[d] += p * v[(t * heads + h) * dim + d];
    }
    for (int d = 0; d < dim; ++d) (*o)[h * dim + d] = static_cast<float>(acc[d] / sum);
    (*lse)[h] = static_cast<float>(m + std::log(sum));
  }
}

v1::AttentionDecodeResponse Response(const std::vector<float>& o, const std::vector<float>& lse,
                                     int heads, int dim) {
  v1::AttentionDecodeResponse r;
  r.mutable_o()->set_dtype(v1::DTYPE_F32);
  for (int64_t d : {1, heads, dim}) r.mutable_o()->add_shape(d);
  r.mutable_o()->set_inline_data(o.data(), o.size() * sizeof(float));
  r.mutable_lse()->set_dtype(v1::DTYPE_F32);
  for (int64_t d : {1, heads}) r.mutable_lse()->add_shape(d);
  r.mutable_lse()->set_inline_data(lse.data(), lse.size() * sizeof(float));
  return r;
}

TEST(AttentionAcross, MergeOfTwoPartsEqualsAttentionOverTheWhole) {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  for (int trial = 0; trial < 20; ++trial) {
    const int heads = 4, dim = 32;
    const int n = 2 + static_cast<int>(rng() % 300);
    const int split = static_cast<int>(rng() % (n + 1));  // either part may be empty
    std::vector<double> q(heads * dim), k(n * heads * dim), v(n * heads * dim);
    for (auto* x : {&q, &k, &v}) {
      for (double& e : *x) e = normal(rng) * (x == &q ? 3 : 1);
    }
    std::vector<float> o_all, l_all, o_a, l_a, o_b, l_b;
    Attend(q, k, v, heads, dim, 0, n, &o_all, &l_all);
    Attend(q, k, v, heads, dim, 0, split, &o_a, &l_a);
    Attend(q, k, v, heads, dim, split, n, &o_b, &l_b);
    absl::StatusOr<MergedAttention> m =
        MergeAttention(Response(o_a, l_a, heads, dim), Response(o_b, l_b, heads, dim));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->shape, (std::vector<int64_t>{1, heads, dim}));
    for (int i = 0; i < heads * dim; ++i) EXPECT_NEAR(m->o[i], o_all[i], 1e-5) << trial;
    for (int h = 0; h < heads; ++h) EXPECT_NEAR(m->lse[h], l_all[h], 1e-5) << trial;
  }
}

TEST(AttentionAcross, AnswersThatDoNotMergeAreRefused) {
  std::vector<float> o(8, 1.f), lse(2, 0.f);
  v1::AttentionDecodeResponse a = Response(o, lse, 2, 4);
  v1::AttentionDecodeResponse b = Response(std::vector<float>(16, 1.f), lse, 2, 8);
  absl::StatusOr<MergedAttention> m = MergeAttention(a, b);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("do not merge"), std::string::npos);
  v1::AttentionDecodeResponse nan = Response(o, {0.f, std::nanf("")}, 2, 4);
  EXPECT_EQ(MergeAttention(a, nan).status().code(), absl::StatusCode::kInvalidArgument);
  v1::AttentionDecodeResponse short_data = a;
  short_data.mutable_o()->mutable_inline_data()->resize(4);
  m = MergeAttention(a, short_data);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("does not match"), std::string::npos);
  v1::AttentionDecodeResponse bf16 = a;
  bf16.mutable_o()->set_dtype(v1::DTYPE_BF16);
  EXPECT_EQ(MergeAttention(bf16, a).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace attention_across_test
}  // namespace kvcd::cluster
