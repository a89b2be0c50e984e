// SequenceTable: ids, the max_sequences bound, lease grants, renewals and expiry, and that
// closing releases the sequence's pins.
#include "server/engine/sequence_table.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace kvcd {
namespace sequence_table_test {

class SequenceTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend(1);
    auto m = ModelCache::Create(testing_util::TinySpec(), backend_.get(), 0.95, 0.85, &counters_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
  }
  std::unique_ptr<Backend> backend_;
  CacheCounters counters_;
  std::unique_ptr<ModelCache> model_;
};

TEST_F(SequenceTableTest, LeasePolicyGrantsTheDefaultOrARequestInRange) {
  const LeasePolicy p{1000, 5000};
  EXPECT_EQ(*p.Grant(0), 1000);
  EXPECT_EQ(*p.Grant(10), 10);
  EXPECT_EQ(*p.Grant(5000), 5000);
  for (int64_t bad : {-1, 9, 5001}) {
    auto g = p.Grant(bad);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find("expected 0 (default) or 10..5000"),
              absl::string_view::npos);
  }
}

TEST_F(SequenceTableTest, OpenFindRenewCloseAndTheBound) {
  SequenceTable table(LeasePolicy{1000, 5000}, 2);
  auto a = table.Open(model_.get(), "", {}, 1000);
  auto b = table.Open(model_.get(), "", {}, 2000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->id, (*b)->id);
  EXPECT_EQ(table.size(), 2);
  EXPECT_EQ(table.Open(model_.get(), "", {}, 1000).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*table.Find((*a)->id)).get(), a->get());
  EXPECT_EQ(*table.Renew((*a)->id, 0), 1000);  // 0 keeps the lease
  EXPECT_EQ(*table.Renew((*a)->id, 3000), 3000);
  EXPECT_EQ(table.Renew((*a)->id, 9).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*table.Close((*a)->id), 0);
  EXPECT_EQ(table.Find((*a)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Close((*a)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.size(), 1);
  EXPECT_EQ(model_->Snapshot().active_sequences, 1);
}

TEST_F(SequenceTableTest, ExpireClosesOnlySequencesPastTheirDeadline) {
  SequenceTable table(LeasePolicy{1000, 5000}, 8);
  auto short_lease = table.Open(model_.get(), "", {}, 10);
  auto long_lease = table.Open(model_.get(), "", {}, 5000);
  ASSERT_TRUE(short_lease.ok() && long_lease.ok());
  const int64_t now = (*short_lease)->deadline_ns.load() + 1;
  EXPECT_EQ(table.Expire(now), 1);
  EXPECT_EQ(table.Find((*short_lease)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Find((*long_lease)->id).ok());
  EXPECT_EQ(model_->Snapshot().active_sequences, 1);
}

// A fork counts like an opened sequence: the bound, the tenant's max_sequences and its
// max_pinned_pages (the fork's pages); a refused fork changes nothing.
TEST_F(SequenceTableTest, ForksCountAgainstTheBoundAndTheTenantsQuotas) {
  TenantQuotaConfig quotas;
  quotas.tenants["t"].max_sequences = 2;
  quotas.tenants["p"].max_pinned_pages = 6;
  TenantLedger ledger(quotas);
  SequenceTable table(LeasePolicy{1000, 5000}, 8, &ledger);
  const ModelSpec& s = model_->spec();
  const int64_t n = 3 * s.page_size;  // 3 pages
  std::vector<uint16_t> kv(static_cast<size_t>(s.num_layers * n * s.num_kv_heads * s.head_dim),
                           0x3f80);
  RowSource rows;
  rows.data = kv.data();
  rows.is_bf16 = true;
  rows.token_stride = int64_t{s.num_kv_heads} * s.head_dim;
  rows.layer_stride = n * rows.token_stride;
  std::vector<int32_t> tokens(static_cast<size_t>(n), 5);
  for (const char* tenant : {"t", "p"}) {
    auto src = table.Open(model_.get(), tenant, {}, 1000);
    ASSERT_TRUE(src.ok());
    ASSERT_TRUE(table.ReserveTokens(**src, n).ok());
    ASSERT_TRUE(model_->Append(src->get(), tokens, rows, rows).ok());
    table.Settle(**src);
    const int64_t used = model_->Snapshot().pools[0].pages_used;
    auto fork = table.Fork(**src, 2000);
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ((*fork)->lease_ms.load(), 2000);
    EXPECT_EQ(model_->Length(fork->get()), n);
    EXPECT_TRUE(table.Find((*fork)->id).ok());
    // "t": a third sequence passes max_sequences; "p": 3 more pages pass max_pinned_pages.
    const int64_t open = table.size();
    auto refused = table.Fork(**src, 2000);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << tenant;
    EXPECT_NE(refused.status().message().find(std::string(tenant) == "t" ? "max_sequences"
                                                                         : "max_pinned_pages"),
              std::string::npos)
        << refused.status();
    EXPECT_EQ(table.size(), open);
    EXPECT_EQ(model_->Snapshot().pools[0].pages_used, used);  // no page was taken
    ASSERT_TRUE(table.Close((*fork)->id).ok());
    ASSERT_TRUE(table.Close((*src)->id).ok());
  }
  for (const TenantUsage& u : ledger.Usage()) {
    EXPECT_EQ(u.open_sequences, 0) << u.tenant;
    EXPECT_EQ(u.pinned_pages, 0) << u.tenant;
  }
  EXPECT_EQ(model_->Snapshot().pools[0].pages_used, 0);
}

}  // namespace sequence_table_test
}  // namespace kvcd
