// PullPrefix between two CUDA daemons in a real etcd (docs/cluster.md "Transports"): the
// pages move GPU to GPU by CUDA IPC (both daemons on GPU 0, one node) and, with two GPUs,
// by NCCL (the puller on GPU 1: CUDA_VISIBLE_DEVICES=1,0, so that its device 0 is GPU 1
// and GPU 0 stays visible for peer access). Afterwards the puller serves the same bytes as the
// source, attention over the prefix is bitwise equal on both, and the puller's metrics credit the
// transport. Skips without a GPU (the NCCL case without two).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "client/client.h"
#include "cluster_servers.h"
#include "cuda_cpu_daemons.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace cluster_device_pull_test {

using testing_util::DaemonProcess;
using testing_util::EtcdServer;
using testing_util::WaitFor;

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string Config(const std::string& member, const std::string& etcd,
                   const std::string& transport) {
  return testing_util::SmallCudaDaemon() + testing_util::ClusterSection("d", member, etcd) +
         "  pull_transport: " + transport + "\n";
}

// The pages as stored of the cached prefix of `tokens` ("format:bytes" each) and how many
// tokens are cached; the sequence stays open in *seq for attention.
std::vector<std::string> StoredPages(Client* c, const std::string& model,
                                     const std::vector<int32_t>& tokens, uint64_t* seq,
                                     int64_t* matched) {
  std::vector<std::string> out;
  auto o = c->OpenSequence(model, "", tokens, 30000);
  EXPECT_TRUE(o.ok()) << o.status();
  if (!o.ok()) return out;
  *seq = o->sequence_id();
  *matched = o->matched_tokens();
  v1::FetchPagesRequest f;
  f.set_sequence_id(*seq);
  f.set_num_tokens(*matched);
  auto r = c->FetchPages(f);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) {
    for (const auto& p : r->pages()) out.push_back(p.format() + ":" + p.data());
  }
  return out;
}

// One pull of each model from a to b over `transport` (b on `b_device`), checked.
void PullAndCompare(const std::string& transport, const char* b_device) {
  EtcdServer etcd;
  ASSERT_TRUE(etcd.Start()) << etcd.Log();
  DaemonProcess a, b;
  ASSERT_TRUE(a.Start(Config("a", etcd.endpoint(), "auto")));
  if (b_device != nullptr) setenv("CUDA_VISIBLE_DEVICES", b_device, 1);
  const bool b_started = b.Start(Config("b", etcd.endpoint(), transport));
  if (b_device != nullptr) unsetenv("CUDA_VISIBLE_DEVICES");
  ASSERT_TRUE(b_started);
  auto ca = ConnectTo(a), cb = ConnectTo(b);
  ASSERT_TRUE(ca && cb);
  int pulls = 0;
  for (const std::string model : {"small", "small-bf16"}) {
    SCOPED_TRACE(model);
    auto info = ca->GetModel(model);
    ASSERT_TRUE(info.ok()) << info.status();
    // a holds 10 pages; b the first 2, so the pull starts past page 0.
    ASSERT_TRUE(ca->Put(synthetic::Put(5, info->profile(), 640)).ok());
    ASSERT_TRUE(cb->Put(synthetic::Put(5, info->profile(), 128)).ok());
    const std::vector<int32_t> tokens = synthetic::Tokens(5, 0, 650);
    v1::PullPrefixRequest req;
    req.set_model(model);
    *req.mutable_tokens() = {tokens.begin(), tokens.end()};
    req.set_peer_member_id("a");
    absl::StatusOr<v1::PullPrefixResponse> pulled;
    // b knows a once its membership watch saw a's key.
    ASSERT_TRUE(WaitFor(
        [&] {
          pulled = cb->PullPrefix(req);
          return pulled.status().code() != absl::StatusCode::kNotFound;
        },
        std::chrono::seconds(10)));
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->local_tokens(), 128);
    EXPECT_EQ(pulled->pulled_tokens(), 512);
    EXPECT_GT(pulled->pulled_bytes(), 0);
    ++pulls;

    uint64_t sa = 0, sb = 0;
    int64_t ma = 0, mb = 0;
    const auto pages_a = StoredPages(ca.get(), model, tokens, &sa, &ma);
    const auto pages_b = StoredPages(cb.get(), model, tokens, &sb, &mb);
    EXPECT_EQ(ma, 640);
    EXPECT_EQ(mb, 640);
    ASSERT_EQ(pages_a.size(), 10u);
    EXPECT_TRUE(pages_a == pages_b) << "b serves other bytes than a stored";

    // Attention over the prefix: the same query gives the same output and LSE on both.
    const auto& p = info->profile();
    std::vector<float> q(static_cast<size_t>(p.num_q_heads() * p.head_dim()));
    for (size_t i = 0; i < q.size(); ++i)
      q[i] = synthetic::Value(5, 1, 640, 0, static_cast<int32_t>(i), 2);
    v1::AttentionDecodeRequest r;
    r.set_layer(1);
    SetF32Tensor(r.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    r.add_sequence_ids(sa);
    auto oa = ca->AttentionDecode(r);
    r.set_sequence_ids(0, sb);
    auto ob = cb->AttentionDecode(r);
    ASSERT_TRUE(oa.ok() && ob.ok()) << oa.status() << " " << ob.status();
    EXPECT_EQ(oa->o().inline_data(), ob->o().inline_data());
    EXPECT_EQ(oa->lse().inline_data(), ob->lse().inline_data());
    (void)ca->CloseSequence(sa);
    (void)cb->CloseSequence(sb);
  }
  const std::string metrics = testing_util::ScrapeMetrics(b);
  EXPECT_EQ(testing_util::MetricValue(
                metrics, "kvcd_cluster_pulls_by_transport_total{transport=\"" + transport + "\"}"),
            pulls)
      << metrics;
  EXPECT_EQ(testing_util::MetricValue(metrics,
                                      "kvcd_cluster_pulls_by_transport_total{transport=\"grpc\"}"),
            0);
}

TEST(ClusterDevicePullTest, CudaIpcOnOneGpuMovesPagesByteForByte) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  PullAndCompare("cuda_ipc", nullptr);
}

TEST(ClusterDevicePullTest, NcclBetweenTwoGpusMovesPagesByteForByte) {
  if (DeviceCount() < 2) GTEST_SKIP() << "NCCL needs two GPUs (one rank each)";
  PullAndCompare("nccl", "1,0");
}

TEST(ClusterDevicePullTest, CudaIpcBetweenTwoGpusMovesPagesByteForByte) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  PullAndCompare("cuda_ipc", "1,0");
}

}  // namespace cluster_device_pull_test
}  // namespace kvcd
