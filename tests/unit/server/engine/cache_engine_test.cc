// CacheEngine: sequences and windows, attention against the float64 oracle, eviction,
// leases, tenants' quotas, INT2 histories, and the table of bad requests (exact code, cache
// unchanged afterwards). Registration: model_registration_test.cc; pages moved whole:
// page_transfer_test.cc.
#include "server/engine/cache_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/codec_profile.h"
#include "common/key_transform_profile.h"
#include "common/safetensors.h"
#include "engine_test_util.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/reference_attention.h"
#include "server/engine/model_profile.h"
#include "test_util.h"

namespace kvcd {
namespace cache_engine_test {

using engine_test::CacheEngineTest;
using testing_util::MakeAppend;
using testing_util::MakePut;
using testing_util::Profile;
using testing_util::TestConfig;
using testing_util::TinySpec;

// A scratch response for calls whose answer the test does not read.
template <class T>
T* Out() {
  static thread_local T t;
  t.Clear();
  return &t;
}

using kernels::RoundBf16;

TEST_F(CacheEngineTest, PutMatchOpenShareThePrefix) {
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 18), &put).ok());
  EXPECT_EQ(put.cached_tokens(), 0);
  EXPECT_EQ(put.inserted_tokens(), 16);  // 4 full pages of 4
  EXPECT_EQ(put.ignored_tokens(), 2);
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 1, 18), &put).ok());  // idempotent
  EXPECT_EQ(put.cached_tokens(), 16);
  EXPECT_EQ(put.inserted_tokens(), 0);

  v1::MatchRequest mreq;
  mreq.set_model(spec_.name);
  const auto t = synthetic::Tokens(1, 0, 30);
  mreq.mutable_tokens()->Add(t.begin(), t.end());
  v1::MatchResponse m;
  ASSERT_TRUE(engine_->Match(mreq, &m).ok());
  EXPECT_EQ(m.matched_tokens(), 16);
  EXPECT_EQ(m.matched_pages(), 4);

  int64_t matched = 0;
  const uint64_t seq = Open(1, 30, &matched);
  EXPECT_EQ(matched, 16);
  v1::AppendResponse ar;
  ASSERT_TRUE(engine_->Append(MakeAppend(spec_, seq, 1, 16, 14), &ar).ok());
  EXPECT_EQ(ar.length(), 30);

  // The fetched history equals what was put and appended (BF16-rounded synthetic K/V).
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  f.set_expand_to_bf16(true);
  v1::FetchPagesResponse fr;
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  ASSERT_EQ(fr.num_tokens(), 30);
  const auto expect_k = synthetic::Kv(1, Profile(spec_), 0, 30, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(expect_k.size()); ++i) {
    ASSERT_EQ(ElementAsFloat(fr.k(), i), RoundBf16(expect_k[i])) << i;
  }
  v1::StatsResponse st;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.active_sequences(), 1u);
  EXPECT_EQ(st.hit_tokens(), 16u + 16u);  // second Put + Open
}

// Sessions (docs/sessions.md): a turn's sequence is committed on close, the next turn
// opens on it and matches every committed page; a fork attends exactly as its source
// (AttentionDecode, every layer) until each appends its own tokens.
TEST_F(CacheEngineTest, CommittedTurnsAreReusedAndForksAttendAsTheirSource) {
  const auto p = Profile(spec_);
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 3, 8), &put).ok());  // the system prompt
  int64_t matched = 0;
  const uint64_t turn1 = Open(3, 8, &matched);
  EXPECT_EQ(matched, 8);
  // The answer and a tool result: 11 tokens after the prompt (19: 4 full pages + 3).
  ASSERT_TRUE(engine_->Append(MakeAppend(spec_, turn1, 3, 8, 11), Out<v1::AppendResponse>()).ok());
  v1::CloseSequenceRequest close;
  close.set_sequence_id(turn1);
  close.set_commit(true);
  v1::CloseSequenceResponse closed;
  ASSERT_TRUE(engine_->CloseSequence(close, &closed).ok());
  EXPECT_EQ(closed.length(), 19);
  EXPECT_EQ(closed.commit().committed_tokens(), 16);
  EXPECT_EQ(closed.commit().inserted_pages(), 2);
  EXPECT_EQ(closed.commit().deduplicated_pages(), 0);
  EXPECT_EQ(engine_->CloseSequence(close, Out<v1::CloseSequenceResponse>()).code(),
            absl::StatusCode::kNotFound);
  // Turn 2: turn 1's tokens and a new message.
  v1::MatchRequest mreq;
  mreq.set_model(spec_.name);
  const auto t = synthetic::Tokens(3, 0, 25);
  mreq.mutable_tokens()->Add(t.begin(), t.end());
  v1::MatchResponse m;
  ASSERT_TRUE(engine_->Match(mreq, &m).ok());
  EXPECT_EQ(m.matched_tokens(), 16);
  EXPECT_EQ(m.committed_tokens(), 8);
  const uint64_t turn2 = Open(3, 25, &matched);
  EXPECT_EQ(matched, 16);
  v1::StatsResponse st;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.committed_pages(), 2u);
  EXPECT_EQ(st.hit_tokens_committed(), 8u);
  EXPECT_EQ(st.hit_tokens_put(), st.hit_tokens() - 8u);
  ASSERT_TRUE(engine_->Append(MakeAppend(spec_, turn2, 3, 16, 5), Out<v1::AppendResponse>()).ok());

  // Fork turn 2 (21 tokens: a partial page) and attend both with the same q.
  v1::ForkSequenceRequest freq;
  freq.set_sequence_id(turn2);
  v1::ForkSequenceResponse fork;
  ASSERT_TRUE(engine_->ForkSequence(freq, &fork).ok());
  EXPECT_NE(fork.sequence_id(), turn2);
  EXPECT_EQ(fork.length(), 21);
  EXPECT_EQ(fork.shared_pages(), 5);
  EXPECT_EQ(fork.lease_ms(), engine_->leases().default_ms);
  auto decode = [&](uint64_t id, int32_t layer, float qv, std::vector<float> token_kv = {}) {
    v1::AttentionDecodeRequest r;
    r.set_layer(layer);
    r.add_sequence_ids(id);
    std::vector<float> q(p.num_q_heads() * p.head_dim());
    for (size_t i = 0; i < q.size(); ++i) q[i] = qv * static_cast<float>(i % 7) - 1.0f;
    SetF32Tensor(r.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    if (!token_kv.empty()) {
      SetBf16FromFloat(r.mutable_k_new(), {1, 2, 16}, token_kv.data());
      SetBf16FromFloat(r.mutable_v_new(), {1, 2, 16}, token_kv.data());
      r.add_new_tokens(42);
    }
    v1::AttentionDecodeResponse resp;
    EXPECT_TRUE(engine_->AttentionDecode(r, &resp).ok());
    return resp.o().inline_data() + resp.lse().inline_data();
  };
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    EXPECT_EQ(decode(turn2, l, 0.3f + l), decode(fork.sequence_id(), l, 0.3f + l)) << l;
  }
  // Each appends a different token (fused, layer by layer): they diverge, and neither
  // sees the other's token.
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    decode(turn2, l, 0.1f, std::vector<float>(32, 0.5f));
    decode(fork.sequence_id(), l, 0.1f, std::vector<float>(32, -2.0f));
  }
  v1::FetchPagesRequest f;
  f.set_sequence_id(fork.sequence_id());
  f.set_first_token(20);
  f.set_expand_to_bf16(true);
  v1::FetchPagesResponse fr;
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  ASSERT_EQ(fr.num_tokens(), 2);
  const int64_t layer1_token21 = (1 * 2 + 1) * 2 * 16;  // [layer][token][kv head][d]
  EXPECT_EQ(ElementAsFloat(fr.k(), layer1_token21), -2.0f);
  f.set_sequence_id(turn2);
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  EXPECT_EQ(ElementAsFloat(fr.k(), layer1_token21), 0.5f);
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    EXPECT_NE(decode(turn2, l, 0.7f), decode(fork.sequence_id(), l, 0.7f)) << l;
  }
  // Commit keeps the sequence open; the fork commits onto the same pages.
  v1::CommitSequenceRequest creq;
  creq.set_sequence_id(fork.sequence_id());
  v1::CommitSequenceResponse cr;
  ASSERT_TRUE(engine_->CommitSequence(creq, &cr).ok());
  EXPECT_EQ(cr.committed_tokens(), 20);
  EXPECT_EQ(cr.inserted_pages(), 1);
  EXPECT_EQ(cr.deduplicated_pages(), 0);
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.forks(), 1u);
  EXPECT_EQ(st.committed_pages(), 3u);
  EXPECT_EQ(st.active_sequences(), 2u);
}

TEST_F(CacheEngineTest, ChunkedPutNeedsTheCachedPrefix) {
  // Upload a 16-token prompt as [0, 8) then [8, 16) with kv_first_token.
  v1::PutRequest first = MakePut(spec_, 6, 8);
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(first, &put).ok());
  v1::PutRequest whole = MakePut(spec_, 6, 16);
  v1::PutRequest second = whole;
  second.set_kv_first_token(8);
  const auto p = Profile(spec_);
  const std::vector<int64_t> shape = {2, 8, 2, 16};
  SetBf16FromFloat(second.mutable_k(), shape, synthetic::Kv(6, p, 8, 8, 0).data());
  SetBf16FromFloat(second.mutable_v(), shape, synthetic::Kv(6, p, 8, 8, 1).data());
  ASSERT_TRUE(engine_->Put(second, &put).ok());
  EXPECT_EQ(put.cached_tokens(), 8);
  EXPECT_EQ(put.inserted_tokens(), 8);
  // The chunked prompt fetches exactly like one put in one piece.
  int64_t matched = 0;
  const uint64_t seq = Open(6, 16, &matched);
  ASSERT_EQ(matched, 16);
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  f.set_expand_to_bf16(true);
  v1::FetchPagesResponse fr;
  ASSERT_TRUE(engine_->FetchPages(f, &fr).ok());
  const auto k = synthetic::Kv(6, p, 0, 16, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(k.size()); ++i) {
    ASSERT_EQ(ElementAsFloat(fr.k(), i), RoundBf16(k[i])) << i;
  }
  // A chunk whose prefix is not cached is refused and stores nothing.
  v1::PutRequest orphan = MakePut(spec_, 77, 16);
  orphan.set_kv_first_token(8);
  SetBf16FromFloat(orphan.mutable_k(), shape, synthetic::Kv(77, p, 8, 8, 0).data());
  SetBf16FromFloat(orphan.mutable_v(), shape, synthetic::Kv(77, p, 8, 8, 1).data());
  const auto used_before = engine_->SnapshotModels()[0].snapshot.pools[0].pages_used;
  EXPECT_EQ(engine_->Put(orphan, &put).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine_->SnapshotModels()[0].snapshot.pools[0].pages_used, used_before);
}

// Decode attention through the engine (sink | history | recent pages, split-K,
// fused per-layer appends) against a float64 computation over everything sent.
TEST_F(CacheEngineTest, AttentionMatchesFloat64ReferenceThroughTheDecodeLoop) {
  const auto p = Profile(spec_);
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 5, 21), Out<v1::PutResponse>()).ok());
  int64_t matched = 0;
  const uint64_t seq = Open(5, 23, &matched);
  ASSERT_EQ(matched, 20);
  ASSERT_TRUE(engine_->Append(MakeAppend(spec_, seq, 5, 20, 3), Out<v1::AppendResponse>()).ok());
  const int hq = p.num_q_heads(), hkv = p.num_kv_heads(), d = p.head_dim();
  double worst = 0;
  for (int64_t pos = 23; pos < 23 + 9; ++pos) {  // crosses page boundaries
    for (int32_t layer = 0; layer < p.num_layers(); ++layer) {
      v1::AttentionDecodeRequest req;
      req.set_layer(layer);
      req.add_sequence_ids(seq);
      const auto q = synthetic::Row(5, p, layer, pos, 2);
      SetF32Tensor(req.mutable_q(), {1, hq, d}, q.data());
      SetBf16FromFloat(req.mutable_k_new(), {1, hkv, d},
                       synthetic::Row(5, p, layer, pos, 0).data());
      SetBf16FromFloat(req.mutable_v_new(), {1, hkv, d},
                       synthetic::Row(5, p, layer, pos, 1).data());
      req.add_new_tokens(synthetic::Token(5, pos));
      v1::AttentionDecodeResponse resp;
      ASSERT_TRUE(engine_->AttentionDecode(req, &resp).ok());
      ASSERT_EQ(resp.lengths(0), pos + 1);
      // Reference over all pos+1 tokens of this layer.
      const int64_t n = pos + 1;
      std::vector<float> k(n * hkv * d), v(n * hkv * d);
      for (int64_t t = 0; t < n; ++t)
        for (int h = 0; h < hkv; ++h)
          for (int c = 0; c < d; ++c) {
            k[(t * hkv + h) * d + c] = RoundBf16(synthetic::Value(5, layer, t, h, c, 0));
            v[(t * hkv + h) * d + c] = RoundBf16(synthetic::Value(5, layer, t, h, c, 1));
          }
      std::vector<double> ro(hq * d), rl(hq);
      kernels::ReferenceAttention(q.data(), k.data(), v.data(), n, hq, hkv, d,
                                  1.0 / std::sqrt(double(d)), ro.data(), rl.data());
      for (int i = 0; i < hq * d; ++i) {
        worst = std::max(worst, std::fabs(ElementAsFloat(resp.o(), i) - ro[i]));
      }
      for (int h = 0; h < hq; ++h) EXPECT_NEAR(ElementAsFloat(resp.lse(), h), rl[h], 1e-4);
    }
  }
  EXPECT_LT(worst, 1e-5);
  v1::CloseSequenceRequest c;
  c.set_sequence_id(seq);
  v1::CloseSequenceResponse cr;
  ASSERT_TRUE(engine_->CloseSequence(c, &cr).ok());
  EXPECT_EQ(cr.length(), 32);
}

TEST_F(CacheEngineTest, PerLayerTokenMustReachEveryLayerBeforeTheNext) {
  const auto p = Profile(spec_);
  const uint64_t seq = Open(9, 0);
  auto req_for = [&](int32_t layer, int64_t pos) {
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(seq);
    SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()},
                 synthetic::Row(9, p, layer, pos, 2).data());
    SetBf16FromFloat(req.mutable_k_new(), {1, p.num_kv_heads(), p.head_dim()},
                     synthetic::Row(9, p, layer, pos, 0).data());
    SetBf16FromFloat(req.mutable_v_new(), {1, p.num_kv_heads(), p.head_dim()},
                     synthetic::Row(9, p, layer, pos, 1).data());
    req.add_new_tokens(7);
    return req;
  };
  v1::AttentionDecodeResponse resp;
  ASSERT_TRUE(engine_->AttentionDecode(req_for(0, 0), &resp).ok());
  // A second token at layer 0 before layer 1 got the first one.
  EXPECT_EQ(engine_->AttentionDecode(req_for(0, 1), &resp).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine_->Append(MakeAppend(spec_, seq, 9, 0, 1), Out<v1::AppendResponse>()).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine_->AttentionDecode(req_for(1, 0), &resp).ok());
  ASSERT_TRUE(engine_->AttentionDecode(req_for(0, 1), &resp).ok());
  EXPECT_EQ(resp.lengths(0), 2);
}

TEST_F(CacheEngineTest, EvictionFreesLruPrefixesButNeverPinnedOnes) {
  // A model of 8 pages; prefixes of 2 pages each.
  ModelSpec small = TinySpec();
  small.name = "small";
  const int64_t page_bytes = 2LL * 2 * 2 * 4 * 16 * 2;  // layers*K,V*heads*tokens*dim*bf16
  small.memory_bytes = 8 * page_bytes;
  ASSERT_TRUE(engine_->RegisterModelSpec(small).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(small, 100, 8), &put).ok());
  spec_ = small;
  const uint64_t pinned = Open(100, 8);  // pins prefix 100
  for (uint64_t seed = 101; seed < 110; ++seed) {
    ASSERT_TRUE(engine_->Put(MakePut(small, seed, 8), &put).ok()) << seed;
    EXPECT_EQ(put.inserted_tokens(), 8);
  }
  v1::StatsResponse st;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &st).ok());
  EXPECT_GT(st.evicted_pages(), 0u);
  v1::MatchRequest m;
  m.set_model("small");
  auto t = synthetic::Tokens(100, 0, 8);
  m.mutable_tokens()->Add(t.begin(), t.end());
  v1::MatchResponse mr;
  ASSERT_TRUE(engine_->Match(m, &mr).ok());
  EXPECT_EQ(mr.matched_tokens(), 8);  // pinned prefix survived
  m.clear_tokens();
  t = synthetic::Tokens(101, 0, 8);
  m.mutable_tokens()->Add(t.begin(), t.end());
  ASSERT_TRUE(engine_->Match(m, &mr).ok());
  EXPECT_EQ(mr.matched_tokens(), 0);  // oldest unpinned prefix was evicted
  (void)pinned;
}

TEST_F(CacheEngineTest, FullPoolWithNothingEvictableIsResourceExhausted) {
  ModelSpec small = TinySpec();
  small.name = "small";
  small.memory_bytes = 2 * (2LL * 2 * 2 * 4 * 16 * 2);  // 2 pages
  ASSERT_TRUE(engine_->RegisterModelSpec(small).ok());
  spec_ = small;
  const uint64_t seq = Open(1, 0);
  v1::AppendResponse ar;
  ASSERT_TRUE(engine_->Append(MakeAppend(small, seq, 1, 0, 8), &ar).ok());
  const std::string before = Fingerprint(seq);
  EXPECT_EQ(engine_->Append(MakeAppend(small, seq, 1, 8, 1), &ar).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->Put(MakePut(small, 3, 4), Out<v1::PutResponse>()).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Fingerprint(seq), before);
}

TEST_F(CacheEngineTest, ExpiredLeasesReleasePins) {
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 2, 8), &put).ok());
  v1::OpenSequenceRequest req;
  req.set_model(spec_.name);
  const auto t = synthetic::Tokens(2, 0, 8);
  req.mutable_tokens()->Add(t.begin(), t.end());
  req.set_lease_ms(50);
  v1::OpenSequenceResponse open;
  ASSERT_TRUE(engine_->OpenSequence(req, &open).ok());
  auto pinned = [&] { return engine_->SnapshotModels()[0].snapshot.pinned_pages; };
  EXPECT_EQ(pinned(), 2);
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  EXPECT_EQ(engine_->ExpireLeases(now), 0);               // still valid
  EXPECT_EQ(engine_->ExpireLeases(now + 60'000'000), 1);  // 60 ms later: expired
  EXPECT_EQ(pinned(), 0);
  v1::RenewLeaseRequest renew;
  renew.set_sequence_id(open.sequence_id());
  EXPECT_EQ(engine_->RenewLease(renew, Out<v1::RenewLeaseResponse>()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->counters().expired_leases.load(), 1u);
}

// Issue #21.4: a request that cannot fit even after evicting everything evictable fails
// before evicting anything; one that fits evicts as before.
TEST_F(CacheEngineTest, ImpossibleAppendEvictsNothing) {
  ModelSpec eight = TinySpec(8 * 1024);  // 8 pages
  eight.name = "eight";
  ASSERT_TRUE(engine_->RegisterModelSpec(eight).ok());
  spec_ = eight;
  v1::PutResponse put;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    ASSERT_TRUE(engine_->Put(MakePut(eight, seed, 8), &put).ok());  // 6 cached pages, unpinned
  }
  auto match = [&](uint64_t seed) {
    v1::MatchRequest r;
    r.set_model(eight.name);
    const auto t = synthetic::Tokens(seed, 0, 8);
    r.mutable_tokens()->Add(t.begin(), t.end());
    v1::MatchResponse resp;
    EXPECT_TRUE(engine_->Match(r, &resp).ok());
    return resp.matched_tokens();
  };
  const uint64_t seq = Open(9, 0);
  const uint64_t evicted = engine_->counters().evicted_pages.load();
  const absl::Status s =
      engine_->Append(MakeAppend(eight, seq, 9, 0, 40), Out<v1::AppendResponse>());  // 10 pages
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("nothing was evicted"), absl::string_view::npos) << s;
  EXPECT_EQ(engine_->counters().evicted_pages.load(), evicted);
  for (uint64_t seed = 1; seed <= 3; ++seed) EXPECT_EQ(match(seed), 8) << seed;
  // 3 pages: 2 free + LRU eviction of one cached prefix.
  ASSERT_TRUE(engine_->Append(MakeAppend(eight, seq, 9, 0, 12), Out<v1::AppendResponse>()).ok());
  EXPECT_GT(engine_->counters().evicted_pages.load(), evicted);
  EXPECT_EQ(match(1), 0);  // the least recently used prefix went
  EXPECT_EQ(match(3), 8);
}

// Issue #21.10: with every other page pinned, the watermark eviction at the end of a Put
// must not take the pages the Put reports as inserted.
TEST_F(CacheEngineTest, PutKeepsTheTokensItReports) {
  ModelSpec four = TinySpec(4 * 1024);  // 4 pages
  four.name = "four";
  ASSERT_TRUE(engine_->RegisterModelSpec(four).ok());
  spec_ = four;
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(four, 1, 12), &put).ok());
  int64_t matched = 0;
  const uint64_t seq = Open(1, 12, &matched);  // pins all 3 cached pages
  ASSERT_EQ(matched, 12);
  // The fourth page fills the pool past the high watermark (0.95); the only unpinned
  // page is the one this Put just wrote.
  ASSERT_TRUE(engine_->Put(MakePut(four, 2, 4), &put).ok());
  EXPECT_EQ(put.inserted_tokens(), 4);
  v1::MatchRequest m;
  m.set_model(four.name);
  const auto t = synthetic::Tokens(2, 0, 4);
  m.mutable_tokens()->Add(t.begin(), t.end());
  v1::MatchResponse mr;
  ASSERT_TRUE(engine_->Match(m, &mr).ok());
  EXPECT_EQ(mr.matched_tokens(), 4);
  // With the pool full and every other page pinned, the next Put evicts the unpinned
  // prefix (LRU) and keeps its own.
  ASSERT_TRUE(engine_->Put(MakePut(four, 3, 4), &put).ok());
  EXPECT_EQ(put.inserted_tokens(), 4);
  const auto t3 = synthetic::Tokens(3, 0, 4);
  m.mutable_tokens()->Clear();
  m.mutable_tokens()->Add(t3.begin(), t3.end());
  ASSERT_TRUE(engine_->Match(m, &mr).ok());
  EXPECT_EQ(mr.matched_tokens(), 4);
  v1::CloseSequenceRequest close;
  close.set_sequence_id(seq);
  EXPECT_TRUE(engine_->CloseSequence(close, Out<v1::CloseSequenceResponse>()).ok());
}

// Fair sharing: per-tenant quotas on open sequences, pages held and lease length keep a
// greedy tenant from taking every slot; each refusal is RESOURCE_EXHAUSTED naming the
// quota and changes nothing; Stats reports use against quota.
TEST(TenantQuotaTest, AGreedyTenantCannotStarveAnother) {
  ServerConfig config = TestConfig();
  config.max_sequences = 4;
  config.quotas.defaults = {/*max_sequences=*/3, /*max_pinned_pages=*/6, /*max_lease_ms=*/1000};
  config.quotas.tenants["vip"] = {/*max_sequences=*/1, /*max_pinned_pages=*/0, 0};
  CacheEngine engine(config, MakeCpuBackend(1));
  const ModelSpec spec = TinySpec();
  ASSERT_TRUE(engine.RegisterModelSpec(spec).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine.Put(MakePut(spec, 1, 8, "greedy"), &put).ok());
  auto open = [&](const std::string& tenant, int64_t n, int64_t lease_ms,
                  v1::OpenSequenceResponse* resp) {
    v1::OpenSequenceRequest r;
    r.set_model(spec.name);
    r.set_cache_salt(tenant);
    const auto t = synthetic::Tokens(1, 0, n);
    r.mutable_tokens()->Add(t.begin(), t.end());
    r.set_lease_ms(lease_ms);
    return engine.OpenSequence(r, resp);
  };
  // The greedy tenant asks for long leases and as many sequences as it can get.
  std::vector<uint64_t> greedy;
  v1::OpenSequenceResponse resp;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(open("greedy", 0, 600000, &resp).ok()) << i;
    EXPECT_EQ(resp.lease_ms(), 1000);  // capped by max_lease_ms
    greedy.push_back(resp.sequence_id());
  }
  absl::Status s = open("greedy", 0, 0, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_sequences is 3"), absl::string_view::npos) << s;
  // Another tenant still gets the fourth slot.
  ASSERT_TRUE(open("polite", 0, 0, &resp).ok());
  const uint64_t polite = resp.sequence_id();
  // The global bound still holds for everyone (vip's own quota would allow one).
  EXPECT_EQ(open("vip", 0, 0, &resp).code(), absl::StatusCode::kResourceExhausted);

  // Pages: greedy's first sequence may hold 6 pages (24 tokens); the append that would
  // make it 7 is refused and stores nothing.
  v1::AppendResponse ar;
  ASSERT_TRUE(engine.Append(MakeAppend(spec, greedy[0], 1, 0, 24), &ar).ok());
  s = engine.Append(MakeAppend(spec, greedy[0], 1, 24, 1), &ar);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_pinned_pages is 6"), absl::string_view::npos) << s;
  EXPECT_EQ(engine.Append(MakeAppend(spec, greedy[1], 1, 0, 1), &ar).code(),
            absl::StatusCode::kResourceExhausted);  // the quota is the tenant's, not per sequence
  // The polite tenant is not affected by greedy's pages.
  ASSERT_TRUE(engine.Append(MakeAppend(spec, polite, 2, 0, 24), &ar).ok());
  EXPECT_EQ(ar.length(), 24);
  // A matched prefix counts too: pinning greedy's cached 8 tokens (2 pages) is refused.
  v1::CloseSequenceRequest close;
  close.set_sequence_id(greedy[2]);
  v1::CloseSequenceResponse closed;
  ASSERT_TRUE(engine.CloseSequence(close, &closed).ok());
  s = open("greedy", 8, 0, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_pinned_pages"), absl::string_view::npos) << s;

  v1::StatsResponse stats;
  ASSERT_TRUE(engine.Stats(v1::StatsRequest(), &stats).ok());
  std::map<std::string, v1::TenantUsage> by_name;
  for (const auto& t : stats.tenants()) by_name[t.tenant()] = t;
  ASSERT_EQ(by_name.count("greedy"), 1u);
  EXPECT_EQ(by_name["greedy"].open_sequences(), 2u);
  EXPECT_EQ(by_name["greedy"].pinned_pages(), 6u);
  EXPECT_EQ(by_name["greedy"].max_sequences(), 3u);
  EXPECT_EQ(by_name["polite"].open_sequences(), 1u);
  EXPECT_EQ(by_name["polite"].pinned_pages(), 6u);
  EXPECT_EQ(by_name["vip"].open_sequences(), 0u);  // configured: listed even when idle
  EXPECT_EQ(by_name["vip"].max_sequences(), 1u);
  // Closing releases the tenant's share.
  close.set_sequence_id(greedy[0]);
  ASSERT_TRUE(engine.CloseSequence(close, &closed).ok());
  EXPECT_EQ(closed.length(), 24);
  ASSERT_TRUE(engine.Append(MakeAppend(spec, greedy[1], 1, 0, 24), &ar).ok());
}

// Memory shares through the engine: Stats reports each tenant's pages and share; a greedy
// tenant's Puts past its share evict its own prompts while the other tenant's prefix still
// opens whole.
TEST(TenantQuotaTest, MemoryShareKeepsAnotherTenantsPrefix) {
  ServerConfig config = TestConfig();
  TenantQuota greedy;
  greedy.max_memory_share = 0.25;  // 4 of 16 pages
  config.quotas.tenants["greedy"] = greedy;
  CacheEngine engine(config, MakeCpuBackend(1));
  const ModelSpec spec = TinySpec(16 * 1024);
  ASSERT_TRUE(engine.RegisterModelSpec(spec).ok());
  v1::PutResponse put;
  ASSERT_TRUE(engine.Put(MakePut(spec, 1, 24, "polite"), &put).ok());  // 6 pages
  for (uint64_t seed = 10; seed < 20; ++seed) {
    ASSERT_TRUE(engine.Put(MakePut(spec, seed, 8, "greedy"), &put).ok()) << seed;
    EXPECT_EQ(put.inserted_tokens(), 8);
  }
  EXPECT_EQ(engine.counters().evicted_pages.load(), 16u);  // 8 of greedy's 2-page prompts
  v1::StatsResponse stats;
  ASSERT_TRUE(engine.Stats(v1::StatsRequest(), &stats).ok());
  std::map<std::string, v1::TenantUsage> by_name;
  for (const auto& t : stats.tenants()) by_name[t.tenant()] = t;
  EXPECT_EQ(by_name["greedy"].held_pages(), 4u);
  EXPECT_DOUBLE_EQ(by_name["greedy"].max_memory_share(), 0.25);
  EXPECT_EQ(by_name["polite"].held_pages(), 6u);
  EXPECT_DOUBLE_EQ(by_name["polite"].max_memory_share(), 1.0);
  v1::OpenSequenceRequest open;
  open.set_model(spec.name);
  open.set_cache_salt("polite");
  const auto t = synthetic::Tokens(1, 0, 24);
  open.mutable_tokens()->Add(t.begin(), t.end());
  v1::OpenSequenceResponse opened;
  ASSERT_TRUE(engine.OpenSequence(open, &opened).ok());
  EXPECT_EQ(opened.matched_tokens(), 24);
}

// Every bad request gets its exact code, and nothing stored changes.
TEST_F(CacheEngineTest, BadRequestsAreRejectedAndChangeNothing) {
  const auto p = Profile(spec_);
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(spec_, 4, 12), &put).ok());
  const uint64_t seq = Open(4, 14);
  ASSERT_TRUE(engine_->Append(MakeAppend(spec_, seq, 4, 12, 2), Out<v1::AppendResponse>()).ok());
  // A sequence in the middle of a fused per-layer step: its next token is at layer 0 only.
  const uint64_t pending = Open(4, 14);
  {
    v1::AttentionDecodeRequest r;
    r.set_layer(0);
    r.add_sequence_ids(pending);
    std::vector<float> q(p.num_q_heads() * p.head_dim(), 0.5f), kv(2 * 16, 0.25f);
    SetF32Tensor(r.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    SetBf16FromFloat(r.mutable_k_new(), {1, 2, 16}, kv.data());
    SetBf16FromFloat(r.mutable_v_new(), {1, 2, 16}, kv.data());
    r.add_new_tokens(7);
    ASSERT_TRUE(engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>()).ok());
  }
  const std::string before = Fingerprint(seq);

  auto good_decode = [&] {
    v1::AttentionDecodeRequest r;
    r.set_layer(0);
    r.add_sequence_ids(seq);
    std::vector<float> q(p.num_q_heads() * p.head_dim(), 0.5f);
    SetF32Tensor(r.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    return r;
  };
  // One inline page for tokens 500.. of the tiny model (pages of 1024 bytes).
  auto push = [&](int tokens, int64_t first_page, const std::string& format,
                  const std::string& data) {
    v1::PushPagesRequest r;
    r.set_model(spec_.name);
    for (int i = 0; i < tokens; ++i) r.add_tokens(500 + i);
    r.set_first_page(first_page);
    auto* pg = r.add_inline_pages();
    pg->set_format(format);
    pg->set_data(data);
    return engine_->PushPages(r, Out<v1::PushPagesResponse>());
  };
  struct BadCase {
    const char* name;
    absl::StatusCode code;
    std::function<absl::Status()> call;
    const char* says = nullptr;  // the message must contain this, when set
  };
  // BF16 bit patterns of the non-finite values, written over element i of a tensor.
  auto poison_bf16 = [](v1::TensorRef* t, int64_t i, uint16_t bits) {
    (*t->mutable_inline_data())[2 * i] = static_cast<char>(bits & 0xff);
    (*t->mutable_inline_data())[2 * i + 1] = static_cast<char>(bits >> 8);
  };
  constexpr uint16_t kBf16Nan = 0x7fc0, kBf16Inf = 0x7f80, kBf16NegInf = 0xff80;
  auto fused_decode = [&] {
    auto r = good_decode();
    std::vector<float> kv(2 * 16, 0.25f);
    SetBf16FromFloat(r.mutable_k_new(), {1, 2, 16}, kv.data());
    SetBf16FromFloat(r.mutable_v_new(), {1, 2, 16}, kv.data());
    r.add_new_tokens(7);
    return r;
  };
  auto pin = [&](const std::string& model, int64_t n, int64_t ttl_ms, uint64_t seed = 4) {
    v1::PinPrefixRequest r;
    r.set_model(model);
    const auto t = synthetic::Tokens(seed, 0, n);
    r.mutable_tokens()->Add(t.begin(), t.end());
    r.set_ttl_ms(ttl_ms);
    return engine_->PinPrefix(r, Out<v1::PinPrefixResponse>());
  };
  std::vector<BadCase> cases = {
      {"put: unknown model", absl::StatusCode::kNotFound,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_model("nope");
         return engine_->Put(r, &put);
       }},
      {"put: no tokens", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.clear_tokens();
         return engine_->Put(r, &put);
       }},
      {"put: negative token", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_tokens(3, -1);
         return engine_->Put(r, &put);
       }},
      {"put: k shape", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_k()->set_shape(1, 7);
         return engine_->Put(r, &put);
       }},
      {"put: k bytes", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_k()->mutable_inline_data()->pop_back();
         return engine_->Put(r, &put);
       }},
      {"put: k dtype", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_k()->set_dtype(v1::DTYPE_U8);
         return engine_->Put(r, &put);
       }},
      {"put: k/v dtype mismatch", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         std::vector<float> v(2 * 8 * 2 * 16, 1.0f);
         SetF32Tensor(r.mutable_v(), {2, 8, 2, 16}, v.data());
         return engine_->Put(r, &put);
       }},
      {"put: overflowing shape", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_k()->set_shape(1, int64_t{1} << 62);
         return engine_->Put(r, &put);
       }},
      {"put: missing payload", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_v()->clear_inline_data();
         return engine_->Put(r, &put);
       }},
      {"put: cuda ipc payload of the wrong size", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.mutable_k()->mutable_cuda_ipc()->set_size(4);
         return engine_->Put(r, &put);
       }},
      {"put: cuda ipc payload on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         const uint64_t bytes = r.k().inline_data().size();
         r.mutable_k()->mutable_cuda_ipc()->set_size(bytes);
         return engine_->Put(r, &put);
       }},
      {"put: residuals for a model that is not fsq", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         std::vector<float> x(2 * 8 * 4, 0.5f);
         SetF32Tensor(r.mutable_x(), {2, 8, 4}, x.data());
         return engine_->Put(r, &put);
       }},
      {"append: residuals for a model that is not fsq", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakeAppend(spec_, seq, 4, 14, 1);
         std::vector<float> x(2 * 4, 0.5f);
         SetF32Tensor(r.mutable_x(), {2, 1, 4}, x.data());
         return engine_->Append(r, Out<v1::AppendResponse>());
       }},
      {"decode: x_new without k_new", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         std::vector<float> x(4, 0.5f);
         SetF32Tensor(r.mutable_x_new(), {1, 4}, x.data());
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: o_out inline", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         std::vector<float> o(p.num_q_heads() * p.head_dim());
         SetF32Tensor(r.mutable_o_out(), {1, p.num_q_heads(), p.head_dim()}, o.data());
         std::vector<float> l(p.num_q_heads());
         SetF32Tensor(r.mutable_lse_out(), {1, p.num_q_heads()}, l.data());
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: o_out without lse_out", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         SetIpcTensor(r.mutable_o_out(), v1::DTYPE_F32, {1, p.num_q_heads(), p.head_dim()}, 7, 0);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: o_out on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         auto r = good_decode();
         SetIpcTensor(r.mutable_o_out(), v1::DTYPE_F32, {1, p.num_q_heads(), p.head_dim()}, 7, 0);
         SetIpcTensor(r.mutable_lse_out(), v1::DTYPE_F32, {1, p.num_q_heads()}, 7, 4096);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"fetch: destination with expand_to_bf16", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         r.set_expand_to_bf16(true);
         SetIpcTensor(r.mutable_destination(), v1::DTYPE_U8, {1024}, 7, 0);
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       }},
      {"fetch: destination on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         SetIpcTensor(r.mutable_destination(), v1::DTYPE_U8, {1024}, 7, 0);
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       }},
      {"register buffer on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::RegisterBufferRequest r;
         r.set_ipc_handle(std::string(64, 'x'));
         r.set_size(4096);
         return engine_->RegisterBuffer(r, Out<v1::RegisterBufferResponse>());
       }},
      {"unregister an unknown buffer", absl::StatusCode::kNotFound,
       [&] {
         v1::UnregisterBufferRequest r;
         r.set_buffer_id(12345);
         return engine_->UnregisterBuffer(r, Out<v1::UnregisterBufferResponse>());
       }},
      {"renew an unknown buffer", absl::StatusCode::kNotFound,
       [&] {
         v1::RenewBufferRequest r;
         r.set_buffer_id(12345);
         return engine_->RenewBuffer(r, Out<v1::RenewBufferResponse>());
       }},
      {"nccl connect on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         return engine_->NcclConnect(v1::NcclConnectRequest(), Out<v1::NcclConnectResponse>());
       }},
      {"nccl disconnect of an unknown communicator", absl::StatusCode::kNotFound,
       [&] {
         v1::NcclDisconnectRequest r;
         r.set_communicator_id(9);
         return engine_->NcclDisconnect(r, Out<v1::NcclDisconnectResponse>());
       }},
      {"put: kv_first_token not page-aligned", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_kv_first_token(3);
         return engine_->Put(r, &put);
       }},
      {"put: kv_first_token past the end", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_kv_first_token(12);
         return engine_->Put(r, &put);
       }},
      {"put: salt too long", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_cache_salt(std::string(300, 'x'));
         return engine_->Put(r, &put);
       }},
      {"open: bad lease", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::OpenSequenceRequest r;
         r.set_model(spec_.name);
         r.set_lease_ms(-5);
         return engine_->OpenSequence(r, Out<v1::OpenSequenceResponse>());
       }},
      {"append: unknown sequence", absl::StatusCode::kNotFound,
       [&] {
         return engine_->Append(MakeAppend(spec_, 999, 4, 14, 1), Out<v1::AppendResponse>());
       }},
      {"append: wrong token count", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakeAppend(spec_, seq, 4, 14, 2);
         r.add_tokens(1);
         return engine_->Append(r, Out<v1::AppendResponse>());
       }},
      {"decode: layer out of range", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.set_layer(2);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: negative layer", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.set_layer(-1);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: empty batch", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.clear_sequence_ids();
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: duplicate ids", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.add_sequence_ids(seq);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: unknown sequence", absl::StatusCode::kNotFound,
       [&] {
         auto r = good_decode();
         r.set_sequence_ids(0, 4242);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: q shape", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.mutable_q()->set_shape(1, 3);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: NaN scale", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.set_softmax_scale(std::nanf(""));
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      // Issue #35.8: a scale whose FP32 scores overflow (3e38 answered lse = +Inf).
      {"decode: softmax_scale 3e38", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.set_softmax_scale(3e38f);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       },
       "softmax_scale is 3e+38, expected 0 (= 1/sqrt(head_dim)) or a value in (0, 64]"},
      {"decode: negative softmax_scale", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.set_softmax_scale(-0.5f);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       },
       "softmax_scale is -0.5"},
      {"decode: k_new without v_new", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         std::vector<float> k(2 * 16, 1.0f);
         SetF32Tensor(r.mutable_k_new(), {1, 2, 16}, k.data());
         r.add_new_tokens(1);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"decode: new_tokens without k_new", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         r.add_new_tokens(1);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       }},
      {"fetch: unaligned first", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         r.set_first_token(1);
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       }},
      {"fetch: past the end", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         r.set_num_tokens(100);
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       }},
      {"close: unknown", absl::StatusCode::kNotFound,
       [&] {
         v1::CloseSequenceRequest r;
         r.set_sequence_id(777);
         return engine_->CloseSequence(r, Out<v1::CloseSequenceResponse>());
       }},
      // Sessions (issue #31): commit, fork, close with commit.
      {"commit: unknown sequence", absl::StatusCode::kNotFound,
       [&] {
         v1::CommitSequenceRequest r;
         r.set_sequence_id(777);
         return engine_->CommitSequence(r, Out<v1::CommitSequenceResponse>());
       }},
      {"fork: unknown sequence", absl::StatusCode::kNotFound,
       [&] {
         v1::ForkSequenceRequest r;
         r.set_sequence_id(777);
         return engine_->ForkSequence(r, Out<v1::ForkSequenceResponse>());
       }},
      {"close with commit: unknown sequence", absl::StatusCode::kNotFound,
       [&] {
         v1::CloseSequenceRequest r;
         r.set_sequence_id(777);
         r.set_commit(true);
         return engine_->CloseSequence(r, Out<v1::CloseSequenceResponse>());
       }},
      {"commit: a token pending at layer 1", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::CommitSequenceRequest r;
         r.set_sequence_id(pending);
         return engine_->CommitSequence(r, Out<v1::CommitSequenceResponse>());
       },
       "not yet appended at layer 1"},
      {"close with commit: a token pending at layer 1", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::CloseSequenceRequest r;
         r.set_sequence_id(pending);
         r.set_commit(true);
         return engine_->CloseSequence(r, Out<v1::CloseSequenceResponse>());
       },
       "not yet appended at layer 1"},
      {"fork: a token pending at layer 1", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::ForkSequenceRequest r;
         r.set_sequence_id(pending);
         return engine_->ForkSequence(r, Out<v1::ForkSequenceResponse>());
       },
       "not yet appended at layer 1"},
      {"fork: negative lease", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::ForkSequenceRequest r;
         r.set_sequence_id(seq);
         r.set_lease_ms(-5);
         return engine_->ForkSequence(r, Out<v1::ForkSequenceResponse>());
       },
       "lease_ms is -5"},
      {"fork: overflowing lease", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::ForkSequenceRequest r;
         r.set_sequence_id(seq);
         r.set_lease_ms(std::numeric_limits<int64_t>::max());
         return engine_->ForkSequence(r, Out<v1::ForkSequenceResponse>());
       },
       "lease_ms is 9223372036854775807"},
      {"register: bad geometry", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("other");
         r.mutable_profile()->set_num_q_heads(3);
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       }},
      {"push pages over NCCL on the cpu backend", absl::StatusCode::kFailedPrecondition,
       [&] {
         v1::PushPagesRequest r;
         r.set_model(spec_.name);
         for (int i = 0; i < 4; ++i) r.add_tokens(1 + i);
         r.set_num_pages(1);
         r.mutable_pages()->set_dtype(v1::DTYPE_U8);
         r.mutable_pages()->add_shape(1024);
         r.mutable_pages()->mutable_nccl()->set_size(1024);
         return engine_->PushPages(r, Out<v1::PushPagesResponse>());
       }},
      {"push pages: pages and inline_pages", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::PushPagesRequest r;
         r.set_model(spec_.name);
         for (int i = 0; i < 4; ++i) r.add_tokens(1 + i);
         r.set_num_pages(1);
         r.add_inline_pages()->set_format("bf16");
         r.mutable_pages()->mutable_nccl()->set_size(1024);
         return engine_->PushPages(r, Out<v1::PushPagesResponse>());
       }},
      {"push pages: wrong page size", absl::StatusCode::kInvalidArgument,
       [&] { return push(4, 0, "bf16", std::string(100, '\0')); }},
      {"push pages: wrong format", absl::StatusCode::kInvalidArgument,
       [&] { return push(4, 0, "int2-oscar", std::string(1024, '\0')); }},
      {"push pages: non-finite value", absl::StatusCode::kInvalidArgument,
       [&] {
         std::string data(1024, '\0');
         data[11] = static_cast<char>(0x7f);  // bytes 10..11 = 0x7f80: BF16 +inf
         data[10] = static_cast<char>(0x80);
         return push(4, 0, "bf16", data);
       }},
      {"push pages: more pages than tokens", absl::StatusCode::kInvalidArgument,
       [&] { return push(1, 0, "bf16", std::string(1024, '\0')); }},
      {"push pages: first_page overflows", absl::StatusCode::kInvalidArgument,
       [&] {
         return push(4, std::numeric_limits<int64_t>::max(), "bf16", std::string(1024, '\0'));
       }},
      {"push pages: negative first_page", absl::StatusCode::kInvalidArgument,
       [&] { return push(4, -1, "bf16", std::string(1024, '\0')); }},
      {"push pages: prefix not cached", absl::StatusCode::kFailedPrecondition,
       [&] { return push(8, 1, "bf16", std::string(1024, '\0')); }},
      // Issue #21.3: non-finite K/V and queries, on every inline path.
      // A new prefix (seed 14): its pages are written, and the check runs as they are.
      {"put: NaN in k (bf16)", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 14, 8);
         poison_bf16(r.mutable_k(), 37, kBf16Nan);
         return engine_->Put(r, &put);
       },
       "k[37]"},
      {"put: +Inf in v (f32)", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakePut(spec_, 9, 8);
         std::vector<float> kv(2 * 8 * 2 * 16, 0.5f);
         SetF32Tensor(r.mutable_k(), {2, 8, 2, 16}, kv.data());
         kv[500] = std::numeric_limits<float>::infinity();
         SetF32Tensor(r.mutable_v(), {2, 8, 2, 16}, kv.data());
         return engine_->Put(r, &put);
       },
       "v[500]"},
      {"append: -Inf in k", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = MakeAppend(spec_, seq, 4, 14, 2);
         poison_bf16(r.mutable_k(), 3, kBf16NegInf);
         return engine_->Append(r, Out<v1::AppendResponse>());
       },
       "-Inf"},
      {"decode: NaN query", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = good_decode();
         std::vector<float> q(4 * 16, 0.5f);
         q[5] = std::nanf("");
         SetF32Tensor(r.mutable_q(), {1, 4, 16}, q.data());
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       },
       "q[5]"},
      {"decode: Inf in fused k_new", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = fused_decode();
         poison_bf16(r.mutable_k_new(), 20, kBf16Inf);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       },
       "k_new[20]"},
      {"decode: NaN in fused v_new", absl::StatusCode::kInvalidArgument,
       [&] {
         auto r = fused_decode();
         poison_bf16(r.mutable_v_new(), 0, kBf16Nan);
         return engine_->AttentionDecode(r, Out<v1::AttentionDecodeResponse>());
       },
       "v_new[0]"},
      // Issue #21.11: no signed overflow on num_tokens = INT64_MAX (UBSan-clean).
      {"fetch: num_tokens INT64_MAX", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         r.set_first_token(4);
         r.set_num_tokens(std::numeric_limits<int64_t>::max());
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       },
       "past the sequence length"},
      {"fetch: num_tokens INT64_MAX, stored pages", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::FetchPagesRequest r;
         r.set_sequence_id(seq);
         r.set_num_tokens(std::numeric_limits<int64_t>::max());
         r.set_expand_to_bf16(false);
         return engine_->FetchPages(r, Out<v1::FetchPagesResponse>());
       }},
      // Issue #21.8: an FSQ profile without its widths and codec, and an undefined format,
      // are refused by name.
      {"register: FSQ history without widths or codec", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("fsq");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_FSQ);
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "fsq"},
      {"register: undefined history format", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("undefined");
         r.mutable_profile()->set_history_format(static_cast<v1::HistoryFormat>(99));
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "history_format is 99"},
      // Issue #22: a version-3 codec file (transform-coded keys) for another head_dim.
      {"register: version-3 codec of another head_dim", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("transform");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         const int d = 2 * p.head_dim();
         r.set_codec_blob(
             KeyTransformProfile::ToSafetensors(
                 KeyTransformProfile::SyntheticHeads(p.num_layers(), p.num_kv_heads(), d, 1),
                 p.num_layers(), p.num_kv_heads(), d, "test")
                 .Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "layers.0.k_encode must be F32"},
      // Prefix pins (docs/sessions.md "Pinned prefixes"): the prefix of seed 4 is cached.
      {"pin: unknown model", absl::StatusCode::kNotFound, [&] { return pin("nope", 8, 1000); },
       "model 'nope' is not registered"},
      {"pin: ttl_ms 0", absl::StatusCode::kInvalidArgument, [&] { return pin("tiny", 8, 0); },
       "ttl_ms is 0, expected 1..86400000 (the daemon's max_pin_ttl_ms)"},
      {"pin: negative ttl_ms", absl::StatusCode::kInvalidArgument,
       [&] { return pin("tiny", 8, -5); }, "ttl_ms is -5, expected 1..86400000"},
      {"pin: ttl_ms above max_pin_ttl_ms", absl::StatusCode::kInvalidArgument,
       [&] { return pin("tiny", 8, 86400001); }, "ttl_ms is 86400001, expected 1..86400000"},
      {"pin: ttl_ms INT64_MAX", absl::StatusCode::kInvalidArgument,
       [&] { return pin("tiny", 8, std::numeric_limits<int64_t>::max()); }, "ttl_ms is"},
      {"pin: no tokens", absl::StatusCode::kInvalidArgument, [&] { return pin("tiny", 0, 1000); }},
      {"pin: nothing cached", absl::StatusCode::kNotFound, [&] { return pin("tiny", 8, 1000, 77); },
       "nothing to pin"},
      {"unpin: no such pin", absl::StatusCode::kNotFound,
       [&] {
         v1::UnpinPrefixRequest r;
         r.set_pin_id(12345);
         return engine_->UnpinPrefix(r, Out<v1::UnpinPrefixResponse>());
       },
       "pin 12345 is not live"},
      // Issue #35.1: a codec file whose rotations are NaN (version 1) or whose value rotation
      // is (version 3) is refused by tensor; std::max had dropped the NaN.
      {"register: NaN rotation in a version-1 codec file", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("nan-v1");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         SafetensorsWriter w;
         const std::vector<float> nan(p.head_dim() * p.head_dim(), std::nanf(""));
         for (int l = 0; l < p.num_layers(); ++l) {
           w.AddF32(absl::StrCat("layers.", l, ".r_k"), {p.head_dim(), p.head_dim()}, nan);
           w.AddF32(absl::StrCat("layers.", l, ".r_v"), {p.head_dim(), p.head_dim()}, nan);
         }
         r.set_codec_blob(w.Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "layers.0.r_k element 0 is nan"},
      {"register: NaN value rotation in a version-3 codec file", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("nan-v3");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         auto heads =
             KeyTransformProfile::SyntheticHeads(p.num_layers(), p.num_kv_heads(), p.head_dim(), 1);
         heads.back().r_v.assign(heads.back().r_v.size(), std::nanf(""));
         r.set_codec_blob(KeyTransformProfile::ToSafetensors(heads, p.num_layers(),
                                                             p.num_kv_heads(), p.head_dim(), "t")
                              .Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "layers.1.r_v element 256 is nan"},
      // Issue #35.5: strings from a codec file (its version, a tensor's name or dtype) are
      // quoted in 64 bytes: the message fits gRPC's metadata (INVALID_ARGUMENT, not
      // RESOURCE_EXHAUSTED "metadata size exceeds limit").
      {"register: codec file with a 10 KB version string", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("long-version");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         SafetensorsWriter w = CodecProfile::Hadamard(p.num_layers(), p.head_dim()).ToSafetensors();
         w.SetMetadata("kvcd.codec_version", std::string(10240, 'v'));
         r.set_codec_blob(w.Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "...' (10240 bytes)"},
      {"register: codec file with a 10 KB tensor name and dtype",
       absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("long-tensor");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         SafetensorsWriter w = CodecProfile::Hadamard(p.num_layers(), p.head_dim()).ToSafetensors();
         const uint8_t b[4] = {};
         w.Add(std::string(10240, 't'), std::string(10240, 'D'), {1}, b, 4);
         r.set_codec_blob(w.Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "...' (10240 bytes)"},
      // Issue #35.8: undefined enum values, a non-finite theta, a sink past the bound, and a
      // codec named twice are refused by field.
      {"register: undefined key_norm", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("key-norm");
         r.mutable_profile()->set_key_norm(static_cast<v1::KeyNorm>(7));
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "profile.key_norm is 7, not a known KeyNorm"},
      {"register: undefined rope.pairing", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("pairing");
         r.mutable_profile()->mutable_rope()->set_pairing(static_cast<v1::RopePairing>(-3));
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "profile.rope.pairing is -3, not a known RopePairing"},
      {"register: rope.theta +Inf", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("theta");
         r.mutable_profile()->mutable_rope()->set_theta(INFINITY);
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "rope.theta is inf, expected a finite value > 0"},
      {"register: rope.scaling NaN", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("scaling");
         r.mutable_profile()->mutable_rope()->set_scaling(std::nan(""));
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "rope.scaling is nan"},
      {"register: sink of 2^31 - 4 tokens", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("sink");
         r.mutable_profile()->set_sink_tokens(std::numeric_limits<int32_t>::max() - 3);
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "in 0..1048576"},
      {"register: codec and codec_blob", absl::StatusCode::kInvalidArgument,
       [&] {
         v1::RegisterModelRequest r;
         *r.mutable_profile() = p;
         r.mutable_profile()->set_name("two-codecs");
         r.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
         r.mutable_profile()->set_codec("identity");
         r.set_codec_blob(
             CodecProfile::Hadamard(p.num_layers(), p.head_dim()).ToSafetensors().Serialize());
         return engine_->RegisterModel(r, Out<v1::RegisterModelResponse>());
       },
       "set either profile.codec or codec_blob, not both"},
      // Issue #21.9: a 10 KB model name is quoted in 64 bytes, not echoed.
      {"put: 10 KB model name", absl::StatusCode::kNotFound,
       [&] {
         auto r = MakePut(spec_, 4, 8);
         r.set_model(std::string(10240, 'm'));
         return engine_->Put(r, &put);
       },
       "...' (10240 bytes)"},
  };
  for (const auto& c : cases) {
    const absl::Status s = c.call();
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s;
    EXPECT_FALSE(s.message().empty()) << c.name;
    EXPECT_LE(s.message().size(), 600u) << c.name << ": messages quote client strings bounded";
    if (c.says != nullptr) {
      EXPECT_NE(s.message().find(c.says), absl::string_view::npos) << c.name << ": " << s;
    }
    EXPECT_EQ(Fingerprint(seq), before) << c.name;
  }
  // The check is fused into the page writes (CPU backend): rows of a prefix that is
  // already cached are not read, so a NaN there is not an error, and nothing changes.
  {
    auto r = MakePut(spec_, 4, 8);
    (*r.mutable_k()->mutable_inline_data())[2 * 37] = static_cast<char>(0xc0);
    (*r.mutable_k()->mutable_inline_data())[2 * 37 + 1] = static_cast<char>(0x7f);
    ASSERT_TRUE(engine_->Put(r, &put).ok());
    EXPECT_EQ(put.inserted_tokens(), 0);
    EXPECT_EQ(Fingerprint(seq), before);
  }
  // The refused close-with-commit left the pending sequence open; nothing was committed.
  v1::RenewLeaseRequest renew;
  renew.set_sequence_id(pending);
  EXPECT_TRUE(engine_->RenewLease(renew, Out<v1::RenewLeaseResponse>()).ok());
  v1::StatsResponse stats;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.committed_pages(), 0u);
  EXPECT_EQ(stats.forks(), 0u);
  EXPECT_EQ(stats.active_sequences(), 2u);
  // Registrations refused above left no model behind.
  v1::ListModelsResponse models;
  ASSERT_TRUE(engine_->ListModels(v1::ListModelsRequest(), &models).ok());
  EXPECT_EQ(models.models_size(), 1);
}

// A model whose history is OSCAR INT2 (Hadamard rotation): Put demotes every page past
// the sink, Append demotes pages that leave the recent window, and attention over the
// three segments matches a float64 computation on the stored (dequantized) K/V.
TEST(Int2HistoryTest, DemotionAndAttentionOverTheThreeSegments) {
  CacheEngine engine(testing_util::TestConfig(), MakeCpuBackend(2));
  const ModelSpec spec = testing_util::TinyInt2Spec();
  ASSERT_TRUE(engine.RegisterModelSpec(spec).ok());
  const auto p = Profile(spec);
  v1::PutResponse put;
  ASSERT_TRUE(engine.Put(MakePut(spec, 8, 40), &put).ok());
  EXPECT_EQ(put.inserted_tokens(), 40);
  auto model = engine.SnapshotModels()[0].snapshot;
  ASSERT_EQ(model.pools.size(), 2u);
  EXPECT_EQ(model.pools[0].format, "bf16");
  EXPECT_EQ(model.pools[0].pages_used, 1);  // the sink page
  EXPECT_EQ(model.pools[1].format, "int2-oscar");
  EXPECT_EQ(model.pools[1].pages_used, 9);
  EXPECT_EQ(model.history_bits_per_element, 4.0);  // 2 + 32/16 at head_dim 16
  EXPECT_EQ(model.codec, "hadamard");

  v1::OpenSequenceRequest open;
  open.set_model(spec.name);
  const auto t = synthetic::Tokens(8, 0, 40);
  open.mutable_tokens()->Add(t.begin(), t.end());
  v1::OpenSequenceResponse opened;
  ASSERT_TRUE(engine.OpenSequence(open, &opened).ok());
  const uint64_t seq = opened.sequence_id();
  v1::AppendResponse ar;
  ASSERT_TRUE(engine.Append(MakeAppend(spec, seq, 8, 40, 30), &ar).ok());
  ASSERT_EQ(ar.length(), 70);
  // Pages 10..14 hold tokens older than the 8-token recent window: demoted.
  EXPECT_EQ(engine.SnapshotModels()[0].snapshot.demoted_pages, 5u);

  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  v1::FetchPagesResponse stored;
  ASSERT_TRUE(engine.FetchPages(f, &stored).ok());
  ASSERT_EQ(stored.pages_size(), 18);
  EXPECT_EQ(stored.pages(0).format(), "bf16");
  EXPECT_EQ(stored.pages(14).format(), "int2-oscar");
  EXPECT_EQ(stored.pages(15).format(), "bf16");
  EXPECT_EQ(stored.pages(17).num_tokens(), 2);
  EXPECT_EQ(static_cast<int64_t>(stored.pages(3).data().size()),
            kernels::Int2PageBytes(2, 4, 16) * 2);

  f.set_expand_to_bf16(true);
  v1::FetchPagesResponse expanded;
  ASSERT_TRUE(engine.FetchPages(f, &expanded).ok());
  const int hq = 4, hkv = 2, d = 16;
  for (int32_t layer = 0; layer < 2; ++layer) {
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(seq);
    const auto q = synthetic::Row(8, p, layer, 70, 2);
    SetF32Tensor(req.mutable_q(), {1, hq, d}, q.data());
    v1::AttentionDecodeResponse resp;
    ASSERT_TRUE(engine.AttentionDecode(req, &resp).ok());
    // float64 attention over what the daemon holds (expanded, un-rotated) ...
    std::vector<float> k(70 * hkv * d), v(70 * hkv * d), k0(k.size()), v0(v.size());
    for (int64_t i = 0; i < 70 * hkv * d; ++i) {
      k[i] = ElementAsFloat(expanded.k(), layer * 70 * hkv * d + i);
      v[i] = ElementAsFloat(expanded.v(), layer * 70 * hkv * d + i);
    }
    // ... and over the exact K/V that were sent.
    for (int64_t tt = 0; tt < 70; ++tt)
      for (int h = 0; h < hkv; ++h)
        for (int c = 0; c < d; ++c) {
          k0[(tt * hkv + h) * d + c] = synthetic::Value(8, layer, tt, h, c, 0);
          v0[(tt * hkv + h) * d + c] = synthetic::Value(8, layer, tt, h, c, 1);
        }
    std::vector<double> ro(hq * d), rl(hq), eo(hq * d), el(hq);
    kernels::ReferenceAttention(q.data(), k.data(), v.data(), 70, hq, hkv, d, 0.25, ro.data(),
                                rl.data());
    kernels::ReferenceAttention(q.data(), k0.data(), v0.data(), 70, hq, hkv, d, 0.25, eo.data(),
                                el.data());
    double err_stored = 0, err_exact = 0, norm = 0;
    for (int i = 0; i < hq * d; ++i) {
      const double o = ElementAsFloat(resp.o(), i);
      err_stored += (o - ro[i]) * (o - ro[i]);
      err_exact += (o - eo[i]) * (o - eo[i]);
      norm += eo[i] * eo[i];
    }
    // Against the stored values only BF16 rounding of the expansion differs.
    EXPECT_LT(std::sqrt(err_stored / norm), 0.02) << "layer " << layer;
    // Against the exact K/V: the INT2 quantization error of 4 of 5 pages (d = 16).
    EXPECT_LT(std::sqrt(err_exact / norm), 0.5) << "layer " << layer;
    std::printf("layer %d: rel error vs stored %.4f, vs exact %.4f\n", layer,
                std::sqrt(err_stored / norm), std::sqrt(err_exact / norm));
  }
}

// Issue #35.2: K/V of N(0,1)·1e6 (finite, far beyond FP16) into INT2 and int2-transform
// histories, on Put and through the window's later demotion on Append: the fetched values
// are finite and the stored pages push back into another tenant.
TEST(Int2HistoryTest, KvBeyondFp16RangeIsStoredFinite) {
  auto scale_bf16 = [](v1::TensorRef* t, float by) {
    std::string& b = *t->mutable_inline_data();
    for (size_t i = 0; i + 1 < b.size(); i += 2) {
      uint16_t v;
      std::memcpy(&v, b.data() + i, 2);
      v = kernels::FloatToBf16(kernels::Bf16ToFloat(v) * by);
      std::memcpy(b.data() + i, &v, 2);
    }
  };
  auto all_finite = [](const v1::TensorRef& t) {
    const std::string& b = t.inline_data();
    for (size_t i = 0; i + 1 < b.size(); i += 2) {
      uint16_t v;
      std::memcpy(&v, b.data() + i, 2);
      if (!std::isfinite(kernels::Bf16ToFloat(v))) return false;
    }
    return !b.empty();
  };
  for (const bool transform : {false, true}) {
    CacheEngine engine(testing_util::TestConfig(), MakeCpuBackend(2));
    ModelSpec spec = testing_util::TinyInt2Spec();
    v1::RegisterModelRequest reg;
    ProfileFromSpec(spec, reg.mutable_profile());
    if (transform) {
      reg.mutable_profile()->set_codec("");
      reg.set_codec_blob(KeyTransformProfile::ToSafetensors(
                             KeyTransformProfile::SyntheticHeads(spec.num_layers, spec.num_kv_heads,
                                                                 spec.head_dim, 3),
                             spec.num_layers, spec.num_kv_heads, spec.head_dim, "test")
                             .Serialize());
    }
    ASSERT_TRUE(engine.RegisterModel(reg, Out<v1::RegisterModelResponse>()).ok());
    v1::PutRequest put = MakePut(spec, 3, 24);
    scale_bf16(put.mutable_k(), 1e6f);
    scale_bf16(put.mutable_v(), 1e6f);
    ASSERT_TRUE(engine.Put(put, Out<v1::PutResponse>()).ok());
    const auto tokens = synthetic::Tokens(3, 0, 24);
    v1::OpenSequenceRequest o;
    o.set_model(spec.name);
    o.mutable_tokens()->Add(tokens.begin(), tokens.end());
    v1::OpenSequenceResponse seq;
    ASSERT_TRUE(engine.OpenSequence(o, &seq).ok());
    ASSERT_EQ(seq.matched_tokens(), 24);
    // Three pages more: the recent window's rows (in BF16's range, not FP16's) are demoted.
    v1::AppendRequest app = MakeAppend(spec, seq.sequence_id(), 3, 24, 12);
    scale_bf16(app.mutable_k(), 1e6f);
    scale_bf16(app.mutable_v(), 1e6f);
    ASSERT_TRUE(engine.Append(app, Out<v1::AppendResponse>()).ok());
    v1::FetchPagesRequest f;
    f.set_sequence_id(seq.sequence_id());
    f.set_expand_to_bf16(true);
    v1::FetchPagesResponse expanded;
    ASSERT_TRUE(engine.FetchPages(f, &expanded).ok());
    EXPECT_EQ(expanded.num_tokens(), 36);
    EXPECT_TRUE(all_finite(expanded.k())) << "transform " << transform;
    EXPECT_TRUE(all_finite(expanded.v())) << "transform " << transform;
    f.set_expand_to_bf16(false);
    f.set_num_tokens(24);
    v1::FetchPagesResponse stored;
    ASSERT_TRUE(engine.FetchPages(f, &stored).ok());
    v1::PushPagesRequest push;
    push.set_model(spec.name);
    push.set_cache_salt("other");
    push.mutable_tokens()->Add(tokens.begin(), tokens.end());
    for (const auto& page : stored.pages()) *push.add_inline_pages() = page;
    const absl::Status pushed = engine.PushPages(push, Out<v1::PushPagesResponse>());
    EXPECT_TRUE(pushed.ok()) << "transform " << transform << ": " << pushed;
  }
}

}  // namespace cache_engine_test
}  // namespace kvcd
