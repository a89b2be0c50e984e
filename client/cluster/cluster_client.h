// ClusterClient: N kvcd daemons used as one cache (docs/cluster.md "Routing"). It hashes a
// prompt's pages (block identity v1), asks the Redis block index who holds them, routes
// (routing.h), replicates hot prefixes with PullPrefix, and opens sessions on the chosen
// member. A ClusterSession re-opens on another member when its member answers UNAVAILABLE,
// re-prefilling what that member lacks from the caller's KvSource, and retries the call
// once. The Python twin is kvcd.cluster.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/cluster/member_directory.h"
#include "client/cluster/redis_index.h"
#include "client/cluster/routing.h"

namespace kvcd::cluster {

struct ClusterClientOptions {
  // Membership: etcd (its endpoints, host:port), or, when none are given, DNS (membership
  // dns: the A records of dns_name, every member serving gRPC on dns_port, asked for their
  // Stats with `client`'s credentials every dns_refresh).
  std::vector<std::string> etcd_endpoints;
  std::string dns_name;
  int dns_port = 0;
  std::chrono::milliseconds dns_refresh{5000};
  std::string cluster_name = "kvcd";
  std::string redis_url;  // redis://host:port[/db]; empty: no index (rendezvous only)
  RoutingConfig routing;
  ClientOptions client;  // per member (its target is the member's address)
  // A member that answered UNAVAILABLE is left out of routing for this long, unless
  // membership shows it with another incarnation.
  std::chrono::milliseconds down_for{30000};
};

// The K and V rows [first, first + count) of a session's tokens, as AppendRequest takes them
// ([layers, count, kv_heads, head_dim], BF16 or F32): what a re-opened session re-sends.
using KvSource =
    std::function<absl::Status(int64_t first, int64_t count, v1::TensorRef* k, v1::TensorRef* v)>;

class ClusterSession;

class ClusterClient {
 public:
  static absl::StatusOr<std::unique_ptr<ClusterClient>> Connect(ClusterClientOptions options);

  // Where a session on `tokens` goes. FAILED_PRECONDITION when no member is live.
  absl::StatusOr<Decision> Route(const std::string& model, const std::string& salt,
                                 absl::Span<const int32_t> tokens,
                                 absl::Span<const std::string> exclude = {});
  // Opens a session on the member routing picks; `kv` supplies the rows the member lacks.
  absl::StatusOr<std::unique_ptr<ClusterSession>> Open(const std::string& model,
                                                       const std::string& salt,
                                                       absl::Span<const int32_t> tokens,
                                                       KvSource kv, int64_t lease_ms = 0);
  // The client of a live member (one per address and incarnation). NOT_FOUND otherwise.
  absl::StatusOr<Client*> ClientOf(const std::string& member_id);
  void MarkDown(const std::string& member_id);

  MemberDirectory& directory() { return *directory_; }
  RedisIndex* index() { return index_.get(); }
  // The latency of the last Route's index lookup (hashing, holders, loads).
  double last_lookup_seconds() const { return last_lookup_seconds_; }
  int64_t replications() const { return replications_; }

 private:
  friend class ClusterSession;
  explicit ClusterClient(ClusterClientOptions o) : options_(std::move(o)) {}
  // (history format, page size) of `model`, asked of a live member once.
  absl::StatusOr<std::pair<std::string, int>> Format(const std::string& model);
  MemberDirectory::Members Live();
  // Asks d.member_id to pull from d.pull_from; returns the member to open on.
  std::string Replicate(const Decision& d, const std::string& model, const std::string& salt,
                        absl::Span<const int32_t> tokens);

  ClusterClientOptions options_;
  std::unique_ptr<MemberDirectory> directory_;
  std::unique_ptr<RedisIndex> index_;
  std::mutex mu_;
  struct Cached {
    std::string address, incarnation;
    std::unique_ptr<Client> client;
  };
  absl::flat_hash_map<std::string, Cached> clients_;
  std::vector<std::unique_ptr<Client>> retired_;  // clients of replaced incarnations
  absl::flat_hash_map<std::string, std::pair<std::string, std::chrono::steady_clock::time_point>>
      down_;  // member id -> (incarnation, since)
  absl::flat_hash_map<std::string, std::pair<std::string, int>> formats_;
  std::unique_ptr<HotPrefixes> hot_;
  double last_lookup_seconds_ = 0;
  int64_t replications_ = 0;
};

class ClusterSession {
 public:
  ~ClusterSession();
  const std::string& member_id() const { return member_id_; }
  uint64_t sequence_id() const { return sequence_id_; }
  int64_t matched_tokens() const { return matched_tokens_; }
  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t failovers() const { return failovers_; }
  int64_t reprefilled_tokens() const { return reprefilled_tokens_; }
  const Decision& decision() const { return decision_; }

  // Appends tokens with their K/V (the KvSource must be able to give them again later).
  absl::StatusOr<int64_t> Append(absl::Span<const int32_t> tokens, const v1::TensorRef& k,
                                 const v1::TensorRef& v);
  // Attention of req.q over the session (its sequence id is filled in; new tokens go
  // through Append, so k_new/v_new must be empty).
  absl::StatusOr<v1::AttentionDecodeResponse> AttentionDecode(v1::AttentionDecodeRequest req);
  absl::StatusOr<v1::CommitSequenceResponse> Commit();
  // A second session on the same member sharing this one's pages (ForkSequence).
  absl::StatusOr<std::unique_ptr<ClusterSession>> Fork();
  // Closes the sequence (committing its pages when `commit`; then a lost member means
  // re-opening elsewhere first). Returns the final length.
  absl::StatusOr<int64_t> Close(bool commit = false);

 private:
  friend class ClusterClient;
  ClusterSession(ClusterClient* c, std::string model, std::string salt, std::vector<int32_t> tokens,
                 KvSource kv, int64_t lease_ms)
      : cluster_(c),
        model_(std::move(model)),
        salt_(std::move(salt)),
        tokens_(std::move(tokens)),
        kv_(std::move(kv)),
        lease_ms_(lease_ms) {}
  // Routes (leaving out `exclude`) and opens the sequence there, re-prefilling from kv_.
  absl::Status OpenOn(absl::Span<const std::string> exclude);
  absl::Status Failover();
  template <typename F>
  auto Run(F op) -> decltype(op());

  ClusterClient* cluster_;
  std::string model_, salt_;
  std::vector<int32_t> tokens_;
  KvSource kv_;
  int64_t lease_ms_;
  std::string member_id_;
  uint64_t sequence_id_ = 0;
  int64_t matched_tokens_ = 0;
  Decision decision_;
  int64_t failovers_ = 0, reprefilled_tokens_ = 0;
  bool closed_ = false;
};

}  // namespace kvcd::cluster
