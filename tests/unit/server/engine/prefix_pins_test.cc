// Prefix pins through the CacheEngine: a pinned prefix survives a flood of one-off Puts that
// evicts everything else, and is an ordinary LRU prefix again once unpinned or expired; the
// tenant's max_pinned_prefix_pages quota (per pin); ttl bounds; Stats and the ledger.
#include "server/engine/prefix_pins.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/steady_clock.h"
#include "test_util.h"

namespace kvcd {
namespace prefix_pins_test {

using testing_util::MakePut;
using testing_util::TestConfig;
using testing_util::TinySpec;

constexpr int64_t kPageBytes = 2LL * 2 * 2 * 4 * 16 * 2;  // tiny: layers*K,V*heads*tokens*dim*bf16

class PrefixPinsTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(TestConfig()); }

  void Start(ServerConfig config) {
    engine_ = std::make_unique<CacheEngine>(config, MakeCpuBackend(1));
    spec_ = TinySpec(16 * kPageBytes);  // 16 pages of 4 tokens
    ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  }

  absl::Status Put(uint64_t seed, int64_t n, const std::string& salt = "") {
    v1::PutResponse r;
    return engine_->Put(MakePut(spec_, seed, n, salt), &r);
  }
  int64_t Match(uint64_t seed, int64_t n, const std::string& salt = "") {
    v1::MatchRequest m;
    m.set_model(spec_.name);
    m.set_cache_salt(salt);
    const auto t = synthetic::Tokens(seed, 0, n);
    m.mutable_tokens()->Add(t.begin(), t.end());
    v1::MatchResponse r;
    EXPECT_TRUE(engine_->Match(m, &r).ok());
    return r.matched_tokens();
  }
  v1::PinPrefixRequest PinRequest(uint64_t seed, int64_t n, int64_t ttl_ms,
                                  const std::string& salt = "") {
    v1::PinPrefixRequest req;
    req.set_model(spec_.name);
    req.set_cache_salt(salt);
    const auto t = synthetic::Tokens(seed, 0, n);
    req.mutable_tokens()->Add(t.begin(), t.end());
    req.set_ttl_ms(ttl_ms);
    return req;
  }
  absl::StatusOr<v1::PinPrefixResponse> Pin(uint64_t seed, int64_t n, int64_t ttl_ms,
                                            const std::string& salt = "") {
    v1::PinPrefixResponse r;
    absl::Status s = engine_->PinPrefix(PinRequest(seed, n, ttl_ms, salt), &r);
    if (!s.ok()) return s;
    return r;
  }
  // One-off prompts of 2 pages each, 40 pages in all: more than the pool holds.
  void Flood(uint64_t first_seed) {
    for (uint64_t seed = first_seed; seed < first_seed + 20; ++seed) {
      ASSERT_TRUE(Put(seed, 8).ok()) << seed;
    }
  }
  v1::StatsResponse Stats() {
    v1::StatsResponse s;
    EXPECT_TRUE(engine_->Stats(v1::StatsRequest(), &s).ok());
    return s;
  }

  ModelSpec spec_;
  std::unique_ptr<CacheEngine> engine_;
};

TEST_F(PrefixPinsTest, APinnedPrefixSurvivesAFloodUntilUnpinned) {
  ASSERT_TRUE(Put(1, 18).ok());  // the "system prompt": 4 full pages (+2 tokens not stored)
  auto pin = Pin(1, 18, 60000);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_NE(pin->pin_id(), 0u);
  EXPECT_EQ(pin->pinned_tokens(), 16);
  EXPECT_EQ(pin->pinned_pages(), 4);
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  EXPECT_GE(pin->expires_unix_ms(), now_ms + 59000);
  EXPECT_LE(pin->expires_unix_ms(), now_ms + 60000);

  Flood(100);
  EXPECT_GT(Stats().evicted_pages(), 0u);
  EXPECT_EQ(Match(1, 18), 16);  // still cached
  EXPECT_EQ(Match(100, 8), 0);  // the oldest one-off prompt was evicted
  v1::StatsResponse s = Stats();
  ASSERT_EQ(s.pins_size(), 1);
  EXPECT_EQ(s.pins(0).pin_id(), pin->pin_id());
  EXPECT_EQ(s.pins(0).tenant(), "");
  EXPECT_EQ(s.pins(0).model(), spec_.name);
  EXPECT_EQ(s.pins(0).pinned_pages(), 4);
  EXPECT_EQ(s.pins(0).pinned_tokens(), 16);
  EXPECT_EQ(s.pins(0).expires_unix_ms(), pin->expires_unix_ms());

  v1::UnpinPrefixRequest unpin;
  unpin.set_pin_id(pin->pin_id());
  v1::UnpinPrefixResponse unpinned;
  ASSERT_TRUE(engine_->UnpinPrefix(unpin, &unpinned).ok());
  EXPECT_EQ(unpinned.unpinned_pages(), 4);
  EXPECT_EQ(Stats().pins_size(), 0);
  EXPECT_EQ(engine_->UnpinPrefix(unpin, &unpinned).code(), absl::StatusCode::kNotFound);
  // An ordinary LRU prefix again: the next flood evicts it like any other.
  EXPECT_EQ(Match(1, 18), 16);
  Flood(200);
  EXPECT_EQ(Match(1, 18), 0);
}

TEST_F(PrefixPinsTest, AnExpiredPinIsAnOrdinaryPrefixAgain) {
  ASSERT_TRUE(Put(1, 16).ok());
  auto pin = Pin(1, 16, 1000);
  ASSERT_TRUE(pin.ok()) << pin.status();
  const int64_t now = SteadyNowNs();
  EXPECT_EQ(engine_->ExpirePins(now), 0);  // 1 s to go
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 4);
  Flood(100);
  EXPECT_EQ(Match(1, 16), 16);
  EXPECT_EQ(engine_->ExpirePins(now + 2'000'000'000), 1);  // 2 s later
  EXPECT_EQ(engine_->ExpiredPins(), 1u);
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 0);
  EXPECT_EQ(Stats().pins_size(), 0);
  v1::UnpinPrefixRequest unpin;
  unpin.set_pin_id(pin->pin_id());
  v1::UnpinPrefixResponse unpinned;
  const absl::Status s = engine_->UnpinPrefix(unpin, &unpinned);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("is not live (never pinned, unpinned, or its ttl ran out)"),
            std::string::npos)
      << s;
  Flood(200);
  EXPECT_EQ(Match(1, 16), 0);
}

// A pin and an open sequence on the same prefix: both hold it, and each releases only its own.
TEST_F(PrefixPinsTest, PinsAndSequencesPinIndependently) {
  ASSERT_TRUE(Put(1, 16).ok());
  v1::OpenSequenceRequest open;
  open.set_model(spec_.name);
  const auto t = synthetic::Tokens(1, 0, 8);
  open.mutable_tokens()->Add(t.begin(), t.end());
  v1::OpenSequenceResponse opened;
  ASSERT_TRUE(engine_->OpenSequence(open, &opened).ok());  // pins pages 0..1
  auto pin = Pin(1, 16, 60000);                            // pins pages 0..3
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 4);
  v1::CloseSequenceRequest close;
  close.set_sequence_id(opened.sequence_id());
  v1::CloseSequenceResponse closed;
  ASSERT_TRUE(engine_->CloseSequence(close, &closed).ok());
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 4);
  v1::UnpinPrefixRequest unpin;
  unpin.set_pin_id(pin->pin_id());
  v1::UnpinPrefixResponse unpinned;
  ASSERT_TRUE(engine_->UnpinPrefix(unpin, &unpinned).ok());
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 0);
}

// max_pinned_prefix_pages counts every pin's pages, also pages another of the tenant's pins
// holds; a refused pin pins and counts nothing. Another tenant is not limited by it.
TEST_F(PrefixPinsTest, PinnedPagesCountPerPinAgainstTheTenantsQuota) {
  ServerConfig config = TestConfig();
  config.quotas.tenants["team"].max_pinned_prefix_pages = 6;
  Start(config);
  ASSERT_TRUE(Put(1, 16, "team").ok());
  ASSERT_TRUE(Put(1, 16, "other").ok());
  auto first = Pin(1, 16, 60000, "team");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->pinned_pages(), 4);
  auto again = Pin(1, 16, 60000, "team");  // the same 4 pages: 8 > 6
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(again.status().message(),
            "tenant 'team' (cache_salt) has 4 pages pinned by its prefix pins and this pin needs "
            "4 more; its quota max_pinned_prefix_pages is 6; unpin prefixes (UnpinPrefix) or let "
            "their ttl run out first");
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 4);
  auto shorter = Pin(1, 8, 60000, "team");  // 2 pages: 6, the quota exactly
  ASSERT_TRUE(shorter.ok()) << shorter.status();
  EXPECT_EQ(shorter->pinned_pages(), 2);
  auto theirs = Pin(1, 16, 60000, "other");
  ASSERT_TRUE(theirs.ok()) << theirs.status();

  v1::StatsResponse s = Stats();
  std::map<std::string, v1::TenantUsage> by_name;
  for (const auto& t : s.tenants()) by_name[t.tenant()] = t;
  EXPECT_EQ(by_name["team"].pinned_prefix_pages(), 6u);
  EXPECT_EQ(by_name["team"].max_pinned_prefix_pages(), 6u);
  EXPECT_EQ(by_name["other"].pinned_prefix_pages(), 4u);
  EXPECT_EQ(by_name["other"].max_pinned_prefix_pages(), 0u);
  ASSERT_EQ(s.pins_size(), 3);
  EXPECT_EQ(s.pins(0).tenant(), "other");  // by tenant
  EXPECT_EQ(s.pins(1).tenant(), "team");
  EXPECT_EQ(s.pins(2).tenant(), "team");

  v1::UnpinPrefixRequest unpin;
  unpin.set_pin_id(first->pin_id());
  v1::UnpinPrefixResponse unpinned;
  ASSERT_TRUE(engine_->UnpinPrefix(unpin, &unpinned).ok());
  EXPECT_TRUE(Pin(1, 16, 60000, "team").ok());  // 2 + 4 = 6 again
}

TEST_F(PrefixPinsTest, TtlOutsideItsRangeOrOverflowingIsInvalid) {
  ASSERT_TRUE(Put(1, 8).ok());
  for (int64_t ttl : {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min(),
                      int64_t{86400001}, std::numeric_limits<int64_t>::max()}) {
    auto r = Pin(1, 8, ttl);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << ttl;
    EXPECT_EQ(r.status().message(), absl::StrCat("ttl_ms is ", ttl,
                                                 ", expected 1..86400000 (the daemon's "
                                                 "max_pin_ttl_ms)"));
  }
  EXPECT_TRUE(Pin(1, 8, 86400000).ok());
  // A daemon that allows any ttl still refuses one that overflows when added to now.
  ServerConfig config = TestConfig();
  config.max_pin_ttl_ms = std::numeric_limits<int64_t>::max();
  Start(config);
  ASSERT_TRUE(Put(1, 8).ok());
  for (int64_t ttl : {std::numeric_limits<int64_t>::max(), int64_t{1} << 62}) {
    auto r = Pin(1, 8, ttl);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << ttl;
    EXPECT_NE(r.status().message().find(
                  absl::StrCat("ttl_ms is ", ttl, ": now + ttl_ms overflows a 64-bit clock")),
              std::string::npos)
        << r.status();
  }
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pinned_pages, 0);
  EXPECT_EQ(Stats().pins_size(), 0);
}

TEST_F(PrefixPinsTest, NothingCachedOrUnknownModelIsNotFound) {
  auto r = Pin(1, 8, 1000);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(),
            "model 'tiny', cache_salt '': not one page (4 tokens) of the 8 tokens is cached, so "
            "there is nothing to pin; Put the prefix first");
  ASSERT_TRUE(Put(1, 8).ok());
  EXPECT_EQ(Pin(1, 3, 1000).status().code(), absl::StatusCode::kNotFound);  // < one page
  EXPECT_EQ(Pin(1, 8, 1000, "another-salt").status().code(), absl::StatusCode::kNotFound);
  v1::PinPrefixRequest req = PinRequest(1, 8, 1000);
  req.set_model("nope");
  v1::PinPrefixResponse resp;
  EXPECT_EQ(engine_->PinPrefix(req, &resp).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Stats().pins_size(), 0);
}

}  // namespace prefix_pins_test
}  // namespace kvcd
