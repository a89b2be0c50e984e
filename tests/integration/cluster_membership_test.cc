// Cluster membership on a real etcd (docs/cluster.md "Membership"): daemons on the CPU
// backend register a leased member key, leave at once on SIGTERM (lease revoked), vanish
// within TTL + one keep-alive on SIGKILL, and register again after etcd restarts; the health
// service "kvcd.cluster" is NOT_SERVING while the lease is lost. The test waits on the etcd
// keys and the health Watch stream with deadlines, never on fixed sleeps.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/client.h"
#include "cluster_servers.h"
#include "daemon_process.h"
#include "grpc/health/v1/health.grpc.pb.h"
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
  // The health service "kvcd.cluster" follows the advertisement (a Watch: each change is an
  // event on the stream); the whole server's health stays SERVING throughout.
  using grpc::health::v1::HealthCheckResponse;
  auto channel = grpc::CreateChannel(a.grpc(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::health::v1::HealthCheckRequest watch_req;
  watch_req.set_service("kvcd.cluster");
  auto watch = health->Watch(&watch_ctx, watch_req);
  auto next = [&](HealthCheckResponse::ServingStatus want) {
    HealthCheckResponse r;
    while (watch->Read(&r)) {
      if (r.status() == want) return true;
    }
    return false;
  };
  auto whole_server = [&] {
    grpc::ClientContext ctx;
    HealthCheckResponse r;
    const grpc::Status s = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &r);
    return s.ok() ? r.status() : HealthCheckResponse::UNKNOWN;
  };
  ASSERT_TRUE(next(HealthCheckResponse::SERVING)) << "advertised: kvcd.cluster SERVING";
  // etcd down until the daemon notices (a keep-alive fails): it stops advertising; when
  // etcd is back (its data kept)
  // the daemon registers again under a new lease, with the same incarnation.
  etcd_.Kill();
  ASSERT_TRUE(next(HealthCheckResponse::NOT_SERVING)) << "lease lost: kvcd.cluster NOT_SERVING";
  EXPECT_NE(a.Stderr().find("cluster: lease lost"), std::string::npos) << a.Stderr();
  EXPECT_EQ(whole_server(), HealthCheckResponse::SERVING) << "its own sessions are served";
  ASSERT_TRUE(etcd_.Start()) << etcd_.Log();
  ASSERT_TRUE(next(HealthCheckResponse::SERVING)) << "registered again: kvcd.cluster SERVING";
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
  watch_ctx.TryCancel();
  (void)watch->Finish();
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

namespace kvcd {
namespace cluster_membership_test {

// membership: dns with auth on: the daemon asks each address for its Stats with the token of
// cluster.peer_token_file, re-read every round. With a token the daemon does not know it
// sees nobody (not even itself); once the file holds a known token, it sees itself.
TEST(ClusterDnsMembershipTest, SeesPeersWithThePeerToken) {
  char dir[] = "/tmp/kvcd-dns-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string tokens = std::string(dir) + "/tokens.yaml";
  const std::string peer_token = std::string(dir) + "/peer-token";
  const std::string token = "peer-token-5b1f0e";
  // The operator's way of hashing: printf %s "$TOKEN" | sha256sum.
  ASSERT_EQ(std::system(("printf 'tokens:\\n  - name: peers\\n    sha256: %s\\n    tenants: "
                         "[\"*\"]\\n' $(printf %s '" +
                         token + "' | sha256sum | cut -c1-64) > " + tokens)
                            .c_str()),
            0);
  auto write = [&](const std::string& text) {
    std::ofstream(peer_token + ".tmp") << text;
    return std::rename((peer_token + ".tmp").c_str(), peer_token.c_str()) == 0;
  };
  ASSERT_TRUE(write("not-a-known-token\n"));
  DaemonProcess d;
  ASSERT_TRUE(d.Start(R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 16384
auth:
  tokens_file: )" + tokens +
                      R"(
cluster:
  member_id: solo
  membership: dns
  dns_name: localhost
  load_interval_ms: 100
  peer_token_file: )" +
                      peer_token + "\n"));
  auto metric = [&](const std::string& name) {
    return testing_util::MetricValue(testing_util::ScrapeMetrics(d), name);
  };
  // A round ran (advertised after the first) and found nobody: the token was refused.
  ASSERT_TRUE(
      WaitFor([&] { return metric("kvcd_cluster_membership_state{state=\"advertised\"}") == 1; },
              std::chrono::seconds(10)));
  EXPECT_EQ(metric("kvcd_cluster_members"), 0);
  ASSERT_TRUE(write(token + "\n"));
  EXPECT_TRUE(
      WaitFor([&] { return metric("kvcd_cluster_members") == 1; }, std::chrono::seconds(10)))
      << "the rotated peer token was not used";
  std::filesystem::remove_all(dir);
}

}  // namespace cluster_membership_test
}  // namespace kvcd
