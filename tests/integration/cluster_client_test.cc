// The C++ cluster client (client/cluster/) with real etcd, Redis and daemons on loopback
// (the daemons register themselves and write the block index): the index read fenced by
// incarnation, a session routed to the holder of its prefix, and a member killed under the
// session (re-opened on the other member, re-prefilled, the same answer as a sequence that
// never moved).
#include "client/cluster/cluster_client.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/cluster/redis_index.h"
#include "cluster_servers.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "server/cluster/redis_connection.h"
#include "testing/synthetic.h"

namespace kvcd::cluster {
namespace cluster_client_test {

using testing_util::DaemonProcess;
using testing_util::EtcdServer;
using testing_util::RedisServer;
using testing_util::WaitFor;

std::string Config(const std::string& member, const std::string& etcd, const std::string& redis) {
  return R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 1MiB
)" + testing_util::ClusterSection("cc", member, etcd, redis);
}

class ClusterClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Start()) << etcd_.Log();
    ASSERT_TRUE(redis_.Start()) << redis_.Log();
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          daemons_[i].Start(Config("m" + std::to_string(i), etcd_.endpoint(), redis_.url())));
    }
    ClusterClientOptions o;
    o.etcd_endpoints = {etcd_.endpoint()};
    o.cluster_name = "cc";
    o.redis_url = redis_.url();
    o.routing.replicate_after = 0;
    o.client.deadline = std::chrono::milliseconds(10000);
    auto c = ClusterClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cc_ = *std::move(c);
    ASSERT_TRUE(cc_->directory().WaitFor([](const auto& m) { return m.size() == 2; },
                                         std::chrono::seconds(20)));
  }

  EtcdServer etcd_;
  RedisServer redis_;
  DaemonProcess daemons_[2];
  std::unique_ptr<ClusterClient> cc_;
};

TEST_F(ClusterClientTest, IndexReadsAreFencedByIncarnation) {
  auto index = RedisIndex::Connect(redis_.url(), "fence");
  ASSERT_TRUE(index.ok()) << index.status();
  RedisConnection r("127.0.0.1", redis_.port(), std::chrono::milliseconds(2000));
  const std::string h0(32, 'a'), h1(32, 'b');
  std::string key0 = "kvcd:{fence}:blk:";
  for (int i = 0; i < 32; ++i) key0 += "61";
  ASSERT_TRUE(r.Command({"HSET", key0, "x", "0123456789abcdef:host", "y", "0000000000000000:host",
                         "z", "0123456789abcdef:floppy"})
                  .ok());
  ASSERT_TRUE(r.Command({"HSET", "kvcd:{fence}:load:x", "incarnation", "0123456789abcdef",
                         "pages_used", "3", "pages_capacity", "8"})
                  .ok());
  ASSERT_TRUE(r.Command({"HSET", "kvcd:{fence}:load:y", "incarnation", "1111111111111111",
                         "pages_used", "-3"})
                  .ok());
  Incarnations inc = {{"x", "0123456789abcdef"}, {"y", "1111111111111111"}};
  auto held = (*index)->Holders({h0, h1}, inc);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->size(), 2u);
  ASSERT_EQ((*held)[0].size(), 1u);  // y: another incarnation; z: not a member, bad tier
  EXPECT_EQ((*held)[0].at("x"), "host");
  EXPECT_TRUE((*held)[1].empty());
  auto loads = (*index)->Loads(inc);
  ASSERT_TRUE(loads.ok()) << loads.status();
  ASSERT_EQ(loads->size(), 1u);  // y's figures are malformed
  EXPECT_EQ(loads->at("x").pages_used, 3);
  EXPECT_EQ(loads->at("x").pages_capacity, 8);
  EXPECT_GE((*index)->rejected(), 3);
  EXPECT_EQ(RedisIndex::Connect("redis://127.0.0.1", "cc").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RedisIndex::Connect(redis_.url(), "bad name").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClusterClientTest, SessionGoesToTheHolderAndSurvivesItsMemberKilled) {
  Client* m1 = *cc_->ClientOf("m1");
  auto info = m1->GetModel("tiny");
  ASSERT_TRUE(info.ok()) << info.status();
  const v1::ModelProfile p = info->profile();
  const int64_t prefix = 8 * p.page_size(), n = prefix + 3;
  ASSERT_TRUE(m1->Put(synthetic::Put(7, p, prefix)).ok());
  const std::vector<int32_t> tokens = synthetic::Tokens(7, 0, n + 2);
  const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + n);
  // The daemon writes the index from a background thread: wait for the route to follow it.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto d = cc_->Route("tiny", "", prompt);
        return d.ok() && d->member_id == "m1" && d->reason == "index";
      },
      std::chrono::seconds(20)));
  KvSource kv = [&](int64_t first, int64_t count, v1::TensorRef* k, v1::TensorRef* v) {
    const std::vector<int64_t> shape = {p.num_layers(), count, p.num_kv_heads(), p.head_dim()};
    SetBf16FromFloat(k, shape, synthetic::Kv(7, p, first, count, 0).data());
    SetBf16FromFloat(v, shape, synthetic::Kv(7, p, first, count, 1).data());
    return absl::OkStatus();
  };
  auto s = cc_->Open("tiny", "", prompt, kv);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->member_id(), "m1");
  EXPECT_EQ((*s)->matched_tokens(), prefix);

  daemons_[1].Kill();
  v1::TensorRef k, v;
  ASSERT_TRUE(kv(n, 2, &k, &v).ok());
  const std::vector<int32_t> more(tokens.begin() + n, tokens.end());
  auto len = (*s)->Append(more, k, v);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, n + 2);
  EXPECT_EQ((*s)->member_id(), "m0");
  EXPECT_EQ((*s)->failovers(), 1);
  EXPECT_EQ((*s)->reprefilled_tokens(), n);  // m0 held nothing of it

  // The moved session answers as a sequence opened on m0 with every token from the start.
  Client* m0 = *cc_->ClientOf("m0");
  auto ref = m0->OpenSequence("tiny", "ref", tokens);
  ASSERT_TRUE(ref.ok()) << ref.status();
  v1::AppendRequest app;
  app.set_sequence_id(ref->sequence_id());
  app.mutable_tokens()->Add(tokens.begin(), tokens.end());
  ASSERT_TRUE(kv(0, n + 2, app.mutable_k(), app.mutable_v()).ok());
  ASSERT_TRUE(m0->Append(app).ok());
  for (int layer = 0; layer < p.num_layers(); ++layer) {
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    std::vector<float> q = synthetic::Row(9, p, layer, 0, 2);
    SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    auto got = (*s)->AttentionDecode(req);
    ASSERT_TRUE(got.ok()) << got.status();
    req.add_sequence_ids(ref->sequence_id());
    auto want = m0->AttentionDecode(req);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->o().inline_data(), want->o().inline_data()) << "layer " << layer;
    EXPECT_EQ(got->lengths(0), n + 2);
  }
  EXPECT_TRUE(m0->CloseSequence(ref->sequence_id()).ok());
  auto closed = (*s)->Close(true);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, n + 2);
}

}  // namespace cluster_client_test
}  // namespace kvcd::cluster

namespace kvcd::cluster {
namespace cluster_client_test {

// Membership without etcd (membership dns): the client resolves a name (localhost here) on
// the members' port and names each member by its Stats; sessions route and open as with etcd.
TEST(ClusterClientDnsTest, MembersFromTheNamesAddresses) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 1MiB
cluster:
  member_id: dns-m
)"));
  const std::string& addr = d.grpc();
  ClusterClientOptions o;
  o.dns_name = "localhost";
  o.dns_port = std::stoi(addr.substr(addr.rfind(':') + 1));
  o.dns_refresh = std::chrono::milliseconds(200);
  o.client.deadline = std::chrono::milliseconds(10000);
  auto c = ClusterClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->directory().WaitFor(
      [&](const MemberDirectory::Members& m) {
        auto it = m.find("dns-m");
        return it != m.end() && it->second.address == addr && it->second.incarnation.size() == 16;
      },
      std::chrono::seconds(10)));
  const std::vector<int32_t> tokens = synthetic::Tokens(3, 0, 9);
  auto route = (*c)->Route("tiny", "", tokens);
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_EQ(route->member_id, "dns-m");
  auto info = (*(*c)->ClientOf("dns-m"))->GetModel("tiny");
  ASSERT_TRUE(info.ok()) << info.status();
  const v1::ModelProfile p = info->profile();
  KvSource kv = [&](int64_t first, int64_t count, v1::TensorRef* k, v1::TensorRef* v) {
    const std::vector<int64_t> shape = {p.num_layers(), count, p.num_kv_heads(), p.head_dim()};
    SetBf16FromFloat(k, shape, synthetic::Kv(3, p, first, count, 0).data());
    SetBf16FromFloat(v, shape, synthetic::Kv(3, p, first, count, 1).data());
    return absl::OkStatus();
  };
  auto s = (*c)->Open("tiny", "", tokens, kv);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->member_id(), "dns-m");
  EXPECT_EQ((*s)->length(), 9);
  ASSERT_TRUE((*s)->Close().ok());

  // A name that does not resolve is refused at once (never an empty cluster by mistake).
  o.dns_name = "no-such-member.invalid";
  auto none = ClusterClient::Connect(o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
}

}  // namespace cluster_client_test
}  // namespace kvcd::cluster
