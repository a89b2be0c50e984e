// Authorization rules against a real CacheEngine: tenants from the token, sequences
// bound to the tenant they were opened under, permissions for models and the data plane.
#include "server/rpc/authorizer.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "test_util.h"

namespace kvcd {
namespace authorizer_test {

using testing_util::MakePut;
using testing_util::TestConfig;
using testing_util::TinySpec;

Principal Token(const std::string& name, std::set<std::string> tenants, bool reg = false,
                bool dp = false) {
  Principal p;
  p.name = name;
  p.tenants = std::move(tenants);
  p.register_models = reg;
  p.data_plane = dp;
  return p;
}

class AuthorizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_unique<CacheEngine>(TestConfig(), MakeCpuBackend(2));
    ASSERT_TRUE(engine_->RegisterModelSpec(TinySpec()).ok());
    authz_ =
        std::make_unique<Authorizer>([this](uint64_t id) { return engine_->LookupSequence(id); },
                                     [this](uint64_t id) -> absl::StatusOr<std::string> {
                                       absl::StatusOr<PrefixPins::Pin> pin = engine_->LookupPin(id);
                                       if (!pin.ok()) return pin.status();
                                       return pin->tenant;
                                     });
  }
  uint64_t Open(const std::string& salt) {
    v1::OpenSequenceRequest req;
    req.set_model("tiny");
    req.set_cache_salt(salt);
    v1::OpenSequenceResponse resp;
    EXPECT_TRUE(engine_->OpenSequence(req, &resp).ok());
    return resp.sequence_id();
  }
  std::unique_ptr<CacheEngine> engine_;
  std::unique_ptr<Authorizer> authz_;
};

TEST_F(AuthorizerTest, TenantScopedRequestsNeedTheTenantInTheToken) {
  const Principal a = Token("a", {"team-a"});
  v1::PutRequest put = MakePut(TinySpec(), 1, 8, "team-a");
  EXPECT_TRUE(authz_->Check(a, put).ok());
  put.set_cache_salt("team-b");
  absl::Status s = authz_->Check(a, put);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("token 'a' may not use tenant (cache_salt) 'team-b'"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("'team-a'"), std::string::npos) << s;
  put.set_cache_salt("");  // the default tenant is a tenant like any other
  EXPECT_EQ(authz_->Check(a, put).code(), absl::StatusCode::kPermissionDenied);

  v1::MatchRequest match;
  match.set_cache_salt("team-b");
  EXPECT_EQ(authz_->Check(a, match).code(), absl::StatusCode::kPermissionDenied);
  v1::OpenSequenceRequest open;
  open.set_cache_salt("team-b");
  EXPECT_EQ(authz_->Check(a, open).code(), absl::StatusCode::kPermissionDenied);
  v1::PushPagesRequest push;
  push.set_cache_salt("team-b");
  EXPECT_EQ(authz_->Check(a, push).code(), absl::StatusCode::kPermissionDenied);
  open.set_cache_salt("team-a");
  EXPECT_TRUE(authz_->Check(a, open).ok());

  Principal all = Token("ops", {});
  all.all_tenants = true;
  EXPECT_TRUE(authz_->Check(all, match).ok());
}

// PinPrefix names a tenant like Match does; UnpinPrefix of another tenant's pin is answered
// exactly like a pin that is not live.
TEST_F(AuthorizerTest, AnotherTenantsPinLooksExactlyLikeAMissingOne) {
  v1::PutResponse put;
  ASSERT_TRUE(engine_->Put(MakePut(TinySpec(), 1, 8, "team-b"), &put).ok());
  v1::PinPrefixRequest pin;
  pin.set_model("tiny");
  pin.set_cache_salt("team-b");
  const auto t = synthetic::Tokens(1, 0, 8);
  pin.mutable_tokens()->Add(t.begin(), t.end());
  pin.set_ttl_ms(60000);
  const Principal a = Token("a", {"team-a"});
  const Principal b = Token("b", {"team-b"});
  EXPECT_EQ(authz_->Check(a, pin).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(authz_->Check(b, pin).ok());
  v1::PinPrefixResponse pinned;
  ASSERT_TRUE(engine_->PinPrefix(pin, &pinned).ok());

  v1::UnpinPrefixRequest unpin;
  unpin.set_pin_id(pinned.pin_id());
  const absl::Status theirs = authz_->Check(a, unpin);
  unpin.set_pin_id(pinned.pin_id() ^ 1);
  const absl::Status missing = authz_->Check(a, unpin);
  EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(theirs.message(),
            absl::StrCat("pin ", pinned.pin_id(),
                         " is not live (never pinned, unpinned, or its ttl ran out)"));
  EXPECT_EQ(missing.message(), absl::StrCat("pin ", pinned.pin_id() ^ 1,
                                            " is not live (never pinned, unpinned, or its ttl "
                                            "ran out)"));
  unpin.set_pin_id(pinned.pin_id());
  EXPECT_TRUE(authz_->Check(b, unpin).ok());
  EXPECT_TRUE(authz_->Check(*Principal::Unrestricted(), unpin).ok());
}

TEST_F(AuthorizerTest, AnotherTenantsSequenceLooksExactlyLikeAMissingOne) {
  const uint64_t seq_b = Open("team-b");
  const uint64_t seq_a = Open("team-a");
  EXPECT_NE(seq_a, seq_b);
  const Principal a = Token("a", {"team-a"});

  v1::RenewLeaseRequest renew;
  renew.set_sequence_id(seq_a);
  EXPECT_TRUE(authz_->Check(a, renew).ok());
  renew.set_sequence_id(seq_b);
  const absl::Status foreign = authz_->Check(a, renew);
  // An id that was never handed out.
  uint64_t missing_id = seq_b ^ 0x5a5a5a5a5a5a5a5aull;
  renew.set_sequence_id(missing_id);
  const absl::Status missing = authz_->Check(a, renew);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  // Same text apart from the id itself.
  std::string f(foreign.message()), m(missing.message());
  f.replace(f.find(std::to_string(seq_b)), std::to_string(seq_b).size(), "ID");
  m.replace(m.find(std::to_string(missing_id)), std::to_string(missing_id).size(), "ID");
  EXPECT_EQ(f, m);

  v1::CloseSequenceRequest close;
  close.set_sequence_id(seq_b);
  EXPECT_EQ(authz_->Check(a, close).code(), absl::StatusCode::kNotFound);
  close.set_commit(true);
  EXPECT_EQ(authz_->Check(a, close).code(), absl::StatusCode::kNotFound);
  v1::CommitSequenceRequest commit;
  commit.set_sequence_id(seq_b);
  EXPECT_EQ(authz_->Check(a, commit).message(), foreign.message());
  commit.set_sequence_id(seq_a);
  EXPECT_TRUE(authz_->Check(a, commit).ok());
  v1::ForkSequenceRequest fork;
  fork.set_sequence_id(seq_b);
  EXPECT_EQ(authz_->Check(a, fork).message(), foreign.message());
  fork.set_sequence_id(seq_a);
  EXPECT_TRUE(authz_->Check(a, fork).ok());
  v1::AppendRequest append;
  append.set_sequence_id(seq_b);
  EXPECT_EQ(authz_->Check(a, append).code(), absl::StatusCode::kNotFound);
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(seq_b);
  EXPECT_EQ(authz_->Check(a, fetch).code(), absl::StatusCode::kNotFound);
  v1::AttentionDecodeRequest decode;
  decode.add_sequence_ids(seq_a);
  FoundSequences found;
  EXPECT_TRUE(authz_->Check(a, decode, &found).ok());
  // What the check found is handed on to the engine: the sequence itself, once.
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0]->id, seq_a);
  EXPECT_EQ(found[0]->salt, "team-a");
  decode.add_sequence_ids(seq_b);  // one foreign id in a batch refuses the batch
  const absl::Status d = authz_->Check(a, decode);
  EXPECT_EQ(d.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(d.message().find("sequence_ids[1]"), std::string::npos) << d;

  // The refused calls changed nothing: b's sequence is still open.
  EXPECT_EQ(engine_->ActiveSequences(), 2);
  EXPECT_EQ((*engine_->LookupSequence(seq_b))->salt, "team-b");
}

TEST_F(AuthorizerTest, SequenceIdsAreRandomNotSequential) {
  std::set<uint64_t> ids;
  uint64_t prev = 0;
  int consecutive = 0;
  for (int i = 0; i < 64; ++i) {
    const uint64_t id = Open("t");
    ASSERT_NE(id, 0u);
    consecutive += (id == prev + 1);
    prev = id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 64u);
  EXPECT_EQ(consecutive, 0);
  // Random 64-bit ids use the high bits as well.
  int high = 0;
  for (uint64_t id : ids) high += (id >> 48) != 0;
  EXPECT_GT(high, 56);
}

TEST_F(AuthorizerTest, ModelRegistrationAndTheDataPlaneNeedTheirPermissions) {
  const Principal plain = Token("plain", {"t"});
  const Principal admin = Token("admin", {"t"}, /*reg=*/true, /*dp=*/true);
  v1::RegisterModelRequest reg;
  absl::Status s = authz_->Check(plain, reg);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("register_models: true"), std::string::npos) << s;
  // The registration counts against its tenant, which the token must grant.
  s = authz_->Check(admin, reg);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("may not use tenant (cache_salt) ''"), std::string::npos) << s;
  reg.set_tenant("t");
  EXPECT_TRUE(authz_->Check(admin, reg).ok());
  reg.set_tenant("u");
  EXPECT_EQ(authz_->Check(admin, reg).code(), absl::StatusCode::kPermissionDenied);
  reg.set_tenant("t");

  EXPECT_EQ(authz_->Check(plain, v1::RegisterBufferRequest()).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(authz_->Check(plain, v1::NcclConnectRequest()).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(authz_->Check(plain, v1::OpenDecodeChannelRequest()).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(authz_->Check(admin, v1::RegisterBufferRequest()).ok());
  // Anyone authenticated may list models and read stats.
  EXPECT_TRUE(authz_->Check(plain, v1::ListModelsRequest()).ok());
  EXPECT_TRUE(authz_->Check(plain, v1::StatsRequest()).ok());

  // A TensorRef naming a buffer needs data_plane, even on a tenant the token may use.
  v1::PutRequest put = MakePut(TinySpec(), 1, 8, "t");
  put.mutable_k()->mutable_cuda_ipc()->set_buffer_id(77);
  s = authz_->Check(plain, put);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("data_plane: true"), std::string::npos) << s;
}

TEST_F(AuthorizerTest, DataPlaneObjectsBelongToTheTokenThatCreatedThem) {
  const Principal w1 = Token("worker-1", {"t"}, false, true);
  const Principal w2 = Token("worker-2", {"t"}, false, true);
  authz_->Bind(Authorizer::Object::kBuffer, 11, w1);
  authz_->Bind(Authorizer::Object::kCommunicator, 12, w1);
  authz_->Bind(Authorizer::Object::kChannel, 13, w1);

  v1::UnregisterBufferRequest unreg;
  unreg.set_buffer_id(11);
  EXPECT_TRUE(authz_->Check(w1, unreg).ok());
  absl::Status s = authz_->Check(w2, unreg);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "buffer 11 is not registered");
  v1::RenewBufferRequest renew;
  renew.set_buffer_id(11);
  EXPECT_EQ(authz_->Check(w2, renew).code(), absl::StatusCode::kNotFound);
  v1::NcclDisconnectRequest disc;
  disc.set_communicator_id(12);
  EXPECT_EQ(authz_->Check(w2, disc).code(), absl::StatusCode::kNotFound);
  v1::CloseDecodeChannelRequest close;
  close.set_channel_id(13);
  EXPECT_EQ(authz_->Check(w2, close).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(authz_->Check(w1, close).ok());

  // Buffers and communicators named inside requests (nested TensorRefs too).
  v1::AttentionDecodeRequest decode;
  decode.mutable_o_out()->mutable_cuda_ipc()->set_buffer_id(11);
  EXPECT_TRUE(authz_->Check(w1, decode).ok());
  EXPECT_EQ(authz_->Check(w2, decode).code(), absl::StatusCode::kNotFound);
  v1::PushPagesRequest push;
  push.set_cache_salt("t");
  push.mutable_pages()->mutable_nccl()->set_communicator_id(12);
  EXPECT_TRUE(authz_->Check(w1, push).ok());
  EXPECT_EQ(authz_->Check(w2, push).code(), absl::StatusCode::kNotFound);

  authz_->Unbind(Authorizer::Object::kBuffer, 11);
  EXPECT_TRUE(authz_->Check(w2, unreg).ok());  // unknown ids go on to the engine
}

TEST_F(AuthorizerTest, WithoutAuthEverythingIsAllowedAsBefore) {
  const Principal& any = *Principal::Unrestricted();
  const uint64_t seq = Open("whoever");
  v1::PutRequest put = MakePut(TinySpec(), 1, 8, "any-salt");
  EXPECT_TRUE(authz_->Check(any, put).ok());
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(seq);
  EXPECT_TRUE(authz_->Check(any, fetch).ok());
  EXPECT_TRUE(authz_->Check(any, v1::RegisterModelRequest()).ok());
  EXPECT_TRUE(authz_->Check(any, v1::RegisterBufferRequest()).ok());
}

// Issue #35.7: what Stats and ListModels show is scoped to the caller's tenants.
TEST_F(AuthorizerTest, StatsAndListModelsAreScopedToTheCallersTenants) {
  Open("team-a");
  Open("team-b");
  v1::StatsResponse all;
  ASSERT_TRUE(engine_->Stats(v1::StatsRequest(), &all).ok());
  ASSERT_EQ(all.tenants_size(), 2);
  ASSERT_EQ(all.active_sequences(), 2u);
  ASSERT_EQ(all.models(0).active_sequences(), 2u);
  v1::PrefixPin* pin = all.add_pins();
  pin->set_tenant("team-b");

  v1::StatsResponse a = all;
  authz_->Scope(Token("a", {"team-a"}), &a);
  ASSERT_EQ(a.tenants_size(), 1);
  EXPECT_EQ(a.tenants(0).tenant(), "team-a");
  EXPECT_EQ(a.pins_size(), 0);
  EXPECT_EQ(a.active_sequences(), 0u);
  EXPECT_EQ(a.models(0).active_sequences(), 0u);
  EXPECT_EQ(a.models(0).profile().name(), "tiny");
  EXPECT_EQ(a.memory_budget_bytes(), all.memory_budget_bytes());
  EXPECT_EQ(a.models(0).pools(0).pages_total(), all.models(0).pools(0).pages_total());

  Principal star = Token("admin", {});
  star.all_tenants = true;
  for (const Principal& p : {star, *Principal::Unrestricted()}) {
    v1::StatsResponse s = all;
    authz_->Scope(p, &s);
    EXPECT_EQ(s.SerializeAsString(), all.SerializeAsString()) << p.name;
  }

  v1::ListModelsResponse models;
  ASSERT_TRUE(engine_->ListModels(v1::ListModelsRequest(), &models).ok());
  ASSERT_EQ(models.models(0).active_sequences(), 2u);
  authz_->Scope(Token("b", {"team-b"}), &models);
  EXPECT_EQ(models.models(0).active_sequences(), 0u);
  EXPECT_EQ(models.models(0).profile().name(), "tiny");
}

}  // namespace authorizer_test
}  // namespace kvcd
