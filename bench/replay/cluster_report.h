// The cluster target's figures as JSON (kvcd-replay --cluster-json): per-member requests and
// pages held (and max/mean), lookup latency percentiles, pulls and replications, failovers,
// answer checks, and one row per request (RequestRecord).
#pragma once

#include <string>

#include "bench/replay/cluster_target.h"

namespace kvcd::replay {

std::string ClusterFiguresJson(const ClusterFigures& f);

}  // namespace kvcd::replay
