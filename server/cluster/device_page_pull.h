// DevicePagePull: the pulling daemon's side of moving a peer's stored pages GPU to GPU
// (docs/cluster.md "Transports"). The pulling daemon acts towards its peer as a data-plane
// worker does (docs/data-plane.md): it allocates a device staging buffer of its own and asks
// the peer's FetchPages to write the pages there, as stored,
//   - CUDA IPC (both daemons on one node): the staging buffer is registered with the peer
//     (RegisterBuffer); the peer copies its pages into it device to device and records its
//     done event, which this daemon waits for;
//   - NCCL (a GPU each, on one node or across a fabric): NcclConnect on the peer hands out
//     the communicator's unique id over the same authenticated gRPC channel; this daemon
//     joins as rank 1 and receives each FetchPages' pages with ncclRecv.
// The staged pages then go to `store` (CacheEngine::PushPagesFromDevice: PushPages's checks,
// all or nothing); the staging, the peer's buffer registration and the communicator are
// released on every path. Nothing the peer answers is trusted: the page ranges are checked
// by `check`, the byte count is this daemon's own, and every wait is bounded.
// Builds without CUDA answer FAILED_PRECONDITION.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvcd/v1/kvcache.grpc.pb.h"

namespace kvcd {

class DevicePagePull {
 public:
  // One NCCL transfer carries at most this much (the peer's link stages one transfer).
  static constexpr int64_t kMaxNcclChunkBytes = int64_t{1} << 30;
  // The staging of one pull.
  static constexpr int64_t kMaxPullBytes = int64_t{16} << 30;

  // One FetchPages of the pull: tokens [first_token, first_token + num_tokens) of the
  // peer's sequence, `bytes` as this daemon stores them.
  struct Chunk {
    int64_t first_token = 0;
    int64_t num_tokens = 0;
    int64_t bytes = 0;
  };
  struct Request {
    v1::KvCache::Stub* peer = nullptr;
    // Sets the deadline and the caller's authorization on each call to the peer.
    std::function<void(grpc::ClientContext*)> context;
    uint64_t sequence_id = 0;  // the peer's sequence on the prefix
    std::vector<Chunk> chunks;
    std::string name;          // label for the peer's logs
    int64_t lease_ms = 10000;  // of the staging's registration on the peer
    int timeout_ms = 10000;    // NCCL init and each transfer
    // Checks a FetchPages answer for a chunk (the pages asked for, in order).
    std::function<absl::Status(const Chunk&, const v1::FetchPagesResponse&)> check;
    // Stores the staged pages (device memory of this daemon, `bytes` long).
    std::function<absl::Status(const uint8_t* device_pages, int64_t bytes)> store;
  };

  // Errors: the peer's status for a call it refused (the code as the peer gave it, the
  // message naming the call), FAILED_PRECONDITION when this build or host cannot use the
  // transport, DEADLINE_EXCEEDED for a transfer that did not finish in time, RESOURCE_EXHAUSTED
  // when the staging cannot be allocated, else what `check` or `store` answered. *stored
  // says whether `store` was reached (a failure before it stored nothing and may be retried
  // over another transport).
  static absl::Status ByCudaIpc(const Request& req, bool* stored);
  static absl::Status ByNccl(const Request& req, bool* stored);
};

}  // namespace kvcd
