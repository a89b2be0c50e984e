// PullPrefix between two daemons registered in a real etcd (docs/cluster.md "Pulling pages
// from a peer"): the pages move as stored, and the pulling daemon then serves the same
// bytes as the source; the bad cases store nothing.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "client/client.h"
#include "cluster_servers.h"
#include "daemon_process.h"
#include "kvcd/v1/kvcache.grpc.pb.h"
#include "proto/tensor_ref.h"
#include "server/cluster/etcd_client.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace cluster_pull_test {

using testing_util::DaemonProcess;
using testing_util::EtcdServer;
using testing_util::WaitFor;

std::string Config(const std::string& member, const std::string& etcd,
                   const std::string& transport = "") {
  std::string c = R"(
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 65536
)" + testing_util::ClusterSection("t", member, etcd);
  if (!transport.empty()) c += "  pull_transport: " + transport + "\n";
  return c;
}

constexpr char kLoneConfig[] = R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
models:
  - builtin: tiny
    memory: 65536
)";

std::unique_ptr<v1::KvCache::Stub> Stub(const std::string& address) {
  return v1::KvCache::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

grpc::Status Pull(v1::KvCache::Stub* stub, const std::vector<int32_t>& tokens,
                  const std::string& peer, v1::PullPrefixResponse* resp) {
  v1::PullPrefixRequest req;
  req.set_model("tiny");
  *req.mutable_tokens() = {tokens.begin(), tokens.end()};
  req.set_peer_member_id(peer);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return stub->PullPrefix(&ctx, req, resp);
}

// The pages as stored of the cached prefix of `tokens` on a daemon (OpenSequence, FetchPages,
// CloseSequence): their formats and bytes in order.
std::vector<std::string> StoredPages(v1::KvCache::Stub* stub, const std::vector<int32_t>& tokens,
                                     int64_t* matched) {
  v1::OpenSequenceRequest open;
  open.set_model("tiny");
  *open.mutable_tokens() = {tokens.begin(), tokens.end()};
  v1::OpenSequenceResponse opened;
  grpc::ClientContext c1;
  EXPECT_TRUE(stub->OpenSequence(&c1, open, &opened).ok());
  *matched = opened.matched_tokens();
  v1::FetchPagesRequest fetch;
  fetch.set_sequence_id(opened.sequence_id());
  fetch.set_num_tokens(opened.matched_tokens());
  v1::FetchPagesResponse pages;
  grpc::ClientContext c2;
  std::vector<std::string> out;
  if (opened.matched_tokens() > 0) {
    const grpc::Status s = stub->FetchPages(&c2, fetch, &pages);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  for (const v1::StoredPage& p : pages.pages()) out.push_back(p.format() + ":" + p.data());
  v1::CloseSequenceRequest close;
  close.set_sequence_id(opened.sequence_id());
  v1::CloseSequenceResponse closed;
  grpc::ClientContext c3;
  EXPECT_TRUE(stub->CloseSequence(&c3, close, &closed).ok());
  return out;
}

TEST(ClusterPullTest, PagesMoveAsStoredAndBadPullsStoreNothing) {
  EtcdServer etcd;
  ASSERT_TRUE(etcd.Start()) << etcd.Log();
  DaemonProcess a, b, lone;
  ASSERT_TRUE(a.Start(Config("a", etcd.endpoint())));
  ASSERT_TRUE(b.Start(Config("b", etcd.endpoint(), "auto")));
  ASSERT_TRUE(lone.Start(kLoneConfig));
  EtcdClient etcd_client({etcd.endpoint()});
  // b knows a once a's key is in etcd (b watches the prefix; give the watch a moment by
  // waiting on the key and then on a successful answer below).
  ASSERT_TRUE(WaitFor(
      [&] {
        auto kv = etcd_client.Get("/kvcd/t/members/a");
        return kv.ok() && !kv->empty();
      },
      std::chrono::seconds(10)));

  ClientOptions o;
  o.target = a.grpc();
  auto ca = Client::Connect(o);
  ASSERT_TRUE(ca.ok());
  auto model = (*ca)->GetModel("tiny");
  ASSERT_TRUE(model.ok());
  // 24 tokens = 6 pages on a (BF16 sink and window pages, bf16 history); b holds the first 2.
  ASSERT_TRUE((*ca)->Put(synthetic::Put(7, model->profile(), 24)).ok());
  o.target = b.grpc();
  auto cb = Client::Connect(o);
  ASSERT_TRUE(cb.ok());
  ASSERT_TRUE((*cb)->Put(synthetic::Put(7, model->profile(), 8)).ok());
  const std::vector<int32_t> tokens = synthetic::Tokens(7, 0, 26);

  auto sa = Stub(a.grpc()), sb = Stub(b.grpc()), sl = Stub(lone.grpc());
  v1::PullPrefixResponse resp;
  // Bad input first: nothing may change on b.
  grpc::Status s = Pull(sl.get(), tokens, "a", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  s = Pull(sb.get(), tokens, "nobody", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  s = Pull(sb.get(), tokens, "b", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  s = Pull(sb.get(), tokens, "a/../x", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  s = Pull(sb.get(), {}, "a", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  int64_t matched = 0;
  StoredPages(sb.get(), tokens, &matched);
  EXPECT_EQ(matched, 8);

  // The pull: b gets pages 2..5 from a.
  ASSERT_TRUE(
      WaitFor([&] { return Pull(sb.get(), tokens, "a", &resp).ok(); }, std::chrono::seconds(10)))
      << Pull(sb.get(), tokens, "a", &resp).error_message();
  EXPECT_EQ(resp.local_tokens(), 8);
  EXPECT_EQ(resp.pulled_tokens(), 16);
  EXPECT_GT(resp.pulled_bytes(), 0);
  EXPECT_EQ(resp.peer_address(), a.grpc());
  // CPU daemons: `auto` moved the pages inline over gRPC, and the metrics say so.
  const std::string metrics = testing_util::ScrapeMetrics(b);
  EXPECT_EQ(testing_util::MetricValue(metrics,
                                      "kvcd_cluster_pulls_by_transport_total{transport=\"grpc\"}"),
            1)
      << metrics;
  EXPECT_EQ(testing_util::MetricValue(
                metrics, "kvcd_cluster_pulls_by_transport_total{transport=\"cuda_ipc\"}"),
            0);
  EXPECT_EQ(testing_util::MetricValue(
                metrics, "kvcd_cluster_pulled_bytes_by_transport_total{transport=\"grpc\"}"),
            static_cast<double>(resp.pulled_bytes()));
  int64_t matched_a = 0, matched_b = 0;
  const auto pages_a = StoredPages(sa.get(), tokens, &matched_a);
  const auto pages_b = StoredPages(sb.get(), tokens, &matched_b);
  EXPECT_EQ(matched_a, 24);
  EXPECT_EQ(matched_b, 24);
  ASSERT_EQ(pages_a.size(), 6u);
  EXPECT_EQ(pages_a, pages_b) << "b serves other bytes than a stored";
  // Pulling again moves nothing.
  ASSERT_TRUE(Pull(sb.get(), tokens, "a", &resp).ok());
  EXPECT_EQ(resp.local_tokens(), 24);
  EXPECT_EQ(resp.pulled_tokens(), 0);

  // A device transport forced on CPU daemons: FAILED_PRECONDITION saying why, nothing stored.
  for (const char* transport : {"cuda_ipc", "nccl"}) {
    DaemonProcess forced;
    ASSERT_TRUE(
        forced.Start(Config(std::string("forced-") + transport, etcd.endpoint(), transport)));
    auto sf = Stub(forced.grpc());
    ASSERT_TRUE(WaitFor(
        [&] {
          return Pull(sf.get(), tokens, "a", &resp).error_code() != grpc::StatusCode::NOT_FOUND;
        },
        std::chrono::seconds(10)));
    s = Pull(sf.get(), tokens, "a", &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("needs backend cuda on both members"), std::string::npos)
        << s.error_message();
    StoredPages(sf.get(), tokens, &matched);
    EXPECT_EQ(matched, 0) << transport;
  }

  // The peer down: UNAVAILABLE (or NOT_FOUND once its key is gone), nothing stored.
  const std::vector<int32_t> other = synthetic::Tokens(9, 0, 16);
  ASSERT_TRUE((*ca)->Put(synthetic::Put(9, model->profile(), 16)).ok());
  a.Kill();
  s = Pull(sb.get(), other, "a", &resp);
  EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAVAILABLE ||
              s.error_code() == grpc::StatusCode::NOT_FOUND)
      << s.error_code() << " " << s.error_message();
  StoredPages(sb.get(), other, &matched);
  EXPECT_EQ(matched, 0);
}

// Pages larger than a fetch of 64 fits in max_message_bytes: the pull sizes its fetches by
// the pages' bytes (a model of 1 MiB BF16 pages, an 8 MiB message limit, 20 pages).
TEST(ClusterPullTest, LargePagesArePulledInFetchesThatFitTheMessageLimit) {
  EtcdServer etcd;
  ASSERT_TRUE(etcd.Start()) << etcd.Log();
  const std::string config = R"(
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 64MiB
max_message_bytes: 8388608
models:
  - name: wide
    num_layers: 4
    num_q_heads: 8
    num_kv_heads: 8
    head_dim: 128
    page_size: 64
    sink_tokens: 64
    recent_tokens: 128
    memory: 32MiB
)";
  DaemonProcess a, b;
  ASSERT_TRUE(a.Start(config + testing_util::ClusterSection("w", "a", etcd.endpoint())));
  ASSERT_TRUE(b.Start(config + testing_util::ClusterSection("w", "b", etcd.endpoint())));
  ClientOptions o;
  o.target = a.grpc();
  auto ca = Client::Connect(o);
  ASSERT_TRUE(ca.ok());
  auto model = (*ca)->GetModel("wide");
  ASSERT_TRUE(model.ok()) << model.status();
  // 20 pages of 1 MiB on a, put in chunks that fit the message limit.
  const std::vector<int32_t> tokens = synthetic::Tokens(3, 0, 1280);
  for (int64_t first = 0; first < 1280; first += 128) {
    v1::PutRequest put;
    put.set_model("wide");
    put.mutable_tokens()->Assign(tokens.begin(), tokens.begin() + first + 128);
    put.set_kv_first_token(first);
    const std::vector<int64_t> shape = {4, 128, 8, 128};
    SetBf16FromFloat(put.mutable_k(), shape,
                     synthetic::Kv(3, model->profile(), first, 128, 0).data());
    SetBf16FromFloat(put.mutable_v(), shape,
                     synthetic::Kv(3, model->profile(), first, 128, 1).data());
    auto r = (*ca)->Put(put);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto sb = Stub(b.grpc());
  v1::PullPrefixRequest req;
  req.set_model("wide");
  *req.mutable_tokens() = {tokens.begin(), tokens.end()};
  req.set_peer_member_id("a");
  v1::PullPrefixResponse resp;
  grpc::Status s;
  ASSERT_TRUE(WaitFor(
      [&] {
        grpc::ClientContext ctx;
        s = sb->PullPrefix(&ctx, req, &resp);
        return s.error_code() != grpc::StatusCode::NOT_FOUND;
      },
      std::chrono::seconds(10)));
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.pulled_tokens(), 1280);
  EXPECT_EQ(resp.pulled_bytes(), int64_t{20} << 20);
}

}  // namespace cluster_pull_test
}  // namespace kvcd
