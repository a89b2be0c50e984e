// Cluster membership on a real etcd (docs/cluster.md "Membership"): daemons on the CPU
// backend register a leased member key, leave at once on SIGTERM (lease revoked), vanish
// within TTL + one keep-alive on SIGKILL, and register again after etcd restarts. The test
// waits on the etcd keys with deadlines, never on fixed sleeps.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "client/client.h"
#include "cluster_servers.h"
#include "daemon_process.h"
#include "kvcd/v1/kvcache.grpc.pb.h"
#include "server/cluster/etcd_client.h"
#include "server/cluster/member_info.h"

namespace kvcd {
namespace cluster_membership_test {

using testing_util::DaemonProcess;
using testing_util::EtcdServer;
using testing_util::WaitFor;
using Clock = std::chrono::steady_clock;

constexpr int kTtlS = 2;

std::string Config(const std::string& member, const std::string& etcd) {
  return R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 16384
cluster:
  name: t
  member_id: )" +
         member + R"(
  membership: etcd
  etcd_endpoints: [)" +
         etcd + R"(]
  lease_ttl_s: )" +
         std::to_string(kTtlS) + "\n";
}

class ClusterMembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Start()) << etcd_.Log();
    client_ = std::make_unique<EtcdClient>(std::vector<std::string>{etcd_.endpoint()});
  }
  // The member's value in etcd, or "" when the key is absent (or etcd does not answer).
  std::string Value(const std::string& member, int64_t* lease = nullptr) {
    auto kvs = client_->Get("/kvcd/t/members/" + member);
    if (!kvs.ok() || kvs->empty()) return "";
    if (lease != nullptr) *lease = kvs->front().lease;
    return kvs->front().value;
  }
  std::string Incarnation(DaemonProcess& d, uint64_t* capacity = nullptr) {
    ClientOptions o;
    o.target = d.grpc();
    auto c = Client::Connect(o);
    if (!c.ok()) return "";
    auto s = (*c)->Stats();
    if (capacity != nullptr && s.ok()) *capacity = s->pages_capacity();
    return s.ok() ? s->incarnation() : "";
  }

  EtcdServer etcd_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(ClusterMembershipTest, LeasedKeyComesAndGoes) {
  DaemonProcess a, b;
  ASSERT_TRUE(a.Start(Config("a", etcd_.endpoint())));
  ASSERT_TRUE(b.Start(Config("b", etcd_.endpoint())));
  ASSERT_TRUE(WaitFor([&] { return !Value("a").empty() && !Value("b").empty(); },
                      std::chrono::seconds(10)));
  int64_t lease = 0;
  auto info = DecodeMemberInfo(Value("a", &lease), "a");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_NE(lease, 0) << "the member key is attached to a lease";
  EXPECT_EQ(info->address, a.grpc());
  EXPECT_EQ(info->backend, "cpu");
  EXPECT_GT(info->capacity_pages, 0u);
  EXPECT_GT(info->page_bytes, 0u);
  uint64_t capacity = 0;
  EXPECT_EQ(info->incarnation, Incarnation(a, &capacity))
      << "Stats reports the advertised incarnation";
  EXPECT_EQ(info->capacity_pages, capacity);

  // The keep-alive holds the key past several TTLs.
  const auto hold_until = Clock::now() + std::chrono::seconds(kTtlS * 2);
  while (Clock::now() < hold_until) {
    ASSERT_FALSE(Value("a").empty()) << "the lease ran out although the daemon lives";
    ASSERT_FALSE(WaitFor([&] { return Value("a").empty(); }, std::chrono::milliseconds(200)));
  }

  // SIGKILL: nobody revokes the lease; the key goes when it expires, within TTL plus one
  // keep-alive period (TTL/3) after the last keep-alive.
  const auto killed = Clock::now();
  a.Kill();
  ASSERT_TRUE(WaitFor([&] { return Value("a").empty(); }, std::chrono::seconds(kTtlS * 3)));
  const double gone_s = std::chrono::duration<double>(Clock::now() - killed).count();
  EXPECT_LE(gone_s, kTtlS + kTtlS / 3.0 + 1.0) << "lease expiry took " << gone_s << " s";

  // SIGTERM: the lease is revoked while draining, so the key goes at once.
  const auto stopped = Clock::now();
  EXPECT_EQ(b.Stop(), 0);
  const double revoked_s = std::chrono::duration<double>(Clock::now() - stopped).count();
  EXPECT_TRUE(Value("b").empty());
  EXPECT_LT(revoked_s, kTtlS) << "a clean stop revokes the lease instead of letting it expire";
}

TEST_F(ClusterMembershipTest, RegistersAgainAfterEtcdRestarts) {
  DaemonProcess a;
  ASSERT_TRUE(a.CaptureStderr());
  ASSERT_TRUE(a.Start(Config("a", etcd_.endpoint())));
  ASSERT_TRUE(WaitFor([&] { return !Value("a").empty(); }, std::chrono::seconds(10)));
  const std::string incarnation = Incarnation(a);
  int64_t lease_before = 0;
  Value("a", &lease_before);
  // etcd down until the daemon notices (a keep-alive fails): it stops advertising; when
  // etcd is back (its data kept)
  // the daemon registers again under a new lease, with the same incarnation.
  etcd_.Kill();
  ASSERT_TRUE(WaitFor([&] { return a.Stderr().find("cluster: lease lost") != std::string::npos; },
                      std::chrono::seconds(kTtlS * 3)))
      << a.Stderr();
  ASSERT_TRUE(etcd_.Start()) << etcd_.Log();
  int64_t lease_after = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string v = Value("a", &lease_after);
        return !v.empty() && lease_after != lease_before;
      },
      std::chrono::seconds(kTtlS * 5)))
      << "no new registration after etcd restarted";
  auto info = DecodeMemberInfo(Value("a"), "a");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->incarnation, incarnation);
}

}  // namespace cluster_membership_test
}  // namespace kvcd

namespace kvcd {
namespace cluster_membership_test {

// membership: dns, with a name that resolves to loopback: the daemon finds itself through
// its own Stats; a pull from an unknown member is NOT_FOUND and from itself INVALID_ARGUMENT.
TEST(ClusterDnsMembershipTest, FindsItselfThroughStats) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 16384
cluster:
  member_id: solo
  membership: dns
  dns_name: localhost
  load_interval_ms: 100
)"));
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string m = testing_util::ScrapeMetrics(d);
        return testing_util::MetricValue(m, "kvcd_cluster_members") == 1 &&
               testing_util::MetricValue(
                   m, "kvcd_cluster_membership_state{state=\"advertised\"}") == 1;
      },
      std::chrono::seconds(10)));
  auto stub =
      v1::KvCache::NewStub(grpc::CreateChannel(d.grpc(), grpc::InsecureChannelCredentials()));
  for (const auto& [peer, code] : std::vector<std::pair<std::string, grpc::StatusCode>>{
           {"nobody", grpc::StatusCode::NOT_FOUND}, {"solo", grpc::StatusCode::INVALID_ARGUMENT}}) {
    v1::PullPrefixRequest r;
    r.set_model("tiny");
    for (int32_t t : {1, 2, 3, 4}) r.add_tokens(t);
    r.set_peer_member_id(peer);
    v1::PullPrefixResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->PullPrefix(&ctx, r, &resp).error_code(), code) << peer;
  }
}

}  // namespace cluster_membership_test
}  // namespace kvcd
