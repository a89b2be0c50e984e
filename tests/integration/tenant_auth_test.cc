// Integration: tenant authorization through the real kvcd binary on loopback: bearer tokens
// scoped to tenants, every tenant-scoped call refused across tenants, pins, decode channels
// (the token that opened them, a region served once, the tenant's quota), what Stats and
// ListModels show, and the permissions to register models and use the data plane.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/decode_channel.h"
#include "common/decode_channel_layout.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "security_fixture.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace tenant_auth_test {

using security_fixture::Path;
using security_fixture::SecurityTest;
using security_fixture::TokenEntry;
using security_fixture::WriteFile;
using testing_util::DaemonProcess;
using testing_util::WaitFor;

// A daemon with tokens for two tenants and an admin.
class TenantTest : public SecurityTest {
 protected:
  void SetUp() override {
    tokens_ = Path("tenant-tokens.yaml");
    WriteFile(tokens_, "tokens:\n" + TokenEntry("alice", "tok-alice", "[team-a]") +
                           TokenEntry("bob", "tok-bob", "[team-b]") +
                           TokenEntry("admin", "tok-admin", "[\"*\"]", true, true) +
                           TokenEntry("bob-worker", "tok-bob-worker", "[team-b]", false, true) +
                           TokenEntry("alice-worker", "tok-alice-worker", "[team-a]", false, true));
    ASSERT_TRUE(daemon_.Start(Config("auth: {tokens_file: " + tokens_ +
                                     "}\nquotas:\n  tenants:\n"
                                     "    - {tenant: team-b, max_decode_channels: 2}\n")));
    alice_ = Connect("tok-alice");
    bob_ = Connect("tok-bob");
    admin_ = Connect("tok-admin");
    anonymous_ = Connect("");
    bob_worker_ = Connect("tok-bob-worker");
    alice_worker_ = Connect("tok-alice-worker");
    ASSERT_TRUE(alice_ && bob_ && admin_ && anonymous_ && bob_worker_ && alice_worker_);
    auto m = admin_->GetModel("tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    profile_ = m->profile();
  }
  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions o = Options(daemon_);
    o.token = token;
    auto c = Client::Connect(o);
    return c.ok() ? std::move(*c) : nullptr;
  }
  v1::PutRequest MakePut(uint64_t seed, int64_t n, const std::string& salt) const {
    return synthetic::Put(seed, profile_, n, salt);
  }
  v1::AppendRequest MakeAppend(uint64_t seq, uint64_t seed, int64_t begin, int64_t n) const {
    v1::AppendRequest app;
    app.set_sequence_id(seq);
    const auto t = synthetic::Tokens(seed, begin, n);
    app.mutable_tokens()->Add(t.begin(), t.end());
    const std::vector<int64_t> shape = {profile_.num_layers(), n, profile_.num_kv_heads(),
                                        profile_.head_dim()};
    SetBf16FromFloat(app.mutable_k(), shape, synthetic::Kv(seed, profile_, begin, n, 0).data());
    SetBf16FromFloat(app.mutable_v(), shape, synthetic::Kv(seed, profile_, begin, n, 1).data());
    return app;
  }
  v1::AttentionDecodeRequest MakeDecode(uint64_t seq, int64_t pos) const {
    v1::AttentionDecodeRequest req;
    req.set_layer(0);
    req.add_sequence_ids(seq);
    const auto q = synthetic::Row(5, profile_, 0, pos, 2);
    SetF32Tensor(req.mutable_q(), {1, profile_.num_q_heads(), profile_.head_dim()}, q.data());
    return req;
  }

  std::string tokens_;
  DaemonProcess daemon_;
  std::unique_ptr<Client> alice_, bob_, admin_, anonymous_, bob_worker_, alice_worker_;
  v1::ModelProfile profile_;
};

TEST_F(TenantTest, MissingOrUnknownTokensAreUnauthenticated) {
  const auto kUnauth = absl::StatusCode::kUnauthenticated;
  EXPECT_EQ(anonymous_->Stats().status().code(), kUnauth);
  EXPECT_EQ(anonymous_->ListModels().status().code(), kUnauth);
  EXPECT_EQ(anonymous_->Put(MakePut(1, 16, "team-a")).status().code(), kUnauth);
  EXPECT_EQ(anonymous_->OpenSequence("tiny", "team-a", synthetic::Tokens(1, 0, 16)).status().code(),
            kUnauth);
  auto stranger = Connect("tok-nobody");
  ASSERT_NE(stranger, nullptr);
  auto s = stranger->Stats();
  EXPECT_EQ(s.status().code(), kUnauth);
  EXPECT_NE(s.status().message().find("not valid"), std::string::npos) << s.status();
  // A stream without a token ends UNAUTHENTICATED.
  auto stream = anonymous_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ((*stream)->Call(MakeDecode(1, 0)).status().code(), kUnauth);
  // Nothing was stored by the refused Put.
  auto m = alice_->Match("tiny", "team-a", synthetic::Tokens(1, 0, 16));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->matched_tokens(), 0);
}

TEST_F(TenantTest, AnotherTenantIsRefusedOnEveryTenantScopedCall) {
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  const auto kNotFound = absl::StatusCode::kNotFound;
  const std::vector<int32_t> prompt = synthetic::Tokens(3, 0, 16);
  ASSERT_TRUE(alice_->Put(MakePut(3, 16, "team-a")).ok());
  auto open = alice_->OpenSequence("tiny", "team-a", prompt);
  ASSERT_TRUE(open.ok()) << open.status();
  const uint64_t seq = open->sequence_id();
  EXPECT_EQ(open->matched_tokens(), 16);

  // Salt-scoped calls naming alice's tenant with bob's token: PERMISSION_DENIED.
  auto put = bob_->Put(MakePut(4, 16, "team-a"));
  EXPECT_EQ(put.status().code(), kDenied) << put.status();
  EXPECT_NE(put.status().message().find("'team-a'"), std::string::npos) << put.status();
  EXPECT_EQ(bob_->Match("tiny", "team-a", prompt).status().code(), kDenied);
  EXPECT_EQ(bob_->OpenSequence("tiny", "team-a", prompt).status().code(), kDenied);
  v1::PushPagesRequest push;
  push.set_model("tiny");
  push.set_cache_salt("team-a");
  EXPECT_EQ(bob_->PushPages(push).status().code(), kDenied);
  // The default tenant is not implied either.
  EXPECT_EQ(bob_->Match("tiny", "", prompt).status().code(), kDenied);

  // Sequence-scoped calls on alice's sequence with bob's token: NOT_FOUND, exactly as
  // for an id that does not exist; the same requests succeed for alice.
  EXPECT_EQ(bob_->Append(MakeAppend(seq, 3, 16, 1)).status().code(), kNotFound);
  EXPECT_EQ(bob_->AttentionDecode(MakeDecode(seq, 16)).status().code(), kNotFound);
  auto bob_stream = bob_->OpenDecodeStream();
  ASSERT_TRUE(bob_stream.ok());
  EXPECT_EQ((*bob_stream)->Call(MakeDecode(seq, 16)).status().code(), kNotFound);
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(seq);
  auto bob_fetch = bob_->FetchPages(fetch);
  EXPECT_EQ(bob_fetch.status().code(), kNotFound);
  auto bob_missing = bob_->FetchPages([&] {
    v1::FetchPagesRequest r;
    r.set_sequence_id(seq ^ 0x1234567ull);
    return r;
  }());
  EXPECT_EQ(bob_missing.status().code(), kNotFound);
  EXPECT_EQ(bob_->RenewLease(seq).status().code(), kNotFound);
  EXPECT_EQ(bob_->CloseSequence(seq).status().code(), kNotFound);
  EXPECT_EQ(bob_->CloseSequence(seq, /*commit=*/true).status().code(), kNotFound);
  EXPECT_EQ(bob_->CommitSequence(seq).status().code(), kNotFound);
  EXPECT_EQ(bob_->ForkSequence(seq).status().code(), kNotFound);

  // Nothing of alice's changed, and bob's refused Put stored nothing.
  auto len = alice_->Append(MakeAppend(seq, 3, 16, 1));
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 17);
  EXPECT_TRUE(alice_->AttentionDecode(MakeDecode(seq, 17)).ok());
  auto alice_stream = alice_->OpenDecodeStream();
  ASSERT_TRUE(alice_stream.ok());
  EXPECT_TRUE((*alice_stream)->Call(MakeDecode(seq, 17)).ok());
  EXPECT_TRUE(alice_->FetchPages(fetch).ok());
  EXPECT_TRUE(alice_->RenewLease(seq).ok());
  auto m = admin_->Match("tiny", "team-a", synthetic::Tokens(4, 0, 16));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->matched_tokens(), 0);
  auto closed = alice_->CloseSequence(seq);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, 17);
}

// Prefix pins: PinPrefix names its tenant like Match (PERMISSION_DENIED for another's);
// another tenant's pin is NOT_FOUND exactly like a pin that is not live; Stats lists only
// the caller's tenants' pins.
TEST_F(TenantTest, AnotherTenantsPinIsNotFoundAndStatsListsOnlyOwnPins) {
  const std::vector<int32_t> prompt = synthetic::Tokens(7, 0, 16);
  ASSERT_TRUE(alice_->Put(MakePut(7, 16, "team-a")).ok());
  ASSERT_TRUE(bob_->Put(MakePut(7, 16, "team-b")).ok());
  EXPECT_EQ(bob_->PinPrefix("tiny", "team-a", prompt, 60000).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto alice_pin = alice_->PinPrefix("tiny", "team-a", prompt, 60000);
  ASSERT_TRUE(alice_pin.ok()) << alice_pin.status();
  EXPECT_EQ(alice_pin->pinned_pages(), 4);
  auto bob_pin = bob_->PinPrefix("tiny", "team-b", prompt, 60000);
  ASSERT_TRUE(bob_pin.ok()) << bob_pin.status();

  auto theirs = bob_->UnpinPrefix(alice_pin->pin_id());
  auto missing = bob_->UnpinPrefix(alice_pin->pin_id() ^ 0x1234567ull);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(theirs.status().message()),
            absl::StrCat("pin ", alice_pin->pin_id(),
                         " is not live (never pinned, unpinned, or its ttl ran out)"));

  auto pins_of = [](Client& c) {
    auto s = c.Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    std::vector<std::pair<uint64_t, std::string>> out;
    for (const auto& p : s->pins()) out.emplace_back(p.pin_id(), p.tenant());
    return out;
  };
  using Pins = std::vector<std::pair<uint64_t, std::string>>;
  EXPECT_EQ(pins_of(*alice_), (Pins{{alice_pin->pin_id(), "team-a"}}));
  EXPECT_EQ(pins_of(*bob_), (Pins{{bob_pin->pin_id(), "team-b"}}));
  EXPECT_EQ(pins_of(*admin_).size(), 2u);  // tenants: ["*"]

  auto unpinned = alice_->UnpinPrefix(alice_pin->pin_id());  // still alice's, still live
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_EQ(*unpinned, 4);
  EXPECT_TRUE(pins_of(*alice_).empty());
  ASSERT_TRUE(bob_->UnpinPrefix(bob_pin->pin_id()).ok());
}

TEST_F(TenantTest, DecodeChannelsRunWithTheTokenThatOpenedThem) {
  ASSERT_TRUE(alice_->Put(MakePut(6, 16, "team-a")).ok());
  auto open = alice_->OpenSequence("tiny", "team-a", synthetic::Tokens(6, 0, 16));
  ASSERT_TRUE(open.ok()) << open.status();
  const uint64_t seq = open->sequence_id();
  // bob's data-plane token may open a channel, but not decode on alice's sequence.
  auto bob_channel = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 60000);
  ASSERT_TRUE(bob_channel.ok()) << bob_channel.status();
  EXPECT_EQ((*bob_channel)->Call(MakeDecode(seq, 16)).status().code(), absl::StatusCode::kNotFound);
  // The admin's channel (every tenant) may.
  auto admin_channel = DecodeChannel::Open(admin_.get(), 1 << 16, 60000);
  ASSERT_TRUE(admin_channel.ok()) << admin_channel.status();
  EXPECT_TRUE((*admin_channel)->Call(MakeDecode(seq, 16)).ok());
}

// A worker's shared region, written as a worker does (common/decode_channel_layout.h), kept
// under its name so that another tenant can name it too.
struct RawRegion {
  explicit RawRegion(uint32_t cap) : capacity(cap), bytes(DecodeChannelHeader::TotalBytes(cap)) {
    name = "/kvcd-security-" + std::to_string(getpid()) + "-" + std::to_string(++count);
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return;
    h = new (p) DecodeChannelHeader{};
    h->magic = DecodeChannelHeader::kMagic;
    h->version = DecodeChannelHeader::kVersion;
    h->capacity = capacity;
  }
  ~RawRegion() {
    if (h != nullptr) munmap(h, bytes);
    if (fd >= 0) close(fd);
    shm_unlink(name.c_str());
  }
  // One request and its answer (an error answer for an unanswered one).
  v1::AttentionDecodeStreamResponse Call(const v1::AttentionDecodeRequest& req) {
    const std::string msg = req.SerializeAsString();
    std::memcpy(h->RequestArea(), msg.data(), msg.size());
    h->request_bytes.store(static_cast<uint32_t>(msg.size()), std::memory_order_relaxed);
    h->PublishRequest(++seq);
    v1::AttentionDecodeStreamResponse r;
    if (!WaitFor([&] { return h->response_seq.load() == seq; }, std::chrono::seconds(10))) {
      r.set_error_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
      return r;
    }
    r.ParseFromArray(h->ResponseArea(), static_cast<int>(h->response_bytes.load()));
    return r;
  }
  static inline int count = 0;
  std::string name;
  uint32_t capacity;
  size_t bytes;
  int fd = -1;
  DecodeChannelHeader* h = nullptr;
  uint64_t seq = 0;
};

// Issue #35.3: a tenant names the shared-memory object another tenant's channel serves. The
// second open is refused (ALREADY_EXISTS, under any name for the object), nothing is written
// into the victim's region, and the victim's channel keeps answering its own requests.
TEST_F(TenantTest, ASecondChannelOnARegionAlreadyServedIsRefused) {
  ASSERT_TRUE(alice_->Put(MakePut(7, 16, "team-a")).ok());
  auto open = alice_->OpenSequence("tiny", "team-a", synthetic::Tokens(7, 0, 16));
  ASSERT_TRUE(open.ok()) << open.status();
  const uint64_t seq = open->sequence_id();
  RawRegion victim(1 << 16);
  ASSERT_NE(victim.h, nullptr);
  v1::OpenDecodeChannelRequest req;
  req.set_shm_name(victim.name);
  req.set_lease_ms(60000);
  v1::OpenDecodeChannelResponse opened;
  ASSERT_TRUE(alice_worker_->OpenDecodeChannelRpc(req, &opened).ok());
  v1::AttentionDecodeStreamResponse r = victim.Call(MakeDecode(seq, 16));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();

  // bob's worker, then the admin, name the same object: refused, whoever asks.
  v1::OpenDecodeChannelResponse stolen;
  absl::Status s = bob_worker_->OpenDecodeChannelRpc(req, &stolen);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("already served"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("alice"), std::string::npos) << s;  // nothing about the owner
  EXPECT_EQ(admin_->OpenDecodeChannelRpc(req, &stolen).code(), absl::StatusCode::kAlreadyExists);
  // The same object under another name (a hard link in /dev/shm) is the same region.
  const std::string alias = victim.name + "-alias";
  ASSERT_EQ(link(("/dev/shm" + victim.name).c_str(), ("/dev/shm" + alias).c_str()), 0);
  v1::OpenDecodeChannelRequest by_alias = req;
  by_alias.set_shm_name(alias);
  EXPECT_EQ(bob_worker_->OpenDecodeChannelRpc(by_alias, &stolen).code(),
            absl::StatusCode::kAlreadyExists);
  shm_unlink(alias.c_str());

  // Nothing was written into the victim's region; its channel serves its requests.
  EXPECT_EQ(victim.h->closed.load(), 0u);
  for (int i = 0; i < 3; ++i) {
    r = victim.Call(MakeDecode(seq, 16));
    EXPECT_EQ(r.error_code(), 0) << r.error_message();
  }
  // Once the victim closes its channel the object may be served again (by its owner).
  ASSERT_TRUE(alice_worker_->CloseDecodeChannel(opened.channel_id()).ok());
  EXPECT_EQ(victim.h->closed.load(), 1u);
  victim.h->closed.store(0);
  ASSERT_TRUE(alice_worker_->OpenDecodeChannelRpc(req, &opened).ok());
  r = victim.Call(MakeDecode(seq, 16));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
}

// Issue #35.4: one token could take all 64 channel slots. team-b may hold 2 channels: the
// third is refused naming the quota, closing one or a lease running out gives its slot back,
// and another tenant's token is not limited by team-b's quota.
TEST_F(TenantTest, DecodeChannelsCountAgainstTheTenantsQuota) {
  auto first = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 60000);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 60000);
  ASSERT_TRUE(second.ok()) << second.status();
  auto third = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 60000);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(third.status().message().find("max_decode_channels is 2"), std::string::npos)
      << third.status();
  EXPECT_NE(third.status().message().find("'team-b'"), std::string::npos) << third.status();
  auto stats = admin_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  bool listed = false;
  for (const v1::TenantUsage& t : stats->tenants()) {
    if (t.tenant() != "team-b") continue;
    listed = true;
    EXPECT_EQ(t.open_decode_channels(), 2u);
    EXPECT_EQ(t.max_decode_channels(), 2u);
  }
  EXPECT_TRUE(listed);
  // alice's worker is not held back by team-b's channels.
  auto alices = DecodeChannel::Open(alice_worker_.get(), 1 << 16, 60000);
  EXPECT_TRUE(alices.ok()) << alices.status();

  // Closing one gives its slot back.
  ASSERT_TRUE((*first)->Close().ok());
  first->reset();
  auto replaced = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 30);  // a 30 ms lease
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  // A channel that ends on its lease gives its slot back too (the daemon's event: its
  // channel count, as Stats reports it, drops).
  EXPECT_TRUE(WaitFor(
      [&] {
        auto s = admin_->Stats();
        if (!s.ok()) return false;
        for (const v1::TenantUsage& t : s->tenants())
          if (t.tenant() == "team-b") return t.open_decode_channels() == 1;
        return false;
      },
      std::chrono::seconds(10)));
  auto after_lease = DecodeChannel::Open(bob_worker_.get(), 1 << 16, 60000);
  EXPECT_TRUE(after_lease.ok()) << after_lease.status();
}

// Issue #35.7: any token's Stats and ListModels showed every tenant's name and use. A token
// sees its own tenants only, and no daemon-wide activity; a "*" token sees everything.
TEST_F(TenantTest, StatsAndListModelsShowOnlyTheCallersTenants) {
  ASSERT_TRUE(alice_->Put(MakePut(8, 16, "team-a")).ok());
  ASSERT_TRUE(alice_->OpenSequence("tiny", "team-a", synthetic::Tokens(8, 0, 16)).ok());
  ASSERT_TRUE(bob_->OpenSequence("tiny", "team-b", synthetic::Tokens(9, 0, 16)).ok());
  auto names = [](const v1::StatsResponse& s) {
    std::set<std::string> out;
    for (const v1::TenantUsage& t : s.tenants()) out.insert(t.tenant());
    return out;
  };
  auto alice = alice_->Stats();
  ASSERT_TRUE(alice.ok()) << alice.status();
  EXPECT_EQ(names(*alice), std::set<std::string>{"team-a"});
  for (const v1::TenantUsage& t : alice->tenants()) EXPECT_EQ(t.open_sequences(), 1u);
  auto bob = bob_->Stats();
  ASSERT_TRUE(bob.ok()) << bob.status();
  EXPECT_EQ(names(*bob), std::set<std::string>{"team-b"});
  // No daemon-wide activity (it is every tenant's), only the configuration.
  for (const auto* s : {&*alice, &*bob}) {
    EXPECT_EQ(s->active_sequences(), 0u);
    EXPECT_EQ(s->memory_used_bytes(), 0u);
    EXPECT_EQ(s->hit_tokens() + s->miss_tokens(), 0u);
    EXPECT_GT(s->memory_budget_bytes(), 0u);
    ASSERT_EQ(s->models_size(), 1);
    EXPECT_EQ(s->models(0).cached_tokens(), 0u);
    EXPECT_EQ(s->models(0).active_sequences(), 0u);
    for (const v1::PoolInfo& p : s->models(0).pools()) {
      EXPECT_EQ(p.pages_used(), 0u);
      EXPECT_GT(p.pages_total(), 0u);
    }
  }
  auto models = bob_->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 1u);
  EXPECT_EQ((*models)[0].profile().name(), "tiny");
  EXPECT_EQ((*models)[0].cached_tokens(), 0u);
  EXPECT_EQ((*models)[0].active_sequences(), 0u);

  // The admin ("*") sees the whole daemon.
  auto admin = admin_->Stats();
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(names(*admin).count("team-a") && names(*admin).count("team-b"));
  EXPECT_EQ(admin->active_sequences(), 2u);
  EXPECT_GT(admin->models(0).cached_tokens(), 0u);
  auto all_models = admin_->ListModels();
  ASSERT_TRUE(all_models.ok()) << all_models.status();
  EXPECT_GT((*all_models)[0].cached_tokens(), 0u);
  EXPECT_EQ((*all_models)[0].active_sequences(), 2u);
}

TEST_F(TenantTest, ModelRegistrationAndTheDataPlaneNeedTheirPermissions) {
  v1::ModelProfile p = profile_;
  p.set_name("tiny-2");
  auto reg = alice_->RegisterModel(p);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kPermissionDenied) << reg.status();
  EXPECT_NE(reg.status().message().find("register_models"), std::string::npos);
  EXPECT_FALSE(admin_->GetModel("tiny-2").ok());  // nothing registered
  EXPECT_TRUE(admin_->RegisterModel(p).ok());

  v1::RegisterBufferRequest buf;
  buf.set_ipc_handle(std::string(64, '\0'));
  buf.set_size(1 << 20);
  EXPECT_EQ(alice_->RegisterBuffer(buf).status().code(), absl::StatusCode::kPermissionDenied);
  // The admin passes authorization; the CPU backend has no data plane.
  EXPECT_EQ(admin_->RegisterBuffer(buf).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(alice_->NcclConnect("w").status().code(), absl::StatusCode::kPermissionDenied);
  v1::OpenDecodeChannelRequest ch;
  ch.set_shm_name("/kvcd-test-none");
  v1::OpenDecodeChannelResponse ch_resp;
  EXPECT_EQ(alice_->OpenDecodeChannelRpc(ch, &ch_resp).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(admin_->OpenDecodeChannelRpc(ch, &ch_resp).code(), absl::StatusCode::kNotFound);
}

}  // namespace tenant_auth_test
}  // namespace kvcd
