// SequenceTable: ids, the max_sequences bound, lease grants, renewals and expiry, and that
// closing releases the sequence's pins.
#include "server/engine/sequence_table.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace kvcd {
namespace {

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

}  // namespace
}  // namespace kvcd
