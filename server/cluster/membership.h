// Cluster membership (docs/cluster.md "Membership"): who the live daemons are, and this
// daemon's own advertisement. Two kinds: EtcdMembership (a leased key per member, a watch
// of the members prefix) and DnsMembership (the A records of a headless Service). The rest
// of the daemon sees only this interface.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "server/cluster/member_info.h"

namespace kvcd {

// The grpc.health.v1 service name of a member's place in its cluster: SERVING while
// advertised, NOT_SERVING while joining, after the lease is lost and once draining.
inline constexpr char kClusterHealthService[] = "kvcd.cluster";

enum class MembershipState {
  kJoining,     // not advertised yet (etcd unreachable at start)
  kAdvertised,  // the member key is in etcd under a live lease
  kLost,        // the lease was lost; not advertising (and not writing the index) until
                // re-registered
};
const char* MembershipStateName(MembershipState s);

class Membership {
 public:
  // Called on the membership's own thread; must not block for long.
  struct Listener {
    // A member's key left (lease expired, deleted) or its incarnation changed: `gone` is the
    // member as it was. Never called for this daemon's own current incarnation.
    std::function<void(const MemberInfo& gone)> member_gone;
    // This daemon (re-)registered: `generation` counts the registrations. What others may
    // have purged while it was lost is to be published again.
    std::function<void(uint64_t generation)> advertised;
    // This daemon stopped advertising.
    std::function<void()> lost;
  };

  virtual ~Membership() = default;
  // Starts the background work. Listener callbacks may run from then on.
  virtual void Start(Listener listener) = 0;
  // Stops advertising (revokes the lease: the key goes at once) and stops the threads.
  // Idempotent.
  virtual void Stop() = 0;

  virtual MembershipState state() const = 0;
  virtual const MemberInfo& self() const = 0;
  // The live members, this daemon included when advertised.
  virtual std::vector<MemberInfo> Members() const = 0;
  virtual std::optional<MemberInfo> Find(const std::string& member_id) const = 0;
  // For the metrics: successful registrations, and advertisements lost.
  virtual uint64_t registrations() const = 0;
  virtual uint64_t leases_lost() const = 0;
};

}  // namespace kvcd
