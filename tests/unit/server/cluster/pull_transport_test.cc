// PullTransportOrder (docs/cluster.md "Transports"): the transports a pull tries, in order,
// for each policy and pair of members.
#include "server/cluster/pull_transport.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvcd {
namespace pull_transport_test {

using T = PullTransport;

std::vector<T> Order(const std::string& policy, const PullEnd& self, const PullEnd& peer) {
  auto o = PullTransportOrder(policy, self, peer);
  EXPECT_TRUE(o.ok()) << policy << ": " << o.status();
  return o.ok() ? *o : std::vector<T>{};
}

const PullEnd kCudaHere{"b", "cuda", "node-1"};
const PullEnd kCudaSameNode{"a", "cuda", "node-1"};
const PullEnd kCudaOtherNode{"a", "cuda", "node-2"};
const PullEnd kCudaUnknownNode{"a", "cuda", ""};
const PullEnd kCpuSameNode{"a", "cpu", "node-1"};
const PullEnd kCpuHere{"b", "cpu", "node-1"};

TEST(PullTransportTest, GrpcIsTheDefaultPolicyAndAlwaysGrpc) {
  EXPECT_EQ(Order("grpc", kCudaHere, kCudaSameNode), std::vector<T>{T::kGrpc});
  EXPECT_EQ(Order("grpc", kCpuHere, kCpuSameNode), std::vector<T>{T::kGrpc});
}

TEST(PullTransportTest, AutoTriesIpcOnOneNodeThenNcclThenGrpc) {
  EXPECT_EQ(Order("auto", kCudaHere, kCudaSameNode),
            (std::vector<T>{T::kCudaIpc, T::kNccl, T::kGrpc}));
  EXPECT_EQ(Order("auto", kCudaHere, kCudaOtherNode), (std::vector<T>{T::kNccl, T::kGrpc}));
  // A member that advertises no node id is never taken for this node.
  EXPECT_EQ(Order("auto", kCudaHere, kCudaUnknownNode), (std::vector<T>{T::kNccl, T::kGrpc}));
  EXPECT_EQ(Order("auto", {"b", "cuda", ""}, {"a", "cuda", ""}),
            (std::vector<T>{T::kNccl, T::kGrpc}));
  // Any CPU member: gRPC only.
  EXPECT_EQ(Order("auto", kCudaHere, kCpuSameNode), std::vector<T>{T::kGrpc});
  EXPECT_EQ(Order("auto", kCpuHere, kCudaSameNode), std::vector<T>{T::kGrpc});
  EXPECT_EQ(Order("auto", kCpuHere, kCpuSameNode), std::vector<T>{T::kGrpc});
}

TEST(PullTransportTest, AForcedDeviceTransportIsAloneOrRefused) {
  EXPECT_EQ(Order("cuda_ipc", kCudaHere, kCudaSameNode), std::vector<T>{T::kCudaIpc});
  EXPECT_EQ(Order("nccl", kCudaHere, kCudaSameNode), std::vector<T>{T::kNccl});
  EXPECT_EQ(Order("nccl", kCudaHere, kCudaOtherNode), std::vector<T>{T::kNccl});
  struct Refused {
    std::string policy;
    PullEnd self, peer;
    std::string says;
  };
  const std::vector<Refused> refused = {
      {"cuda_ipc", kCudaHere, kCudaOtherNode, "needs both members on one node"},
      {"cuda_ipc", kCudaHere, kCudaUnknownNode, "needs both members on one node"},
      {"cuda_ipc", kCpuHere, kCudaSameNode, "this daemon runs cpu"},
      {"nccl", kCudaHere, kCpuSameNode, "peer a runs cpu"},
      {"nccl", kCpuHere, kCpuSameNode, "needs backend cuda on both members"},
  };
  for (const Refused& r : refused) {
    auto o = PullTransportOrder(r.policy, r.self, r.peer);
    ASSERT_FALSE(o.ok()) << r.policy << " " << r.says;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(o.status().message().find(r.says), std::string::npos) << o.status();
    EXPECT_NE(o.status().message().find("nothing was stored"), std::string::npos) << o.status();
  }
}

TEST(PullTransportTest, AnUnknownPolicyIsInvalid) {
  auto o = PullTransportOrder("rdma", kCudaHere, kCudaSameNode);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("expected grpc, auto, cuda_ipc or nccl"), std::string::npos);
}

TEST(PullTransportTest, Names) {
  EXPECT_STREQ(PullTransportName(T::kGrpc), "grpc");
  EXPECT_STREQ(PullTransportName(T::kCudaIpc), "cuda_ipc");
  EXPECT_STREQ(PullTransportName(T::kNccl), "nccl");
}

}  // namespace pull_transport_test
}  // namespace kvcd
