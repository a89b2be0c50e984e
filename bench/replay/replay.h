// Replay: runs a workload's requests, in trace order, one at a time, against a target, and
// beside it the simulations the figures are compared with: an LRU cache at the target's
// capacity fed the same calls (lru_sim.h), and caches that never evict (the trace's bound,
// with and without committed outputs).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "bench/replay/latency_log.h"
#include "bench/replay/lru_sim.h"
#include "bench/replay/target.h"
#include "bench/replay/workload.h"

namespace kvcd::replay {

struct ReplayOptions {
  bool commit = true;           // ask the target to commit every sequence on close
  double high_watermark = 1.0;  // the target's eviction watermarks, for the simulation
  double low_watermark = 1.0;
  int daemon_pid = 0;  // > 0: measure this local process's CPU time
  // Called after every request with (requests done, daemon hit rate so far).
  std::function<void(int64_t, double)> progress;
  // Called before the request at this position is served (0-based); an error stops the
  // replay (kvcd-replay --hook: a failure made at a known point of the trace).
  std::function<absl::Status(int64_t)> before_request;
};

// Hits in pages (one page = one 512-token trace block).
struct CacheFigures {
  int64_t hit_pages = 0;
  int64_t committed_hit_pages = 0;  // of which from committed pages
};

struct ReplayReport {
  std::string target;
  int32_t page_size = 0;
  int64_t capacity_pages = 0;
  WorkloadSummary workload;
  int64_t requests = 0;  // served (all, unless an error stopped the replay)
  int64_t rpcs = 0;      // calls made, all succeeded
  int64_t commits_served = 0;
  CacheFigures daemon, lru, infinite, infinite_commit;
  int64_t lru_mismatched_requests = 0;  // requests whose daemon match differs from the LRU's
  // Answer checks (kvcd-replay --verify-every): requests checked, and those whose attention
  // differed from the reference.
  int64_t checked_requests = 0, wrong_requests = 0;
  LruSim::Counters lru_counters;
  TargetStats stats_before, stats_after;
  double seconds = 0;              // wall time of the replay
  double daemon_cpu_seconds = -1;  // -1: not measured
  double client_cpu_seconds = 0;   // this process
  LatencyLog latency;

  // Hit rates in trace tokens: hit pages * 512 / prompt tokens.
  double HitRate(const CacheFigures& f) const;
  double CommittedRate(const CacheFigures& f) const;
};

absl::StatusOr<ReplayReport> Replay(const TraceWorkload& workload, Target& target,
                                    const v1::ModelProfile& profile, const ReplayOptions& options);

// CPU seconds (user + system) of a local process from /proc/<pid>/stat.
absl::StatusOr<double> ProcessCpuSeconds(int pid);

}  // namespace kvcd::replay
