// Attention across daemons (docs/cluster.md "Attention across daemons") with the C++ cluster
// client's merge (client/cluster/attention_across.h) against real daemons on loopback: a
// shared history stays on daemon A, a session's own tokens live on daemon B, each attends
// where its keys are, and the merged (o, LSE) equals one daemon attending over the whole
// sequence, within float rounding. The history is not a whole number of pages, and the query
// heads share KV heads (GQA), so the merge is tested where the kernels split and group.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/cluster/attention_across.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd::cluster {
namespace cluster_attention_test {

using testing_util::DaemonProcess;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 64MiB
)";

v1::ModelProfile Profile() {
  v1::ModelProfile p;
  p.set_name("xattn");
  p.set_num_layers(2);
  p.set_num_q_heads(8);
  p.set_num_kv_heads(2);
  p.set_head_dim(32);
  p.set_page_size(16);
  p.set_recent_tokens(16);
  p.set_history_format(v1::HISTORY_FORMAT_BF16);
  p.set_memory_bytes(8 << 20);
  return p;
}

// A sequence on `c` of `tokens`, which are positions [first, first + size) of stream `seed`:
// opened on what the daemon holds of them, the rest appended with the stream's rows of those
// positions. Returns its id (0 after a failure, which is also reported).
uint64_t OpenWith(Client& c, const v1::ModelProfile& p, uint64_t seed,
                  const std::vector<int32_t>& tokens, int64_t first) {
  auto open = c.OpenSequence(p.name(), "", tokens);
  EXPECT_TRUE(open.ok()) << open.status();
  if (!open.ok()) return 0;
  const int64_t opened = open->matched_tokens();
  const int64_t n = static_cast<int64_t>(tokens.size()) - opened;
  if (n == 0) return open->sequence_id();
  v1::AppendRequest app;
  app.set_sequence_id(open->sequence_id());
  app.mutable_tokens()->Add(tokens.begin() + opened, tokens.end());
  const std::vector<int64_t> shape = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
  SetBf16FromFloat(app.mutable_k(), shape, synthetic::Kv(seed, p, first + opened, n, 0).data());
  SetBf16FromFloat(app.mutable_v(), shape, synthetic::Kv(seed, p, first + opened, n, 1).data());
  auto len = c.Append(app);
  EXPECT_TRUE(len.ok()) << len.status();
  return open->sequence_id();
}

TEST(ClusterAttentionTest, MergedAcrossTwoDaemonsEqualsOneDaemon) {
  DaemonProcess da, db;
  ASSERT_TRUE(da.Start(kConfig));
  ASSERT_TRUE(db.Start(kConfig));
  ClientOptions o;
  o.target = da.grpc();
  auto a = Client::Connect(o);
  ASSERT_TRUE(a.ok()) << a.status();
  o.target = db.grpc();
  auto b = Client::Connect(o);
  ASSERT_TRUE(b.ok()) << b.status();
  const v1::ModelProfile p = Profile();
  ASSERT_TRUE((*a)->RegisterModel(p).ok());
  ASSERT_TRUE((*b)->RegisterModel(p).ok());

  constexpr uint64_t kSeed = 21;
  for (const int64_t history : {int64_t{5} * 16 + 3, int64_t{40} * 16}) {
    const int64_t own = 21;
    const std::vector<int32_t> all = synthetic::Tokens(kSeed + history, 0, history + own);
    const std::vector<int32_t> shared(all.begin(), all.begin() + history);
    const std::vector<int32_t> mine(all.begin() + history, all.end());
    // The shared history, stored (Put of its full pages) and opened on A.
    const int64_t full = history / p.page_size() * p.page_size();
    v1::PutRequest put = synthetic::Put(kSeed + history, p, full);
    ASSERT_TRUE((*a)->Put(put).ok());
    const uint64_t seq_a = OpenWith(**a, p, kSeed + history, shared, 0);
    // B holds only the session's own tokens (the positions after the history).
    const uint64_t seq_b = OpenWith(**b, p, kSeed + history, mine, history);
    // The reference: one daemon with the whole sequence.
    const uint64_t seq_ref = OpenWith(**a, p, kSeed + history, all, 0);
    ASSERT_NE(seq_a, 0u);
    ASSERT_NE(seq_b, 0u);
    ASSERT_NE(seq_ref, 0u);
    for (int layer = 0; layer < p.num_layers(); ++layer) {
      v1::AttentionDecodeRequest req;
      req.set_layer(layer);
      const std::vector<float> q = synthetic::Row(kSeed + 7, p, layer, history + own, 2);
      SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
      v1::AttentionDecodeRequest req_a = req, req_b = req, req_ref = req;
      req_a.add_sequence_ids(seq_a);
      req_b.add_sequence_ids(seq_b);
      req_ref.add_sequence_ids(seq_ref);
      auto merged = AttendAcross(**a, req_a, **b, req_b);
      ASSERT_TRUE(merged.ok()) << merged.status();
      auto want = (*a)->AttentionDecode(req_ref);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_EQ(want->lengths(0), history + own);
      ASSERT_EQ(merged->o.size(), static_cast<size_t>(p.num_q_heads() * p.head_dim()));
      double worst_o = 0, worst_lse = 0, scale = 0;
      for (size_t i = 0; i < merged->o.size(); ++i) {
        const double w = ElementAsFloat(want->o(), static_cast<int64_t>(i));
        worst_o = std::max(worst_o, std::abs(merged->o[i] - w));
        scale = std::max(scale, std::abs(w));
      }
      for (size_t h = 0; h < merged->lse.size(); ++h) {
        worst_lse =
            std::max(worst_lse, std::abs(static_cast<double>(merged->lse[h]) -
                                         ElementAsFloat(want->lse(), static_cast<int64_t>(h))));
      }
      // float32 rounding of sums over a few hundred rows; a missing or doubled page moves
      // the answer by about 1e-2.
      EXPECT_LE(worst_o, 1e-5) << "history " << history << " layer " << layer;
      EXPECT_LE(worst_lse, 1e-4) << "history " << history << " layer " << layer;
      EXPECT_GT(scale, 0.0);
    }
    // Each half alone is not the answer: the merge is what makes it whole.
    {
      v1::AttentionDecodeRequest req;
      req.set_layer(0);
      const std::vector<float> q = synthetic::Row(kSeed + 7, p, 0, history + own, 2);
      SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
      v1::AttentionDecodeRequest req_b = req, req_ref = req;
      req_b.add_sequence_ids(seq_b);
      req_ref.add_sequence_ids(seq_ref);
      auto half = (*b)->AttentionDecode(req_b);
      auto want = (*a)->AttentionDecode(req_ref);
      ASSERT_TRUE(half.ok() && want.ok());
      EXPECT_GT(std::abs(ElementAsFloat(half->lse(), 0) - ElementAsFloat(want->lse(), 0)), 1e-3);
    }
    EXPECT_TRUE((*a)->CloseSequence(seq_ref).ok());
    EXPECT_TRUE((*a)->CloseSequence(seq_a).ok());
    EXPECT_TRUE((*b)->CloseSequence(seq_b).ok());
  }
}

}  // namespace cluster_attention_test
}  // namespace kvcd::cluster
