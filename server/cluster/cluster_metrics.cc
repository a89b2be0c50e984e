#include "server/cluster/cluster_metrics.h"

#include <prometheus/metric_family.h>

#include "server/metrics/family_builder.h"

namespace kvcd {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

using metrics::Add;
using metrics::Family;

}  // namespace

std::vector<MetricFamily> ClusterCollector::Collect() const {
  std::vector<MetricFamily> out;
  const bool ready = parts_.ready != nullptr && parts_.ready->load();
  const Membership* membership =
      ready && parts_.membership != nullptr ? *parts_.membership : nullptr;
  const PrefixPuller* puller = ready && parts_.puller != nullptr ? *parts_.puller : nullptr;
  if (membership != nullptr) {
    auto state = Family("kvcd_cluster_membership_state",
                        "1 for this daemon's membership state (joining, advertised, lost), 0 "
                        "for the others.",
                        MetricType::Gauge);
    const MembershipState now = membership->state();
    for (MembershipState s :
         {MembershipState::kJoining, MembershipState::kAdvertised, MembershipState::kLost}) {
      Add(&state, s == now ? 1 : 0, {{"state", MembershipStateName(s)}});
    }
    out.push_back(std::move(state));
    auto regs = Family("kvcd_cluster_registrations_total",
                       "Times this daemon registered its member key (a new lease each time).",
                       MetricType::Counter);
    Add(&regs, static_cast<double>(membership->registrations()));
    out.push_back(std::move(regs));
    auto lost =
        Family("kvcd_cluster_leases_lost_total",
               "Times a keep-alive failed or etcd no longer knew the lease.", MetricType::Counter);
    Add(&lost, static_cast<double>(membership->leases_lost()));
    out.push_back(std::move(lost));
    auto members = Family("kvcd_cluster_members", "Live members seen in etcd (this one included).",
                          MetricType::Gauge);
    Add(&members, static_cast<double>(membership->Members().size()));
    out.push_back(std::move(members));
  }
  if (parts_.index != nullptr) {
    const BlockIndex& x = *parts_.index;
    auto writes = Family("kvcd_cluster_index_writes_total",
                         "Block changes (stored or removed pages) written to the Redis index.",
                         MetricType::Counter);
    Add(&writes, static_cast<double>(x.writes()));
    out.push_back(std::move(writes));
    auto errors = Family("kvcd_cluster_index_errors_total",
                         "Index writes that failed or were dropped (never a failed request).",
                         MetricType::Counter);
    Add(&errors, static_cast<double>(x.errors()));
    out.push_back(std::move(errors));
    auto lag = Family("kvcd_cluster_index_lag_seconds",
                      "Age of the oldest change of the last batch written to the index.",
                      MetricType::Gauge);
    Add(&lag, x.lag_seconds());
    out.push_back(std::move(lag));
    auto rep = Family("kvcd_cluster_index_republishes_total",
                      "Times every held page was written again (Redis restarted empty, writes "
                      "failed, or membership was lost).",
                      MetricType::Counter);
    Add(&rep, static_cast<double>(x.republishes()));
    out.push_back(std::move(rep));
    auto purges =
        Family("kvcd_cluster_index_purges_total",
               "Incarnations whose index entries this daemon purged.", MetricType::Counter);
    Add(&purges, static_cast<double>(x.purges()));
    out.push_back(std::move(purges));
  }
  if (parts_.events != nullptr) {
    auto ev = Family("kvcd_cluster_events_published_total",
                     "KV events (BlockStored, BlockRemoved, AllBlocksCleared) published.",
                     MetricType::Counter);
    Add(&ev, static_cast<double>(parts_.events->events_published()));
    out.push_back(std::move(ev));
    auto batches =
        Family("kvcd_cluster_event_batches_total",
               "KV event batches published (the last sequence number + 1).", MetricType::Counter);
    Add(&batches, static_cast<double>(parts_.events->batches_published()));
    out.push_back(std::move(batches));
  }
  if (puller != nullptr) {
    auto pulls = Family("kvcd_cluster_pulls_total", "PullPrefix calls by result (ok, error).",
                        MetricType::Counter);
    Add(&pulls, static_cast<double>(puller->pulls()), {{"result", "ok"}});
    Add(&pulls, static_cast<double>(puller->failures()), {{"result", "error"}});
    out.push_back(std::move(pulls));
    auto bytes = Family("kvcd_cluster_pulled_bytes_total", "Page bytes pulled from peers.",
                        MetricType::Counter);
    Add(&bytes, static_cast<double>(puller->pulled_bytes()));
    out.push_back(std::move(bytes));
    auto moved = Family("kvcd_cluster_pulls_by_transport_total",
                        "PullPrefix calls that stored pages, by the transport that moved them "
                        "(grpc, cuda_ipc, nccl).",
                        MetricType::Counter);
    auto moved_bytes = Family("kvcd_cluster_pulled_bytes_by_transport_total",
                              "Page bytes pulled from peers, by transport.", MetricType::Counter);
    auto fallbacks = Family("kvcd_cluster_pull_fallbacks_total",
                            "Device transports given up for the next one (pull_transport auto), "
                            "by the transport given up.",
                            MetricType::Counter);
    for (int i = 0; i < kPullTransports; ++i) {
      const PullTransport t = static_cast<PullTransport>(i);
      const std::string name = PullTransportName(t);
      Add(&moved, static_cast<double>(puller->pulls_by(t)), {{"transport", name}});
      Add(&moved_bytes, static_cast<double>(puller->bytes_by(t)), {{"transport", name}});
      if (t != PullTransport::kGrpc) {
        Add(&fallbacks, static_cast<double>(puller->fallbacks_from(t)), {{"transport", name}});
      }
    }
    out.push_back(std::move(moved));
    out.push_back(std::move(moved_bytes));
    out.push_back(std::move(fallbacks));
  }
  return out;
}

}  // namespace kvcd
