// Membership on etcd v3 (docs/cluster.md "Membership"): the member key
// <MembersPrefix><member_id> holds the MemberInfo JSON under a lease of cluster.lease_ttl_s,
// kept alive every TTL/3 by one thread; a failed keep-alive or a lease etcd no longer knows
// ends the advertisement (state kLost) and the thread registers again under a new lease,
// with the same incarnation. A second thread keeps the member table from a Range of the
// prefix and a Watch from the revision after it, and reports members that leave.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "server/cluster/etcd_client.h"
#include "server/cluster/membership.h"
#include "server/config/config.h"

namespace kvcd {

class EtcdMembership final : public Membership {
 public:
  // At most this many members are read from etcd (a larger prefix is refused as hostile).
  static constexpr int64_t kMaxMembers = 4096;

  EtcdMembership(const ClusterConfig& config, MemberInfo self);
  ~EtcdMembership() override;

  void Start(Listener listener) override;
  void Stop() override;
  MembershipState state() const override;
  const MemberInfo& self() const override { return self_; }
  std::vector<MemberInfo> Members() const override;
  std::optional<MemberInfo> Find(const std::string& member_id) const override;

  uint64_t registrations() const override { return generation_.load(); }
  uint64_t leases_lost() const override { return leases_lost_.load(); }

 private:
  void LeaseLoop();
  void WatchLoop();
  // Range + Watch until the watch ends; false when stopping.
  bool WatchOnce();
  void SetMembers(std::map<std::string, MemberInfo> members);
  void Apply(const etcdserverpb::Event& e);
  void Gone(const MemberInfo& m);
  // Waits for `d` or Stop(); false when stopping.
  bool Pause(std::chrono::milliseconds d);

  const ClusterConfig config_;
  const MemberInfo self_;
  const std::string key_;
  EtcdClient etcd_;
  Listener listener_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  MembershipState state_ = MembershipState::kJoining;
  int64_t lease_id_ = 0;
  std::map<std::string, MemberInfo> members_;
  EtcdClient::Watch* watch_ = nullptr;  // the live watch, for Stop() to cancel
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> leases_lost_{0};
  std::thread lease_thread_, watch_thread_;
};

}  // namespace kvcd
