// Integration: tenants against the real daemon binary: per-tenant metrics are an opt-in on
// loopback only, and a greedy tenant cannot starve another of sequences, memory or
// registrations (quotas refused with RESOURCE_EXHAUSTED; Stats and /metrics report both).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "client/client.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace tenant_daemon_test {

using testing_util::DaemonProcess;
using testing_util::ScrapeMetrics;

// Issue #35.7: the unauthenticated metrics port had tenant= labels (tenant names and their
// use) while the log said it held no tenant data. Per-tenant metrics are an explicit opt-in
// (metrics_per_tenant), and refused at start-up when metrics listen beyond loopback.
TEST(TenantMetricsTest, PerTenantMetricsAreOptInAndLoopbackOnly) {
  constexpr char kBase[] = R"(
listen: 127.0.0.1:0
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 1MiB
)";
  auto open_one = [](const DaemonProcess& d) {
    ClientOptions o;
    o.target = d.grpc();
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->OpenSequence("tiny", "secret-tenant", {1, 2, 3}, 60000).ok());
  };
  {  // The default: aggregate metrics, no tenant label, and the log says so.
    DaemonProcess d;
    ASSERT_TRUE(d.CaptureStderr());
    ASSERT_TRUE(d.Start(std::string(kBase) + "metrics_listen: 127.0.0.1:0\n"));
    open_one(d);
    const std::string body = ScrapeMetrics(d);
    EXPECT_NE(body.find("kvcd_active_sequences 1"), std::string::npos) << body;
    EXPECT_EQ(body.find("tenant="), std::string::npos) << body;
    EXPECT_EQ(body.find("secret-tenant"), std::string::npos) << body;
    EXPECT_EQ(d.Stop(), 0);
  }
  {  // Opted in on loopback: the tenant metrics, and the log says they name tenants.
    DaemonProcess d;
    ASSERT_TRUE(d.CaptureStderr());
    ASSERT_TRUE(
        d.Start(std::string(kBase) + "metrics_listen: 127.0.0.1:0\nmetrics_per_tenant: true\n"));
    open_one(d);
    const std::string body = ScrapeMetrics(d);
    EXPECT_NE(body.find("kvcd_tenant_open_sequences{tenant=\"secret-tenant\"} 1"),
              std::string::npos)
        << body;
    EXPECT_NE(d.Stderr().find("name every tenant"), std::string::npos) << d.Stderr();
    EXPECT_EQ(d.Stop(), 0);
  }
  {  // Opted in beyond loopback: refused at start-up, saying why and what to change.
    DaemonProcess d;
    ASSERT_TRUE(d.CaptureStderr());
    EXPECT_FALSE(
        d.Start(std::string(kBase) + "metrics_listen: 0.0.0.0:0\nmetrics_per_tenant: true\n"));
    EXPECT_NE(d.WaitExit(), 0);
    EXPECT_NE(d.Stderr().find("refusing metrics_per_tenant"), std::string::npos) << d.Stderr();
    EXPECT_NE(d.Stderr().find("'0.0.0.0:0'"), std::string::npos) << d.Stderr();
  }
}

// Fair sharing against the real daemon: two tenants, the greedy one takes what its quota
// allows and is refused past it (RESOURCE_EXHAUSTED naming the quota), the other still
// gets sequences; Stats and /metrics report both.
TEST(TenantQuotaDaemonTest, AGreedyTenantCannotStarveAnother) {
  constexpr char kQuotaConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
metrics_per_tenant: true
memory_budget: 16MiB
max_sequences: 6
quotas:
  default: {max_sequences: 4, max_lease_ms: 2000}
  tenants:
    - {tenant: greedy, max_sequences: 3}
models:
  - builtin: tiny
    memory: 1MiB
)";
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start(kQuotaConfig));
  ClientOptions o;
  o.target = daemon.grpc();
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Client& client = **c;
  std::vector<uint64_t> greedy;
  absl::Status refused;
  for (int i = 0; i < 10; ++i) {  // as many 600 s leases as it can get
    auto s = client.OpenSequence("tiny", "greedy", {1, 2, 3}, 600000);
    if (!s.ok()) {
      refused = s.status();
      break;
    }
    EXPECT_EQ(s->lease_ms(), 2000);  // capped by max_lease_ms
    greedy.push_back(s->sequence_id());
  }
  EXPECT_EQ(greedy.size(), 3u);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("tenant 'greedy'"), absl::string_view::npos) << refused;
  EXPECT_NE(refused.message().find("max_sequences is 3"), absl::string_view::npos) << refused;
  for (int i = 0; i < 3; ++i) {
    auto s = client.OpenSequence("tiny", "other", {1, 2, 3}, 0);
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
  }
  auto stats = client.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  std::map<std::string, v1::TenantUsage> by_name;
  for (const auto& t : stats->tenants()) by_name[t.tenant()] = t;
  EXPECT_EQ(by_name["greedy"].open_sequences(), 3u);
  EXPECT_EQ(by_name["greedy"].max_sequences(), 3u);
  EXPECT_EQ(by_name["other"].open_sequences(), 3u);
  EXPECT_EQ(by_name["other"].max_sequences(), 4u);
  EXPECT_EQ(by_name["other"].max_lease_ms(), 2000);

  // /metrics carries the same, labelled by tenant.
  const std::string body = ScrapeMetrics(daemon);
  ASSERT_FALSE(body.empty());
  for (const char* line : {"kvcd_tenant_open_sequences{tenant=\"greedy\"} 3",
                           "kvcd_tenant_open_sequences{tenant=\"other\"} 3",
                           "kvcd_tenant_quota{quota=\"max_sequences\",tenant=\"greedy\"} 3"}) {
    EXPECT_NE(body.find(line), std::string::npos) << line;
  }
  // Closing one of greedy's sequences gives it a slot back.
  ASSERT_TRUE(client.CloseSequence(greedy[0]).ok());
  EXPECT_TRUE(client.OpenSequence("tiny", "greedy", {1, 2, 3}, 0).ok());
  EXPECT_EQ(daemon.Stop(), 0);
}

// Fair sharing of memory and registrations against the real daemon: the greedy tenant
// keeps putting prompts and registering models; past its memory share its Puts evict only
// its own prompts (and are refused, evicting nothing, once its pages are all pinned), and
// past its registration quota RegisterModel is refused; the other tenant's prompt stays
// byte-identical and whole, and it can still register. Stats and /metrics report both.
TEST(TenantQuotaDaemonTest, AGreedyTenantCannotStarveAnotherOfMemoryOrRegistrations) {
  constexpr char kShareConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
metrics_per_tenant: true
memory_budget: 16MiB
quotas:
  default: {max_models: 2}
  tenants:
    - {tenant: greedy, max_memory_share: 0.5, max_models: 1, max_model_bytes: 4MiB}
models:
  - builtin: tiny
    memory: 16KiB
)";
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start(kShareConfig));
  ClientOptions o;
  o.target = daemon.grpc();
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Client& client = **c;
  auto model = client.GetModel("tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  const v1::ModelProfile profile = model->profile();
  ASSERT_EQ(model->pools(0).pages_total(), 16u);
  auto put = [&](const std::string& tenant, uint64_t seed, int64_t n) {
    v1::PutRequest req;
    req.set_model("tiny");
    req.set_cache_salt(tenant);
    const auto t = synthetic::Tokens(seed, 0, n);
    req.mutable_tokens()->Add(t.begin(), t.end());
    const std::vector<int64_t> shape = {profile.num_layers(), n, profile.num_kv_heads(),
                                        profile.head_dim()};
    SetBf16FromFloat(req.mutable_k(), shape, synthetic::Kv(seed, profile, 0, n, 0).data());
    SetBf16FromFloat(req.mutable_v(), shape, synthetic::Kv(seed, profile, 0, n, 1).data());
    return client.Put(req);
  };
  // The other tenant's prompt: 24 tokens, 6 pages.
  ASSERT_TRUE(put("other", 1, 24).ok());
  // The greedy tenant puts 20 prompts of 2 pages; it holds at most 8 pages at any time.
  for (uint64_t seed = 100; seed < 120; ++seed) {
    auto r = put("greedy", seed, 8);
    ASSERT_TRUE(r.ok()) << seed << ": " << r.status();
    EXPECT_EQ(r->inserted_tokens(), 8);
  }
  auto held = [&]() {
    std::map<std::string, v1::TenantUsage> by_name;
    auto stats = client.Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) {
      for (const auto& t : stats->tenants()) by_name[t.tenant()] = t;
    }
    return by_name;
  };
  EXPECT_EQ(held()["greedy"].held_pages(), 8u);
  EXPECT_EQ(held()["other"].held_pages(), 6u);
  // Its four latest prompts are cached, the earlier ones went.
  EXPECT_EQ(client.Match("tiny", "greedy", synthetic::Tokens(119, 0, 8))->matched_tokens(), 8);
  EXPECT_EQ(client.Match("tiny", "greedy", synthetic::Tokens(100, 0, 8))->matched_tokens(), 0);

  // Pinned: the greedy tenant's next prompt is refused, naming tenant, share and usage.
  for (uint64_t seed = 116; seed < 120; ++seed) {
    ASSERT_TRUE(client.OpenSequence("tiny", "greedy", synthetic::Tokens(seed, 0, 8)).ok());
  }
  auto refused = put("greedy", 200, 8);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("tenant 'greedy' (cache_salt) holds 8 of the 16 "
                                            "pages of the bf16 pool, and its max_memory_share "
                                            "0.5 lets it hold 8"),
            absl::string_view::npos)
      << refused.status();
  // The other tenant's prompt opens whole and fetches back exactly the K/V it put.
  auto other = client.OpenSequence("tiny", "other", synthetic::Tokens(1, 0, 24));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->matched_tokens(), 24);
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(other->sequence_id());
  fetch.set_expand_to_bf16(true);
  auto fetched = client.FetchPages(fetch);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  v1::TensorRef k, v;
  const std::vector<int64_t> shape = {profile.num_layers(), 24, profile.num_kv_heads(),
                                      profile.head_dim()};
  SetBf16FromFloat(&k, shape, synthetic::Kv(1, profile, 0, 24, 0).data());
  SetBf16FromFloat(&v, shape, synthetic::Kv(1, profile, 0, 24, 1).data());
  EXPECT_TRUE(fetched->k().inline_data() == k.inline_data());
  EXPECT_TRUE(fetched->v().inline_data() == v.inline_data());

  // Registrations: the greedy tenant cannot take the rest of the budget, nor more models
  // than its quota; the other tenant still registers.
  v1::ModelProfile big = profile;
  big.set_name("greedy-big");
  big.set_memory_bytes(12 << 20);
  auto r = client.RegisterModel(big, "", "greedy");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("max_model_bytes 4194304"), absl::string_view::npos)
      << r.status();
  v1::ModelProfile small = profile;
  small.set_memory_bytes(1 << 20);
  small.set_name("greedy-1");
  ASSERT_TRUE(client.RegisterModel(small, "", "greedy").ok());
  small.set_name("greedy-2");
  r = client.RegisterModel(small, "", "greedy");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("tenant 'greedy' has registered 1 models; its quota "
                                      "max_models is 1"),
            absl::string_view::npos)
      << r.status();
  EXPECT_FALSE(client.GetModel("greedy-2").ok());
  small.set_name("other-1");
  EXPECT_TRUE(client.RegisterModel(small, "", "other").ok());
  auto usage = held();
  EXPECT_EQ(usage["greedy"].registered_models(), 1u);
  EXPECT_EQ(usage["greedy"].max_models(), 1u);
  EXPECT_DOUBLE_EQ(usage["greedy"].max_memory_share(), 0.5);
  EXPECT_EQ(usage["other"].registered_models(), 1u);
  EXPECT_EQ(usage["other"].max_models(), 2u);

  const std::string body = ScrapeMetrics(daemon);
  for (const char* line :
       {"kvcd_tenant_held_pages{tenant=\"greedy\"} 8", "kvcd_tenant_held_pages{tenant=\"other\"} 6",
        "kvcd_tenant_registered_models{tenant=\"greedy\"} 1",
        "kvcd_tenant_quota{quota=\"max_memory_share\",tenant=\"greedy\"} 0.5",
        "kvcd_tenant_quota{quota=\"max_models\",tenant=\"other\"} 2"}) {
    EXPECT_NE(body.find(line), std::string::npos) << line;
  }
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace tenant_daemon_test
}  // namespace kvcd
