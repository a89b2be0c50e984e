// Integration: `kvcd serve --fault-inject` on the real binary. A transient attention
// fault fails one AttentionDecode with INTERNAL and the daemon keeps serving; a failed
// allocation at start-up stops the daemon with a message; a sticky device fault turns
// health NOT_SERVING (seen through a Health.Watch stream, no polling) and the daemon
// exits with status 1.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "client/client.h"
#include "daemon_process.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace fault_injection_test {

using testing_util::DaemonProcess;

constexpr char kConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: ""
health_listen: 127.0.0.1:0
memory_budget: 16MiB
drain_timeout_ms: 300
models:
  - builtin: tiny
    memory: 1MiB
)";

class FaultInjectionTest : public ::testing::Test {
 protected:
  bool Start(const std::string& spec) {
    if (!daemon_.CaptureStderr()) return false;
    daemon_.set_extra_args({"--fault-inject", spec});
    if (!daemon_.Start(kConfig)) return false;
    ClientOptions o;
    o.target = daemon_.grpc();
    o.deadline = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    if (!c.ok()) return false;
    client_ = std::move(*c);
    auto m = client_->GetModel("tiny");
    if (!m.ok()) return false;
    profile_ = m->profile();
    return true;
  }
  std::string Stderr() const { return daemon_.Stderr(); }

  // A 16-token sequence (Put, then OpenSequence on it) and a decode request on it.
  uint64_t OpenSequence() {
    v1::PutRequest put;
    put.set_model("tiny");
    const auto t = synthetic::Tokens(1, 0, 16);
    put.mutable_tokens()->Add(t.begin(), t.end());
    const std::vector<int64_t> shape = {profile_.num_layers(), 16, profile_.num_kv_heads(),
                                        profile_.head_dim()};
    SetBf16FromFloat(put.mutable_k(), shape, synthetic::Kv(1, profile_, 0, 16, 0).data());
    SetBf16FromFloat(put.mutable_v(), shape, synthetic::Kv(1, profile_, 0, 16, 1).data());
    EXPECT_TRUE(client_->Put(put).ok());
    auto open = client_->OpenSequence("tiny", "", t);
    EXPECT_TRUE(open.ok()) << open.status();
    return open.ok() ? open->sequence_id() : 0;
  }
  v1::AttentionDecodeRequest Decode(uint64_t seq) {
    v1::AttentionDecodeRequest req;
    req.add_sequence_ids(seq);
    SetF32Tensor(req.mutable_q(), {1, profile_.num_q_heads(), profile_.head_dim()},
                 synthetic::Row(3, profile_, 0, 0, 2).data());
    return req;
  }

  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
  v1::ModelProfile profile_;
};

TEST_F(FaultInjectionTest, TransientAttentionFaultFailsOneCall) {
  ASSERT_TRUE(Start("attend:1"));
  const uint64_t seq = OpenSequence();
  auto bad = client_->AttentionDecode(Decode(seq));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
  auto good = client_->AttentionDecode(Decode(seq));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->lengths(0), 16);
  auto h = client_->Health();
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(daemon_.Stop(), 0);
}

// A fused decode (k_new/v_new appended, then attention) whose attention launch fails keeps
// nothing of its append: the pool is as before, the same call succeeds when retried (the
// layer does not "already hold" the token), and the token is stored once.
TEST_F(FaultInjectionTest, FailedAttentionOfAFusedDecodeKeepsNoAppendedRow) {
  ASSERT_TRUE(Start("attend:1"));
  const uint64_t seq = OpenSequence();  // 16 tokens: 4 full pages
  auto pages_used = [&]() -> uint64_t {
    auto stats = client_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->models(0).pools(0).pages_used() : 0;
  };
  const uint64_t used = pages_used();
  const int hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  auto fused = [&](int32_t layer) {
    v1::AttentionDecodeRequest req = Decode(seq);
    req.set_layer(layer);
    req.add_new_tokens(77);
    SetBf16FromFloat(req.mutable_k_new(), {1, hkv, d},
                     synthetic::Row(9, profile_, layer, 16, 0).data());
    SetBf16FromFloat(req.mutable_v_new(), {1, hkv, d},
                     synthetic::Row(9, profile_, layer, 16, 1).data());
    return client_->AttentionDecode(req);
  };
  auto bad = fused(0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
  EXPECT_EQ(pages_used(), used);  // the page taken for token 16 went back
  auto again = fused(0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->lengths(0), 17);
  EXPECT_EQ(pages_used(), used + 1);
  for (int32_t layer = 1; layer < profile_.num_layers(); ++layer) {
    auto r = fused(layer);
    ASSERT_TRUE(r.ok()) << layer << ": " << r.status();
  }
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(seq);
  fetch.set_first_token(16);
  fetch.set_expand_to_bf16(true);
  auto fetched = client_->FetchPages(fetch);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->num_tokens(), 1);  // token 16, once
  for (int32_t layer = 0; layer < profile_.num_layers(); ++layer) {
    v1::TensorRef k;
    SetBf16FromFloat(&k, {1, hkv, d}, synthetic::Row(9, profile_, layer, 16, 0).data());
    const size_t row_bytes = static_cast<size_t>(hkv) * d * 2;
    EXPECT_EQ(fetched->k().inline_data().substr(layer * row_bytes, row_bytes), k.inline_data())
        << layer;
  }
  EXPECT_EQ(daemon_.Stop(), 0);
}

TEST_F(FaultInjectionTest, FailedAllocationAtStartUpStopsTheDaemon) {
  EXPECT_FALSE(Start("alloc:1"));
  EXPECT_EQ(daemon_.WaitExit(), 2);
  EXPECT_NE(Stderr().find("injected fault: allocation #1"), std::string::npos) << Stderr();
}

TEST_F(FaultInjectionTest, BadSpecIsRefusedAtStartUp) {
  EXPECT_FALSE(Start("launch:1"));
  EXPECT_EQ(daemon_.WaitExit(), 2);
  EXPECT_NE(Stderr().find("fault-inject entry 'launch:1'"), std::string::npos) << Stderr();
}

TEST_F(FaultInjectionTest, StickyFaultTurnsHealthNotServingAndExitsNonZero) {
  ASSERT_TRUE(Start("sticky:attend:1"));
  const uint64_t seq = OpenSequence();
  // Watch health on the health-only port before the fault: the stream sends SERVING now
  // and every change after.
  auto channel = grpc::CreateChannel(daemon_.health(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::health::v1::HealthCheckRequest hreq;
  auto watch = health->Watch(&ctx, hreq);
  grpc::health::v1::HealthCheckResponse status;
  ASSERT_TRUE(watch->Read(&status));
  EXPECT_EQ(status.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  auto bad = client_->AttentionDecode(Decode(seq));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
  bool not_serving = false;
  while (watch->Read(&status)) {
    if (status.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
      not_serving = true;
      break;
    }
  }
  EXPECT_TRUE(not_serving);
  ctx.TryCancel();
  (void)watch->Finish();
  EXPECT_EQ(daemon_.WaitExit(), 1);
  EXPECT_NE(Stderr().find("unrecoverable error; NOT_SERVING"), std::string::npos) << Stderr();
}

}  // namespace fault_injection_test
}  // namespace kvcd
