// Which transport moves the pages of a PullPrefix (docs/cluster.md "Transports"): from the
// policy cluster.pull_transport and what membership says of the two members (backend,
// node id), the transports to try, in order. The default policy is grpc; the device
// transports are opt-in (auto, cuda_ipc, nccl).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcd {

enum class PullTransport { kGrpc = 0, kCudaIpc = 1, kNccl = 2 };
inline constexpr int kPullTransports = 3;

// "grpc", "cuda_ipc", "nccl".
const char* PullTransportName(PullTransport t);

// What the choice needs of a member.
struct PullEnd {
  std::string member_id;
  std::string backend;  // cpu | cuda
  std::string node_id;  // empty: unknown (never the same node as another)
};

// grpc: {grpc}. auto: cuda_ipc when both run cuda on the same (known) node, then nccl when
// both run cuda, then grpc. cuda_ipc / nccl: that one alone, FAILED_PRECONDITION (naming
// what is missing; nothing was stored) when the members cannot use it. INVALID_ARGUMENT for
// an unknown policy.
absl::StatusOr<std::vector<PullTransport>> PullTransportOrder(const std::string& policy,
                                                              const PullEnd& self,
                                                              const PullEnd& peer);

}  // namespace kvcd
