// The kvcd_cluster_* metrics (docs/cluster.md, docs/operating.md "Metrics"), read at scrape
// time from the cluster's parts: membership state and registrations, index writes, errors,
// lag, republishes and purges, events published, pulls and pulled bytes.
#pragma once

#include <prometheus/collectable.h>

#include <atomic>
#include <vector>

#include "server/cluster/block_index.h"
#include "server/cluster/event_publisher.h"
#include "server/cluster/membership.h"
#include "server/cluster/prefix_puller.h"

namespace kvcd {

class ClusterCollector final : public prometheus::Collectable {
 public:
  // Any part may be null (not configured). membership and puller are read only once
  // `ready` is true (they are made after the metrics start serving).
  struct Parts {
    const BlockIndex* index = nullptr;
    const EventPublisher* events = nullptr;
    const Membership* const* membership = nullptr;
    const PrefixPuller* const* puller = nullptr;
    const std::atomic<bool>* ready = nullptr;
  };
  explicit ClusterCollector(Parts parts) : parts_(parts) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Parts parts_;
};

}  // namespace kvcd
