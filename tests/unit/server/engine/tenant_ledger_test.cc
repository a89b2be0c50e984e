// TenantLedger: one tenant's quota beside what it holds — open sequences, pinned pages,
// pool shares, registrations — refusals that name the quota and take nothing, and the
// usage report.
#include "server/engine/tenant_ledger.h"

#include <gtest/gtest.h>

namespace kvcd {
namespace tenant_ledger_test {

TenantQuotaConfig Quotas() {
  TenantQuotaConfig q;
  q.defaults.max_lease_ms = 5000;
  TenantQuota& a = q.tenants["team-a"];
  a.max_sequences = 2;
  a.max_pinned_pages = 10;
  a.max_memory_share = 0.5;
  a.max_models = 1;
  a.max_model_bytes = 1000;
  a.max_pinned_prefix_pages = 6;
  return q;
}

// Prefix pins count their pages per pin against max_pinned_prefix_pages, apart from the
// pages of open sequences (max_pinned_pages); a refusal names the quota, its value and the
// usage, and takes nothing.
TEST(TenantLedgerTest, PrefixPinsStayUnderTheirOwnQuota) {
  TenantLedger ledger(Quotas());
  ASSERT_TRUE(ledger.PinPrefixPages("team-a", 4).ok());
  ASSERT_TRUE(ledger.PinPages("team-a", 10, "the matched prefix").ok());  // the other quota
  absl::Status s = ledger.PinPrefixPages("team-a", 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant 'team-a' (cache_salt) has 4 pages pinned by its prefix pins and this pin "
            "needs 3 more; its quota max_pinned_prefix_pages is 6; unpin prefixes (UnpinPrefix) "
            "or let their ttl run out first");
  // The same pages pinned twice count twice: 4 + 2 fills the quota exactly.
  ASSERT_TRUE(ledger.PinPrefixPages("team-a", 2).ok());
  EXPECT_EQ(ledger.PinPrefixPages("team-a", 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.PinPrefixPages("team-a", INT64_MAX).code(),
            absl::StatusCode::kResourceExhausted);  // no overflow in the check
  std::vector<TenantUsage> u = ledger.Usage();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].pinned_prefix_pages, 6);
  EXPECT_EQ(u[0].pinned_pages, 10);
  EXPECT_EQ(u[0].quota.max_pinned_prefix_pages, 6);
  ledger.ReleasePrefixPages("team-a", 4);
  EXPECT_TRUE(ledger.PinPrefixPages("team-a", 4).ok());
  // Without a quota (0) any number of pages; a tenant whose pins are all gone is dropped.
  ASSERT_TRUE(ledger.PinPrefixPages("free", 1 << 20).ok());
  EXPECT_EQ(ledger.Usage().size(), 2u);
  ledger.ReleasePrefixPages("free", 1 << 20);
  u = ledger.Usage();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].tenant, "team-a");
}

TEST(TenantLedgerTest, SequencesAndPinnedPagesStayUnderTheQuota) {
  TenantLedger ledger(Quotas());
  ASSERT_TRUE(ledger.TakeSequence("team-a").ok());
  ASSERT_TRUE(ledger.TakeSequence("team-a").ok());
  absl::Status s = ledger.TakeSequence("team-a");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant 'team-a' (cache_salt) has 2 open sequences; its quota max_sequences is 2; "
            "close sequences first");

  ASSERT_TRUE(ledger.PinPages("team-a", 8, "the matched prefix").ok());
  s = ledger.PinPages("team-a", 3, "this call");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant 'team-a' (cache_salt) holds 8 pages and this call needs 3 more; its quota "
            "max_pinned_pages is 10; close sequences first");
  ledger.AdjustPinned("team-a", -1);  // a call settled on fewer pages than it reserved
  EXPECT_TRUE(ledger.PinPages("team-a", 3, "this call").ok());

  std::vector<TenantUsage> u = ledger.Usage();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].tenant, "team-a");
  EXPECT_EQ(u[0].open_sequences, 2);
  EXPECT_EQ(u[0].pinned_pages, 10);
  EXPECT_EQ(u[0].quota.max_sequences, 2);

  // Closing gives the slot and the pages back; a tenant without quota holds no limit.
  ledger.ReleaseSequence("team-a", 6);
  ledger.ReleaseSequence("team-a", 4);
  u = ledger.Usage();
  ASSERT_EQ(u.size(), 1u);  // still listed: it has a configured quota
  EXPECT_EQ(u[0].open_sequences, 0);
  EXPECT_EQ(u[0].pinned_pages, 0);
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(ledger.TakeSequence("free").ok());
  EXPECT_TRUE(ledger.PinPages("free", 1 << 20, "this call").ok());
  EXPECT_EQ(ledger.Usage().size(), 2u);
}

TEST(TenantLedgerTest, LeasesAndPoolSharesComeFromTheTenantsQuota) {
  TenantLedger ledger(Quotas());
  EXPECT_EQ(ledger.CapLease("anyone", 9000), 5000);  // the default quota's cap
  EXPECT_EQ(ledger.CapLease("anyone", 300), 300);
  EXPECT_EQ(ledger.CapLease("team-a", 9000), 9000);  // team-a sets no cap
  EXPECT_DOUBLE_EQ(ledger.PoolShare("team-a"), 0.5);
  EXPECT_DOUBLE_EQ(ledger.PoolShare("anyone"), 1.0);
}

TEST(TenantLedgerTest, RegistrationsCountModelsAndBytes) {
  TenantLedger ledger(Quotas());
  uint64_t limit = 4000;
  std::string why;
  ASSERT_TRUE(ledger.CheckRegistration("team-a", "m1", 600, &limit, &why).ok());
  EXPECT_EQ(limit, 1000u);  // max_model_bytes is the tighter bound ...
  EXPECT_NE(why.find("tenant 'team-a''s quota max_model_bytes 1000 (0 bytes registered"),
            std::string::npos)
      << why;  // ... and says so
  absl::Status s = ledger.CheckRegistration("team-a", "big", 1001, &limit, &why);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("model 'big' asks for memory_bytes 1001 but only 1000 bytes"),
            absl::string_view::npos)
      << s;
  ledger.AddRegistration("team-a", 640);
  s = ledger.CheckRegistration("team-a", "m2", 1, &limit, &why);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant 'team-a' has registered 1 models; its quota max_models is 1; model 'm2' was "
            "not registered");
  // Without a quota the daemon's budget stays the limit.
  limit = 4000;
  why.clear();
  EXPECT_TRUE(ledger.CheckRegistration("other", "m", 3000, &limit, &why).ok());
  EXPECT_EQ(limit, 4000u);
  EXPECT_TRUE(why.empty());

  const std::vector<TenantUsage> u = ledger.Usage();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].registered_models, 1);
  EXPECT_EQ(u[0].registered_model_bytes, 640u);
}

// Issue #35.4: one token could take every decode channel. A channel counts once against
// each tenant of its token, all or none; ending it gives the slots back.
TEST(TenantLedgerTest, DecodeChannelsStayUnderEachTenantsQuota) {
  TenantQuotaConfig q;
  q.defaults.max_decode_channels = 3;
  q.tenants["team-a"].max_decode_channels = 2;
  q.tenants["team-b"].max_decode_channels = 0;  // no limit
  TenantLedger ledger(q);
  ASSERT_TRUE(ledger.TakeDecodeChannel({"team-a"}).ok());
  ASSERT_TRUE(ledger.TakeDecodeChannel({"team-a", "team-b"}).ok());
  absl::Status s = ledger.TakeDecodeChannel({"team-b", "team-a"});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant 'team-a' (a tenant of the token) has 2 decode channels open; its quota "
            "max_decode_channels is 2; close channels first");
  auto held = [&](const std::string& tenant) -> int64_t {
    for (const TenantUsage& u : ledger.Usage()) {
      if (u.tenant == tenant) return u.open_decode_channels;
    }
    return -1;
  };
  EXPECT_EQ(held("team-a"), 2);
  EXPECT_EQ(held("team-b"), 1);  // the refused channel took nothing from team-b
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(ledger.TakeDecodeChannel({"team-b"}).ok());
  // The defaults hold for an unlisted tenant (the default tenant "" of "*" tokens too).
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ledger.TakeDecodeChannel({""}).ok());
  s = ledger.TakeDecodeChannel({""});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("max_decode_channels is 3"), std::string::npos) << s;

  ledger.ReleaseDecodeChannel({"team-a"});
  EXPECT_EQ(held("team-a"), 1);
  EXPECT_TRUE(ledger.TakeDecodeChannel({"team-a"}).ok());
  ledger.ReleaseDecodeChannel({""});
  EXPECT_TRUE(ledger.TakeDecodeChannel({""}).ok());
  for (int i = 0; i < 3; ++i) ledger.ReleaseDecodeChannel({""});
  EXPECT_EQ(held(""), -1);  // holds nothing, no configured quota: not listed
}

}  // namespace tenant_ledger_test
}  // namespace kvcd
