// FaultInjector: the spec grammar, and through a CacheEngine on the CPU backend that each
// injected failure fails its call with the right code (RESOURCE_EXHAUSTED for an
// allocation, INTERNAL for a page copy or an attention launch) and stores nothing, and
// that a sticky fault makes the backend unhealthy and fails every later call.
#include "server/backends/fault_injector.h"

#include <gtest/gtest.h>

#include "proto/tensor_ref.h"
#include "server/engine/cache_engine.h"
#include "test_util.h"

namespace kvcd {
namespace fault_injector_test {

using testing_util::MakeAppend;
using testing_util::MakePut;
using testing_util::Profile;
using testing_util::TestConfig;
using testing_util::TinyInt2Spec;
using testing_util::TinySpec;

TEST(FaultInjectorTest, ParsesSpecs) {
  for (const char* good : {"alloc:3", "copy:2", "attend:1", "sticky:attend:1", "alloc:1,copy:4"}) {
    EXPECT_TRUE(FaultInjector::Parse(good).ok()) << good;
  }
  for (const char* bad : {"", "alloc", "alloc:0", "alloc:-1", "launch:1", "sticky:alloc",
                          "sticky:copy:x", "copy:1:2", "alloc:3,,bogus:1"}) {
    auto r = FaultInjector::Parse(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(FaultInjectorTest, FailsOnlyTheNthCallOfItsKind) {
  auto inj = *FaultInjector::Parse("copy:2,attend:3");
  EXPECT_TRUE(inj->Check(FaultInjector::Kind::kCopy).ok());
  EXPECT_TRUE(inj->Check(FaultInjector::Kind::kAttend).ok());
  EXPECT_TRUE(inj->Check(FaultInjector::Kind::kAlloc).ok());
  EXPECT_EQ(inj->Check(FaultInjector::Kind::kCopy).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(inj->Check(FaultInjector::Kind::kCopy).ok());  // transient: only the 2nd
  EXPECT_TRUE(inj->Check(FaultInjector::Kind::kAttend).ok());
  EXPECT_EQ(inj->Check(FaultInjector::Kind::kAttend).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(inj->healthy());
  EXPECT_EQ(inj->fired(), 2);
}

class FaultInjectionEngineTest : public ::testing::Test {
 protected:
  void Start(const std::string& spec) {
    injector_ = *FaultInjector::Parse(spec);
    engine_ = std::make_unique<CacheEngine>(TestConfig(),
                                            WithFaultInjection(MakeCpuBackend(1), injector_));
  }

  uint64_t Open(uint64_t seed, int64_t n) {
    v1::OpenSequenceRequest req;
    req.set_model(spec_.name);
    const auto t = synthetic::Tokens(seed, 0, n);
    req.mutable_tokens()->Add(t.begin(), t.end());
    v1::OpenSequenceResponse resp;
    EXPECT_TRUE(engine_->OpenSequence(req, &resp).ok());
    return resp.sequence_id();
  }

  // Everything stored that a failed call must not change: models, pool pages in use,
  // cached tokens, open sequences, the prefix `seed` matches, and `seq`'s length.
  std::string Stored(uint64_t seed, uint64_t seq = 0) {
    v1::StatsResponse st;
    EXPECT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
    std::string fp =
        std::to_string(st.memory_used_bytes()) + "/" + std::to_string(st.active_sequences());
    for (const auto& m : st.models()) {
      fp += "|" + m.profile().name() + ":" + std::to_string(m.cached_tokens());
      for (const auto& p : m.pools()) fp += "/" + std::to_string(p.pages_used());
    }
    v1::MatchRequest mreq;
    mreq.set_model(spec_.name);
    const auto t = synthetic::Tokens(seed, 0, 32);
    mreq.mutable_tokens()->Add(t.begin(), t.end());
    v1::MatchResponse m;
    if (engine_->Match(mreq, &m).ok()) fp += "|match " + std::to_string(m.matched_tokens());
    if (seq != 0) {
      v1::RenewLeaseRequest renew;
      renew.set_sequence_id(seq);
      v1::RenewLeaseResponse rr;
      fp += engine_->RenewLease(renew, &rr).ok() ? "|open" : "|gone";
    }
    return fp;
  }

  v1::AttentionDecodeRequest Decode(uint64_t seq, uint64_t seed, bool fused) {
    v1::AttentionDecodeRequest req;
    req.set_layer(0);
    req.add_sequence_ids(seq);
    const auto p = Profile(spec_);
    SetF32Tensor(req.mutable_q(), {1, spec_.num_q_heads, spec_.head_dim},
                 synthetic::Row(seed, p, 0, 0, 2).data());
    if (fused) {
      SetBf16FromFloat(req.mutable_k_new(), {1, spec_.num_kv_heads, spec_.head_dim},
                       synthetic::Row(seed, p, 0, 1, 0).data());
      SetBf16FromFloat(req.mutable_v_new(), {1, spec_.num_kv_heads, spec_.head_dim},
                       synthetic::Row(seed, p, 0, 1, 1).data());
      req.add_new_tokens(7);
    }
    return req;
  }

  int64_t Length(uint64_t seq) {
    v1::FetchPagesRequest f;
    f.set_sequence_id(seq);
    f.set_expand_to_bf16(true);
    v1::FetchPagesResponse fr;
    EXPECT_TRUE(engine_->FetchPages(f, &fr).ok());
    return fr.num_tokens();
  }

  ModelSpec spec_ = TinySpec();
  std::shared_ptr<FaultInjector> injector_;
  std::unique_ptr<CacheEngine> engine_;
};

TEST_F(FaultInjectionEngineTest, FailedAllocationRegistersNothing) {
  Start("alloc:1");
  const std::string before = Stored(1);
  absl::Status s = engine_->RegisterModelSpec(spec_);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(Stored(1), before);
  v1::ListModelsResponse list;
  ASSERT_TRUE(engine_->ListModels(v1::ListModelsRequest(), &list).ok());
  EXPECT_EQ(list.models_size(), 0);
  // The next allocation succeeds: the fault was transient.
  EXPECT_TRUE(engine_->RegisterModelSpec(spec_).ok());
}

TEST_F(FaultInjectionEngineTest, FailedSecondPoolOfAModelFreesTheFirst) {
  Start("alloc:2");  // INT2 history: a BF16 pool, then an INT2 pool
  spec_ = TinyInt2Spec();
  absl::Status s = engine_->RegisterModelSpec(spec_);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  v1::StatsResponse st;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.memory_used_bytes(), 0u);
  EXPECT_EQ(st.models_size(), 0);
  EXPECT_TRUE(engine_->RegisterModelSpec(spec_).ok());
}

TEST_F(FaultInjectionEngineTest, FailedCopyFailsFetchAndStoresNothing) {
  Start("copy:1");
  ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 16), &put).ok());
  const uint64_t seq = Open(1, 16);
  const std::string before = Stored(1, seq);
  // Copy #1: the pages as stored leave the pool through ReadPages.
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  v1::FetchPagesResponse fr;
  absl::Status s = engine_->FetchPages(f, &fr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(Stored(1, seq), before);
  // Transient: the same fetch now succeeds.
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  EXPECT_EQ(fr.num_tokens(), 16);
  EXPECT_EQ(fr.pages_size(), 4);
}

TEST_F(FaultInjectionEngineTest, FailedCopyFailsPushAndStoresNothing) {
  // The pages of a 16-token prompt, fetched from a healthy engine.
  Start("copy:100");
  ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 16), &put).ok());
  v1::FetchPagesRequest f;
  f.set_sequence_id(Open(1, 16));
  v1::FetchPagesResponse fr;
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  ASSERT_EQ(fr.pages_size(), 4);
  v1::PushPagesRequest push;
  push.set_model(spec_.name);
  const auto t = synthetic::Tokens(2, 0, 16);
  push.mutable_tokens()->Add(t.begin(), t.end());
  for (const auto& p : fr.pages()) {
    auto* in = push.add_inline_pages();
    in->set_format(p.format());
    in->set_data(p.data());
  }
  // A fresh engine whose first copy (the push's WritePages) fails.
  Start("copy:1");
  ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  const std::string empty = Stored(2);
  v1::PushPagesResponse pr;
  absl::Status s = engine_->PushPages(push, &pr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(Stored(2), empty);
  EXPECT_NE(empty.find("|match 0"), std::string::npos) << empty;
  // Without the fault the same push stores the 16 tokens.
  ASSERT_TRUE(engine_->PushPages(push, &pr).ok());
  EXPECT_EQ(pr.inserted_tokens(), 16);
  EXPECT_NE(Stored(2).find("|match 16"), std::string::npos) << Stored(2);
}

// (A fused decode, k_new/v_new set, whose attention launch fails keeps the new row and its
// page: ModelCache::Attend writes and counts the token before the launch. Not covered
// here; reported with issue #21.)
TEST_F(FaultInjectionEngineTest, FailedAttentionLaunchFailsDecodeAndStoresNothing) {
  Start("attend:1");
  ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 16), &put).ok());
  const uint64_t seq = Open(1, 16);
  ASSERT_EQ(Length(seq), 16);
  const std::string before = Stored(1, seq);

  v1::AttentionDecodeResponse resp;
  absl::Status s = engine_->AttentionDecode(Decode(seq, 5, /*fused=*/false), &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(Stored(1, seq), before);
  EXPECT_EQ(Length(seq), 16);
  // The fault was transient: the same call now succeeds, and so does a fused one.
  ASSERT_TRUE(engine_->AttentionDecode(Decode(seq, 5, /*fused=*/false), &resp).ok());
  EXPECT_EQ(resp.lengths(0), 16);
  ASSERT_TRUE(engine_->AttentionDecode(Decode(seq, 5, /*fused=*/true), &resp).ok());
  EXPECT_EQ(resp.lengths(0), 17);
  EXPECT_TRUE(engine_->backend_healthy());
}

TEST_F(FaultInjectionEngineTest, StickyFaultMakesTheBackendUnhealthy) {
  Start("sticky:attend:1");
  ASSERT_TRUE(engine_->RegisterModelSpec(spec_).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 16), &put).ok());
  const uint64_t seq = Open(1, 16);
  EXPECT_TRUE(engine_->backend_healthy());
  v1::AttentionDecodeResponse resp;
  absl::Status s = engine_->AttentionDecode(Decode(seq, 5, false), &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_FALSE(engine_->backend_healthy());
  // Every later backend call fails too: attention, page copies, allocations.
  s = engine_->AttentionDecode(Decode(seq, 5, false), &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  v1::FetchPagesResponse fr;
  EXPECT_EQ(engine_->FetchPages(f, &fr).code(), absl::StatusCode::kInternal);
  ModelSpec other = spec_;
  other.name = "other";
  EXPECT_FALSE(engine_->RegisterModelSpec(other).ok());
}

}  // namespace fault_injector_test
}  // namespace kvcd
