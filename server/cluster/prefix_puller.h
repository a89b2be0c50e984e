// PullPrefix on the daemon (docs/cluster.md "Pulling pages from a peer"): this daemon (B)
// pulls from the peer A named by member id the pages of the longest prefix of the tokens
// that A holds beyond what B holds. A's address comes from membership, never from the
// request. A is called with the caller's own `authorization` metadata (A authorizes the
// same tenant) and over TLS when this daemon serves TLS. The pull runs OpenSequence on A
// with a short lease, FetchPages of the pages as stored, CloseSequence; the pages then go
// through this daemon's PushPages (format, size, finite values): all or nothing.
// The page bytes move by one of three transports (docs/cluster.md "Transports",
// cluster.pull_transport): CUDA IPC when both members run backend cuda on one node, NCCL
// when both run cuda, else inline in FetchPages' gRPC answers (DevicePagePull for the first
// two). Under `auto` a device transport that fails before anything is stored falls back to
// the next one; the counters say which transport moved each pull.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "kvcd/v1/kvcache.grpc.pb.h"
#include "server/cluster/membership.h"
#include "server/cluster/pull_transport.h"
#include "server/config/config.h"
#include "server/engine/cache_engine.h"

namespace kvcd {

class PrefixPuller {
 public:
  // The peer's sequence lives at most this long (if this daemon dies mid-pull).
  static constexpr int64_t kPeerLeaseMs = 10000;
  // Pages per FetchPages call (each answer stays well under the message limit).
  static constexpr int64_t kPagesPerFetch = 64;

  // INVALID_ARGUMENT when the TLS files cannot be read.
  static absl::StatusOr<std::unique_ptr<PrefixPuller>> Create(CacheEngine* engine,
                                                              Membership* membership,
                                                              const ServerConfig& config);

  // Errors: INVALID_ARGUMENT (a bad request, or a peer that answered pages that do not fit),
  // NOT_FOUND (an unknown model or member), UNAVAILABLE (the peer cannot be reached or is
  // not advertised), the peer's own status otherwise. Nothing is stored unless every page
  // arrived and passed PushPages's checks.
  absl::Status Pull(const v1::PullPrefixRequest& req, const std::string& authorization,
                    v1::PullPrefixResponse* resp);

  uint64_t pulls() const { return pulls_.load(); }
  uint64_t pulled_bytes() const { return pulled_bytes_.load(); }
  uint64_t failures() const { return failures_.load(); }

  // Successful pulls that stored pages, and their bytes, by the transport that moved them;
  // device transports given up for the next one (auto only), by the transport given up.
  uint64_t pulls_by(PullTransport t) const { return Counts(t).pulls.load(); }
  uint64_t bytes_by(PullTransport t) const { return Counts(t).bytes.load(); }
  uint64_t fallbacks_from(PullTransport t) const { return Counts(t).fallbacks.load(); }

 private:
  PrefixPuller(CacheEngine* engine, Membership* membership, const ServerConfig& config,
               std::shared_ptr<grpc::ChannelCredentials> creds)
      : engine_(engine), membership_(membership), config_(config), creds_(std::move(creds)) {}
  absl::Status PullFrom(const MemberInfo& peer, const v1::PullPrefixRequest& req,
                        const std::string& authorization, int64_t local_tokens, int32_t page_size,
                        v1::PullPrefixResponse* resp);
  struct TransportCounts {
    std::atomic<uint64_t> pulls{0}, bytes{0}, fallbacks{0};
  };
  TransportCounts& Counts(PullTransport t) { return by_transport_[static_cast<int>(t)]; }
  const TransportCounts& Counts(PullTransport t) const {
    return by_transport_[static_cast<int>(t)];
  }
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address);

  CacheEngine* const engine_;
  Membership* const membership_;
  const ServerConfig config_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
  std::atomic<uint64_t> pulls_{0}, pulled_bytes_{0}, failures_{0};
  TransportCounts by_transport_[kPullTransports];
};

}  // namespace kvcd
