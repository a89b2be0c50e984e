// Target: what a replay drives. The workload (workload.h) says what each request sends; a
// target serves it and says what the cache answered. One implementation so far, a single
// daemon over gRPC (daemon_target.h); a cluster of daemons is another Target.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "bench/replay/latency_log.h"
#include "bench/replay/workload.h"
#include "kvcd/v1/kvcache.pb.h"

namespace kvcd::replay {

// What one request got, in scaled tokens.
struct RequestOutcome {
  int64_t matched_tokens = 0;    // Match: page-aligned cached prefix of the prompt
  int64_t committed_tokens = 0;  // of which served from committed pages
  int64_t inserted_tokens = 0;   // Put: newly stored
  int64_t opened_tokens = 0;     // OpenSequence: tokens the sequence was opened on
  bool commit_served = false;    // the sequence's pages were committed on close
  int64_t commit_inserted_pages = 0;
  int64_t commit_deduplicated_pages = 0;
  // The answer check (DaemonTarget::set_verify_every): made, and whether attention over the
  // sequence differed from the reference (what differed, in wrong_detail).
  bool checked = false, wrong = false;
  std::string wrong_detail;
};

// The target's own counters (Stats), summed over its daemons.
struct TargetStats {
  int64_t evicted_pages = 0;
  int64_t evicted_pages_committed = 0;
  int64_t committed_pages = 0;  // pages in the tree that entered by a commit
  int64_t hit_tokens_committed = 0;
  int64_t cached_tokens = 0;  // of the replay's model
};

class Target {
 public:
  virtual ~Target() = default;
  // Where the requests go, for the report ("daemon 127.0.0.1:50051").
  virtual std::string Describe() const = 0;
  // Makes the model ready (registers it where absent) with a cold cache; returns its
  // capacity in pages (the pages its pools hold, summed over daemons).
  virtual absl::StatusOr<int64_t> Prepare(const v1::ModelProfile& profile) = 0;
  // Serves one request: Match, Put of what missed, OpenSequence, Append of the rest (the
  // partial tail and the output), CloseSequence (committing when `commit`). Records every
  // call's latency in `log`. An error stops the replay.
  virtual absl::StatusOr<RequestOutcome> Serve(const ReplayRequest& request, bool commit,
                                               LatencyLog* log) = 0;
  virtual absl::StatusOr<TargetStats> Stats() = 0;
};

}  // namespace kvcd::replay
