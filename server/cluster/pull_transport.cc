#include "server/cluster/pull_transport.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvcd {

const char* PullTransportName(PullTransport t) {
  switch (t) {
    case PullTransport::kCudaIpc:
      return "cuda_ipc";
    case PullTransport::kNccl:
      return "nccl";
    case PullTransport::kGrpc:
      break;
  }
  return "grpc";
}

absl::StatusOr<std::vector<PullTransport>> PullTransportOrder(const std::string& policy,
                                                              const PullEnd& self,
                                                              const PullEnd& peer) {
  const bool both_cuda = self.backend == "cuda" && peer.backend == "cuda";
  const bool same_node = !self.node_id.empty() && self.node_id == peer.node_id;
  if (policy == "grpc") return std::vector<PullTransport>{PullTransport::kGrpc};
  if (policy == "cuda_ipc" || policy == "nccl") {
    if (!both_cuda) {
      return absl::FailedPreconditionError(absl::StrCat(
          "PullPrefix: cluster.pull_transport is ", policy,
          ", which needs backend cuda on both members; this daemon runs ", self.backend,
          " and peer ", peer.member_id, " runs ", peer.backend, "; nothing was stored"));
    }
    if (policy == "cuda_ipc" && !same_node) {
      return absl::FailedPreconditionError(absl::StrCat(
          "PullPrefix: cluster.pull_transport is cuda_ipc, which needs both members on one "
          "node; peer ",
          peer.member_id, " advertises node id ", Quote(peer.node_id), " and this daemon ",
          Quote(self.node_id), "; nothing was stored"));
    }
    return std::vector<PullTransport>{policy == "cuda_ipc" ? PullTransport::kCudaIpc
                                                           : PullTransport::kNccl};
  }
  if (policy != "auto") {
    return absl::InvalidArgumentError(absl::StrCat("cluster.pull_transport is ", Quote(policy),
                                                   ", expected grpc, auto, cuda_ipc or nccl"));
  }
  std::vector<PullTransport> order;
  if (both_cuda && same_node) order.push_back(PullTransport::kCudaIpc);
  if (both_cuda) order.push_back(PullTransport::kNccl);
  order.push_back(PullTransport::kGrpc);
  return order;
}

}  // namespace kvcd
