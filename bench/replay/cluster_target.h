// ClusterTarget: a replay's requests served by N kvcd daemons acting as one cache
// (docs/cluster.md). Each request goes to one member, chosen by the routing mode; that
// member then serves it as a DaemonTarget does (Match, Put of what missed, OpenSequence,
// Append, CloseSequence with commit).
//
// Modes:
//   random      a uniformly random member (seeded): N independent per-daemon caches.
//   rendezvous  the highest rendezvous weight of the prompt's first page over all members.
//   index       the cluster client's routing (client/cluster/routing.h): the Redis block
//               index's longest consecutive prefix per member scored against load,
//               bounded-load rendezvous for prefixes nobody holds, hot-prefix replication;
//               with `pull`, a member chosen over a holder of a longer prefix first pulls
//               the difference from that holder (PullPrefix).
//
// Failures (bench/run-replay-cluster-failures.sh): a member that answers UNAVAILABLE is
// taken out of routing and the request is served again, from its start, on the member
// routing picks among the others (what it lacks is prefilled there: a miss, never an error).
// With etcd endpoints the target follows membership as the cluster client does
// (member_directory.h): a member whose key is gone is out; one that comes back with another
// incarnation is connected to again (its model registered) and routed to. Every request's
// outcome is kept (RequestRecord) so that hit rates can be read per window of the replay.
#pragma once

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/replay/daemon_target.h"
#include "bench/replay/target.h"
#include "client/cluster/member_directory.h"
#include "client/cluster/redis_index.h"
#include "client/cluster/routing.h"

namespace kvcd::replay {

enum class RoutingMode { kRandom, kRendezvous, kIndex };
absl::StatusOr<RoutingMode> ParseRoutingMode(const std::string& name);
const char* RoutingModeName(RoutingMode m);

struct ClusterMember {
  std::string member_id;
  std::string address;
  std::string incarnation;
};

// The members at `addresses` (HOST:PORT), each named by its own Stats (member_id, or the
// address when it has no cluster section, and incarnation), as membership mode dns does.
absl::StatusOr<std::vector<ClusterMember>> MembersFromStats(
    const std::vector<std::string>& addresses, const ClientOptions& client);

struct ClusterTargetOptions {
  RoutingMode mode = RoutingMode::kIndex;
  std::vector<ClusterMember> members;
  std::string redis_url;     // index mode
  std::string cluster_name;  // index mode
  cluster::RoutingConfig routing;
  bool pull = true;
  uint64_t seed = 1;
  ClientOptions client;  // target is replaced by each member's address
  // Follow membership here (empty: the members stay those given; one that answered
  // UNAVAILABLE stays out).
  std::vector<std::string> etcd_endpoints;
  int64_t verify_every = 0;  // DaemonTarget::set_verify_every on every member
};

// One request as the cluster served it.
struct RequestRecord {
  int64_t index = 0;         // in the trace
  double seconds = 0;        // since the target's first request, when it was served
  int64_t input_length = 0;  // trace tokens of the prompt
  int64_t matched_tokens = 0;
  int member = -1;           // index in member_ids that served it
  int unavailable = 0;       // members that answered UNAVAILABLE before one served it
  bool index_error = false;  // the lookup failed (routed by rendezvous)
  bool checked = false, wrong = false;
};

// What the cluster did besides serving, for the report.
struct ClusterFigures {
  std::vector<std::string> member_ids;
  std::vector<int64_t> requests;       // per member
  std::vector<int64_t> pages_held;     // per member, at the end (cached tokens / page size)
  std::vector<double> lookup_seconds;  // per request (index mode): hashing + index + loads
  int64_t pulls = 0, pull_errors = 0, pulled_tokens = 0, pulled_bytes = 0;
  int64_t replications = 0;
  int64_t index_errors = 0;  // lookups that failed (the request fell back to rendezvous)
  int64_t index_rejected = 0;
  std::vector<double> pull_seconds;
  int64_t failovers = 0;  // requests served again elsewhere after an UNAVAILABLE
  int64_t rejoins = 0;    // members connected to again under a new incarnation
  int64_t checked = 0, wrong = 0;
  std::vector<std::string> wrong_details;  // the first few
  std::vector<RequestRecord> records;
};

class ClusterTarget : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<ClusterTarget>> Connect(ClusterTargetOptions options);

  std::string Describe() const override;
  absl::StatusOr<int64_t> Prepare(const v1::ModelProfile& profile) override;
  absl::StatusOr<RequestOutcome> Serve(const ReplayRequest& request, bool commit,
                                       LatencyLog* log) override;
  absl::StatusOr<TargetStats> Stats() override;

  int64_t members() const { return static_cast<int64_t>(ids_.size()); }
  // Fills pages_held from the members' Stats; the rest is kept as requests are served.
  absl::StatusOr<ClusterFigures> Figures();

 private:
  explicit ClusterTarget(ClusterTargetOptions options) : options_(std::move(options)) {}
  // The member index that serves `r` (and the pull to make first, if any), among the live
  // members; FAILED_PRECONDITION when none is.
  absl::StatusOr<size_t> Route(const ReplayRequest& r, std::string* pull_from, bool* index_error);
  // Connects to member i at `address` under `incarnation` (the model registered when
  // `prepare`).
  absl::Status Attach(size_t i, const std::string& address, const std::string& incarnation,
                      bool prepare);
  // Takes membership's view: members gone are out, new incarnations are attached.
  void Sync();
  void MarkDown(size_t i);
  std::vector<std::string> LiveIds() const;

  ClusterTargetOptions options_;
  std::vector<std::unique_ptr<Client>> clients_;        // per member: pulls and Stats
  std::vector<std::unique_ptr<DaemonTarget>> targets_;  // per member: serving
  std::vector<std::string> incarnation_of_;             // per member: the incarnation attached
  std::vector<std::string> down_;                       // per member: the incarnation that failed
  std::vector<bool> listed_;  // per member: in membership (always, without)
  std::unique_ptr<cluster::MemberDirectory> directory_;
  bool started_ = false;
  std::chrono::steady_clock::time_point t0_;
  std::unique_ptr<cluster::RedisIndex> index_;
  std::unique_ptr<cluster::HotPrefixes> hot_;
  cluster::Incarnations incarnations_;
  std::vector<std::string> ids_;
  v1::ModelProfile profile_;
  std::string format_ = "bf16";
  std::mt19937_64 rng_;
  ClusterFigures figures_;
};

}  // namespace kvcd::replay
