// Membership without etcd (docs/cluster.md, `cluster.membership: dns`): the members are
// the A/AAAA records of cluster.dns_name (a Kubernetes headless Service), each on this
// daemon's own port. Every load interval a thread resolves the name and asks each address
// for its Stats: the member id and incarnation come from there (bounded and checked like an
// etcd value). A member whose address leaves the records, stops answering, or answers with
// another incarnation has left. There is nothing to advertise: DNS lists the pod while
// Kubernetes sees it ready, so the state is kAdvertised from the first resolution on.
// With auth on, the Stats calls carry the bearer token of cluster.peer_token_file (read each
// round: a rotated secret is picked up).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "server/cluster/membership.h"
#include "server/config/config.h"

namespace kvcd {

class DnsMembership final : public Membership {
 public:
  // At most this many addresses are asked per round.
  static constexpr size_t kMaxMembers = 1024;

  // `port`: the gRPC port every member serves on (this daemon's). `creds`: how to call a
  // peer (TLS when this daemon serves TLS).
  DnsMembership(const ClusterConfig& config, MemberInfo self, int port,
                std::shared_ptr<grpc::ChannelCredentials> creds);
  ~DnsMembership() override;

  void Start(Listener listener) override;
  void Stop() override;
  MembershipState state() const override;
  const MemberInfo& self() const override { return self_; }
  std::vector<MemberInfo> Members() const override;
  std::optional<MemberInfo> Find(const std::string& member_id) const override;
  uint64_t registrations() const override { return rounds_ok_.load() > 0 ? 1 : 0; }
  uint64_t leases_lost() const override { return 0; }

 private:
  void Loop();
  void Round();
  std::string PeerToken();  // on the loop's thread only

  const ClusterConfig config_;
  const MemberInfo self_;
  const int port_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  Listener listener_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, MemberInfo> members_;
  std::atomic<uint64_t> rounds_ok_{0};
  std::string token_;  // the last token read (the loop's thread)
  std::thread thread_;
};

}  // namespace kvcd
